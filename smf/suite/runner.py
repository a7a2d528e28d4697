"""Run a suite: train what each (condition, seed) needs, evaluate it, write its results file.

Resuming: a run is finished when ``results/{condition}-seed{s}.json`` exists (written atomically,
last); finished runs are skipped. A training stage is finished when its directory holds
``suite_stage.json`` (written after the trainer returned); a stage with a checkpoint but no
marker continues through the trainer's ``--resume``; the shared retrofit and background stages
are trained by the first run that needs them and reused by the others. Results, stage markers
and trainer directories from a differently configured suite are refused with a ConfigError
rather than mixed in.

The suite runs in one process on one device (``device`` of the config); stages and evaluations
run one after another.
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import logging
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from smf.environment import environment
from smf.errors import ConfigError
from smf.eval.tasks import evaluate_model, load_eval_sets
from smf.files import read_json_object, write_json_atomic
from smf.model.loading import FINAL_DIR, RUN_CONFIG, load_model, read_run_config
from smf.suite.config import SuiteConfig, pretrained_adapter, seed_config
from smf.suite.plan import (Run, SuiteLayout, merged_plan, options_fingerprint, plan_runs, run_hash,
                            sparse_stage_dirs, stage_config)
from smf.suite.science import prepare_science_inputs
from smf.suite.status import write_status
from smf.threads import use_threads
from smf.train.background import collect_background
from smf.train.checkpoint import CHECKPOINT_FILE, LOG_FILE
from smf.train.config import RunConfig
from smf.train.distributed import pick_device
from smf.train.loop import train

logger = logging.getLogger(__name__)

STAGE_MARKER = "suite_stage.json"
# What `smf report` writes into a suite directory besides suite_status (rewritten by every call)
REPORT_FILES = ("table1.md", "table1.csv", "table1.tex", "pareto.png", "pareto.pdf", "accounting.md",
                "accounting.json", "ablation_update.md", "ablation_update.json", "report.md", "lr_sweep.md",
                "lr_sweep.json", "pareto_sweep.png", "ablation_reads.md", "ablation_reads.json",
                "science_diagnostics.md", "science_diagnostics.json", "matched_learning.md", "matched_learning.json",
                "matched_learning.png", "environment.md", "environment.json", "locality.md", "locality.json")
ABLATION_FILES = ("ablation_update.md", "ablation_update.json")
DATA_LOGGERS = ("smf.data.sources",)  # their warnings (e.g. fewer rows than asked) are the same for every run


class _OncePerSuite(logging.Filter):
    """Lets each distinct warning through once: a suite loads the same data for every run."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


def read_results(path: Path, expected_hash: str) -> dict:
    """A finished run's results, refused if another configuration wrote them."""
    results = read_json_object(path, "suite results file", ("config_hash", "metrics", "timing"))
    if results.get("config_hash") != expected_hash:
        raise ConfigError(f"{path} was written by a suite with other settings (config hash "
                          f"{results.get('config_hash')} != {expected_hash}); delete it to recompute that run, "
                          "or use another output_dir")
    return results


def sparse_step_stats(train_dir: Path) -> dict:
    """Mean per optimizer step of a sparse run's train_log.jsonl: rows selected (all layers) and value
    rows that moved without being selected (all layers)."""
    records = [json.loads(line) for line in (train_dir / LOG_FILE).read_text().splitlines() if line.strip()]
    return {"steps": len(records),
            "selected_rows": sum(r["selected_rows"] for r in records) / max(len(records), 1),
            "rows_moved_outside": sum(r["rows_moved_outside"] for r in records) / max(len(records), 1)}


def ensure_stage(kind: str, config: RunConfig) -> dict:
    """Run one training stage (kind: retrofit, background or train) unless it already finished.

    Returns its marker: {"fingerprint", "seconds", "resumed", "skipped"}.
    """
    output_dir = Path(config.output_dir)
    marker_path = output_dir / STAGE_MARKER
    fingerprint = options_fingerprint(config.to_dict())
    foreign = f"{output_dir} holds a {kind} run with other options than this suite's; delete it or use another " \
              "output_dir"
    if marker_path.is_file():
        marker = read_json_object(marker_path, "suite stage marker", ("fingerprint",))
        if marker["fingerprint"] != fingerprint:
            raise ConfigError(foreign)
        return {**marker, "skipped": True}
    if (output_dir / RUN_CONFIG).is_file():
        if options_fingerprint(read_run_config(output_dir)) != fingerprint:
            raise ConfigError(foreign)
    resume = (output_dir / CHECKPOINT_FILE).is_file()
    logger.info("%s %s: %s", "resuming" if resume else "starting", kind, output_dir)
    started = time.perf_counter()
    if kind == "background":
        collect_background(config)
    else:
        result = train(dataclasses.replace(config, resume=resume))
        if result["final_dir"] is None:
            raise RuntimeError(f"{kind} in {output_dir} stopped at step {result['step']} of "
                               f"{result['total_steps']} without a final artefact")
    marker = {"fingerprint": fingerprint, "seconds": round(time.perf_counter() - started, 3), "resumed": resume}
    write_json_atomic(marker_path, marker)
    return {**marker, "skipped": False}


class SuiteRunner:
    """Runs the plan of a :class:`SuiteConfig` into ``config.output_dir``."""

    def __init__(self, config: SuiteConfig) -> None:
        self.config = config
        self.layout = SuiteLayout(config.output_dir)
        self.device = pick_device(config.device)
        self._eval_sets: dict = {}

    def pending(self) -> list[Run]:
        """Planned runs whose results file does not exist yet."""
        return [run for run in plan_runs(self.config) if not self.layout.results_path(run).is_file()]

    def train_stages(self, run: Run) -> dict[str, dict]:
        """Train (or reuse) every stage ``run`` needs; returns their markers by stage kind."""
        config, layout = seed_config(self.config, run.seed), self.layout
        if run.recipe is None:
            return {}
        pretrained = pretrained_adapter(config)  # a base pretrained with its memories: no retrofit
        if run.recipe != "sparse":
            return {"train": ensure_stage("train", stage_config(config, run.recipe, run.seed, layout.train_dir(run),
                                                                lr=run.lr, adapter=pretrained))}
        retrofit_dir, background_dir = sparse_stage_dirs(layout, run, config)
        markers = {} if pretrained else {"retrofit": ensure_stage("retrofit", stage_config(
            config, "retrofit", run.seed, retrofit_dir, mode=run.retrofit_mode, variant=run.variant))}
        markers["background"] = ensure_stage("background", stage_config(
            config, "background", run.seed, background_dir, adapter=retrofit_dir, variant=run.variant))
        markers["train"] = ensure_stage("train", stage_config(
            config, "sparse", run.seed, layout.train_dir(run), mode=run.mode, rule=run.rule, adapter=retrofit_dir,
            background=background_dir, update="authors" if run.update == "authors" else None, lr=run.lr,
            count_reads=run.reads, variant=run.variant))
        return markers

    def evaluate(self, run: Run) -> tuple[dict, dict, str, dict]:
        """(metrics, seconds per task, artefact, rows scored / skipped per task) of ``run``'s trained model (the
        base model for base)."""
        config = seed_config(self.config, run.seed)
        if config.data not in self._eval_sets:  # one set per world (per seed with base_per_seed)
            self._eval_sets = {config.data: load_eval_sets(config.data, config.eval, config.protocol)}
        run_dir = None if run.recipe is None else self.layout.train_dir(run)
        model, tokenizer = load_model(config.model, run_dir or pretrained_adapter(config), self.device)
        artefact = config.model if run_dir is None else str(run_dir / FINAL_DIR)
        rows = {}
        try:
            metrics, seconds = evaluate_model(model, tokenizer, self._eval_sets[config.data], config.eval,
                                              self.layout.eval_dir(run), config.protocol, rows=rows)
        finally:
            del model
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return metrics, seconds, artefact, rows

    def run_one(self, run: Run) -> dict:
        """Train, evaluate and record ``run`` (or read its results if finished); returns the results."""
        expected_hash = run_hash(self.config, run)
        path = self.layout.results_path(run)
        if path.is_file():
            return read_results(path, expected_hash)
        started = time.perf_counter()
        markers = self.train_stages(run)
        metrics, eval_seconds, artefact, eval_rows = self.evaluate(run)
        results = {
            "condition": run.condition, "seed": run.seed, "update": run.update, "metrics": metrics,
            **({} if run.lr is None else {"lr": run.lr}), **({"reads": run.reads} if run.reads else {}),
            **({"variant": run.variant} if run.variant else {}),
            "sparse_steps": sparse_step_stats(self.layout.train_dir(run)) if run.recipe == "sparse" else None,
            "timing": {**{f"{kind}_s": marker["seconds"] for kind, marker in markers.items()},
                       "eval_s": eval_seconds, "wall_s": round(time.perf_counter() - started, 3)},
            "eval_rows": eval_rows, "config_hash": expected_hash, "artefact": artefact,
            "model": seed_config(self.config, run.seed).model, "environment": environment(),
            "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        write_json_atomic(path, results)
        logger.info("%s: %s", run.name, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        return results

    def record_plan(self) -> SuiteConfig:
        """Write ``suite_config.json``: this call's config joined with the one recorded there when both compute
        the same (:func:`~smf.suite.plan.merged_plan`: a call on some seeds or conditions keeps the directory's
        fuller plan, and its report every finished run), else this call's config, which replaces it (the files
        of the old report are removed). Removes an update ablation report the recorded plan no longer has.
        Returns the recorded config."""
        layout = self.layout
        previous = read_json_object(layout.config_file, "suite config record") if layout.config_file.is_file() \
            else None
        recorded = merged_plan(previous, self.config)
        stale = ABLATION_FILES if recorded is not None and not recorded.authors_update else ()
        if recorded is None:
            logger.warning("%s recorded a suite with other settings: this call's config replaces it, and the "
                           "report shows this config's runs only (another --output-dir keeps both)", layout.config_file)
            recorded, stale = self.config, REPORT_FILES
        elif set(plan_runs(recorded)) != set(plan_runs(self.config)):
            logger.info("this call runs %d of the %d runs planned in %s: it keeps the whole plan (seeds %s, "
                        "conditions %s, authors_update %s) and the report covers every finished run of it",
                        len(plan_runs(self.config)), len(plan_runs(recorded)), layout.config_file,
                        list(recorded.seeds), list(recorded.conditions), list(recorded.authors_update) or "none")
        write_json_atomic(layout.config_file, recorded.to_dict())
        for name in stale:
            if (layout.root / name).is_file():
                (layout.root / name).unlink()
                logger.info("removed %s: the recorded suite does not report it", layout.root / name)
        return recorded

    def run(self) -> list[dict]:
        """Every planned run, skipping finished ones; returns their results in plan order."""
        runs = plan_runs(self.config)
        self.config.output_dir.mkdir(parents=True, exist_ok=True)
        use_threads(self.config.threads, self.config.model)
        prepare_science_inputs(self.config)  # the world's files and the pretrained model, when configured
        recorded = self.record_plan()
        todo = len(self.pending())
        logger.info("suite %s: %d runs (%d finished, %d to do) in %s", self.config.name, len(runs),
                    len(runs) - todo, todo, self.config.output_dir)
        results, failed = [], {}
        once = _OncePerSuite()
        for name in DATA_LOGGERS:
            logging.getLogger(name).addFilter(once)
        try:
            with tqdm(runs, desc=f"suite {self.config.name}", unit="run") as progress:
                for run in progress:
                    progress.set_postfix_str(run.name)
                    try:
                        results.append(self.run_one(run))
                    except Exception as err:
                        failed[run.name] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
                        raise
        finally:
            for name in DATA_LOGGERS:
                logging.getLogger(name).removeFilter(once)
            write_status(recorded, self.config.output_dir, failed)
        return results


def run_suite(config: SuiteConfig) -> list[dict]:
    """Run (or finish) the suite of ``config``; see :class:`SuiteRunner`."""
    return SuiteRunner(config).run()
