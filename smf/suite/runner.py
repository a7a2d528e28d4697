"""Run a suite: train what each (condition, seed) needs, evaluate it, write its results file.

Resuming: a run is finished when ``results/{condition}-seed{s}.json`` exists (written atomically,
last); finished runs are skipped. A training stage is finished when its directory holds
``suite_stage.json`` (written after the trainer returned); a stage with a checkpoint but no
marker continues through the trainer's ``--resume``; the shared retrofit and background stages
are trained by the first run that needs them and reused by the others. Results, stage markers
and trainer directories from a differently configured suite are refused with a ConfigError
rather than mixed in.

The suite runs in one process on one device (``device`` of the config), stages and evaluations one after
another; or, with ``jobs`` > 1 (``smf suite --jobs N``), in N worker processes (:mod:`smf.suite.jobs`: one torch
thread each unless ``threads`` says otherwise), each shared stage before the runs that need it, with the same
results. A suite with ``hypotheses`` records them, with the time and the number of runs finished then, in
``hypotheses_registered.json`` before its first run (a later change of them is recorded, and reported, as such).
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import gc
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
from smf.suite.cost import log_records, parameter_counts, sparse_step_stats, training_cost
from smf.suite.finished import run_state
from smf.suite.fingerprints import merged_plan, recorded_fingerprint, run_hash, stage_fingerprints
from smf.suite.jobs import Task, run_tasks
from smf.suite.plan import Run, SuiteLayout, plan_runs, sparse_stage_dirs, stage_config
from smf.suite.science import prepare_science_inputs
from smf.suite.status import write_status
from smf.suite.stream import StreamRun
from smf.threads import use_threads
from smf.train.background import collect_background
from smf.train.checkpoint import CHECKPOINT_FILE, LOG_FILE
from smf.train.config import RunConfig
from smf.train.distributed import pick_device
from smf.train.loop import train

logger = logging.getLogger(__name__)

STAGE_MARKER = "suite_stage.json"
SHARED_STAGES = ("retrofit", "background")  # what a sparse run starts from, shared with the other runs of its seed


def shared_stages(config: SuiteConfig) -> tuple[str, ...]:
    """The shared stages a sparse run of ``config`` (one seed's) trains: no retrofit on a base pretrained with its
    memories (:func:`smf.suite.config.pretrained_adapter`), whose memory adapter is the background's start."""
    return SHARED_STAGES[1:] if pretrained_adapter(config) else SHARED_STAGES
# What `smf report` writes into a suite directory besides suite_status (rewritten by every call)
REPORT_FILES = ("table1.md", "table1.csv", "table1.tex", "pareto.png", "pareto.pdf", "accounting.md",
                "accounting.json", "ablation_update.md", "ablation_update.json", "report.md", "lr_sweep.md",
                "lr_sweep.json", "pareto_sweep.png", "ablation_reads.md", "ablation_reads.json",
                "science_diagnostics.md", "science_diagnostics.json", "matched_learning.md", "matched_learning.json",
                "matched_learning.png", "environment.md", "environment.json", "locality.md", "locality.json",
                "stream.md", "stream.json", "stream_forgetting.png")
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


def ensure_stage(kind: str, config: RunConfig, root: Path) -> dict:
    """Run one training stage (kind: retrofit, background or train) of the suite in folder ``root`` unless it already
    finished (its marker's fingerprint: :func:`smf.suite.fingerprints.stage_fingerprints`).

    Returns its marker: {"fingerprint", "seconds", "cpu_seconds" (process time of this process; markers written
    before it was recorded lack it), "resumed", "skipped"}.
    """
    output_dir = Path(config.output_dir)
    marker_path = output_dir / STAGE_MARKER
    fingerprints = stage_fingerprints(config.to_dict(), root)
    fingerprint = fingerprints[0]
    foreign = f"{output_dir} holds a {kind} run with other options than this suite's; delete it or use another " \
              "output_dir"
    if marker_path.is_file():
        marker = read_json_object(marker_path, "suite stage marker", ("fingerprint",))
        if marker["fingerprint"] not in fingerprints:
            raise ConfigError(foreign)
        return {**marker, "skipped": True}
    if (output_dir / RUN_CONFIG).is_file():
        if recorded_fingerprint(read_run_config(output_dir), output_dir, root) != fingerprint:
            raise ConfigError(foreign)
    resume = (output_dir / CHECKPOINT_FILE).is_file()
    logger.info("%s %s: %s", "resuming" if resume else "starting", kind, output_dir)
    started, cpu_started = time.perf_counter(), time.process_time()
    if kind == "background":
        collect_background(config)
    else:
        result = train(dataclasses.replace(config, resume=resume))
        if result["final_dir"] is None:
            raise RuntimeError(f"{kind} in {output_dir} stopped at step {result['step']} of "
                               f"{result['total_steps']} without a final artefact")
    marker = {"fingerprint": fingerprint, "seconds": round(time.perf_counter() - started, 3), "resumed": resume,
              "cpu_seconds": round(time.process_time() - cpu_started, 3)}
    write_json_atomic(marker_path, marker)
    return {**marker, "skipped": False}


class SuiteRunner:
    """Runs the plan of a :class:`SuiteConfig` into ``config.output_dir``."""

    def __init__(self, config: SuiteConfig) -> None:
        self.config = config
        self.layout = SuiteLayout(config.output_dir)
        self.device = pick_device(config.device)
        self._eval_sets: dict = {}
        self._parameters: dict[str, dict] = {}  # run name -> smf.suite.cost.parameter_counts of its trained model

    def pending(self) -> list[Run]:
        """Planned runs not finished yet (:func:`smf.suite.finished.run_state`)."""
        return [run for run in plan_runs(self.config) if not self.done(run)]

    def done(self, run: Run) -> bool:
        """Whether ``run`` finished: its results file holds a whole record of this configuration."""
        return run_state(self.layout, self.config, run).state == "done"

    def train_stages(self, run: Run) -> dict[str, dict]:
        """Train (or reuse) every stage ``run`` needs; returns their markers by stage kind."""
        config, layout = seed_config(self.config, run.seed), self.layout
        if run.recipe is None:
            return {}
        pretrained = pretrained_adapter(config)  # a base pretrained with its memories: no retrofit
        if run.recipe != "sparse":
            return {"train": ensure_stage("train", stage_config(config, run.recipe, run.seed, layout.train_dir(run),
                                                                lr=run.lr, epochs=run.epochs, adapter=pretrained),
                                          layout.root)}
        retrofit_dir, background_dir = sparse_stage_dirs(layout, run, config)
        markers = self.shared_markers(run)
        markers["train"] = ensure_stage("train", stage_config(
            config, "sparse", run.seed, layout.train_dir(run), mode=run.mode, rule=run.rule, adapter=retrofit_dir,
            background=background_dir, update="authors" if run.update == "authors" else None, lr=run.lr,
            count_reads=run.reads, variant=run.variant, epochs=run.epochs), layout.root)
        return markers

    def shared_markers(self, run: Run) -> dict[str, dict]:
        """Train (or reuse) every shared stage the sparse ``run`` starts from (:func:`shared_stages`); returns their
        markers by kind."""
        return {kind: self.shared_stage(run, kind) for kind in shared_stages(seed_config(self.config, run.seed))}

    def shared_stage(self, run: Run, kind: str) -> dict:
        """Train (or reuse) the shared ``kind`` stage (retrofit, or background: its retrofit must be done) the sparse
        ``run`` starts from; returns its marker."""
        config = seed_config(self.config, run.seed)
        retrofit_dir, background_dir = sparse_stage_dirs(self.layout, run, config)
        if kind == "retrofit":
            return ensure_stage("retrofit", stage_config(config, "retrofit", run.seed, retrofit_dir,
                                                         mode=run.retrofit_mode, variant=run.variant), self.layout.root)
        return ensure_stage("background", stage_config(config, "background", run.seed, background_dir,
                                                       adapter=retrofit_dir, variant=run.variant), self.layout.root)

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
        if run.recipe is not None:
            self._parameters[run.name] = parameter_counts(model, run.recipe)
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
        state = run_state(self.layout, self.config, run)
        if state.state == "done":
            return state.record
        if state.state == "foreign":
            raise ConfigError(f"{state.why}; delete it to recompute that run, or use another output_dir")
        if state.state == "damaged":
            logger.warning("%s; computing the run again", state.why)
        if self.config.stream:  # tasks one after another, evaluated after each (smf.suite.stream)
            return StreamRun(self, run, functools.partial(ensure_stage, root=self.layout.root)).results()
        started, cpu_started = time.perf_counter(), time.process_time()
        markers = self.train_stages(run)
        eval_cpu_started = time.process_time()
        metrics, eval_seconds, artefact, eval_rows = self.evaluate(run)
        eval_cpu = time.process_time() - eval_cpu_started
        records = log_records(self.layout.train_dir(run) / LOG_FILE) if run.recipe is not None else []
        cost = None
        if run.recipe is not None and run.name in self._parameters:
            cost = training_cost(records, self._parameters.pop(run.name))
        results = {
            "condition": run.condition, "seed": run.seed, "update": run.update, "metrics": metrics,
            **({} if run.lr is None else {"lr": run.lr}), **({"reads": run.reads} if run.reads else {}),
            **({"variant": run.variant} if run.variant else {}),
            **({} if run.epochs is None else {"epochs": run.epochs}),
            "sparse_steps": sparse_step_stats(records) if run.recipe == "sparse" else None,
            "cost": cost,
            "timing": {**{f"{kind}_s": marker["seconds"] for kind, marker in markers.items()},
                       "eval_s": eval_seconds, "wall_s": round(time.perf_counter() - started, 3),
                       **{f"{kind}_cpu_s": marker["cpu_seconds"] for kind, marker in markers.items()
                          if marker.get("cpu_seconds") is not None},
                       "eval_cpu_s": round(eval_cpu, 3), "cpu_s": round(time.process_time() - cpu_started, 3)},
            "eval_rows": eval_rows, "config_hash": expected_hash, "artefact": artefact,
            "model": seed_config(self.config, run.seed).model, "environment": environment(),
            "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        write_json_atomic(path, results)
        logger.info("%s: %s", run.name, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        return results

    def record_plan(self) -> SuiteConfig:
        """Write ``suite_config.json``: this call's config joined with the one recorded there when both compute
        the same (:func:`~smf.suite.fingerprints.merged_plan`: a call on some seeds or conditions keeps the directory's
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

    def register_hypotheses(self, recorded: SuiteConfig) -> None:
        """``hypotheses_registered.json``: the hypotheses with the time and the number of finished runs of the
        ``recorded`` plan (:meth:`record_plan`), written when there is none or the hypotheses changed (a warning
        then: the report says they were registered after those runs)."""
        path = self.layout.hypotheses_file
        hypotheses = recorded.to_dict()["hypotheses"]
        if not hypotheses:
            return
        if path.is_file():
            if read_json_object(path, "hypotheses record").get("hypotheses") == hypotheses:
                return
            logger.warning("%s: the hypotheses changed; they are recorded as registered now, after the runs already "
                           "finished (the report says so)", path)
        planned = plan_runs(recorded)
        finished = sum(run_state(self.layout, recorded, run).state == "done" for run in planned)
        write_json_atomic(path, {"hypotheses": hypotheses, "runs_finished": finished, "runs_planned": len(planned),
                                 "registered_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
                                     timespec="seconds")})

    def tasks(self, runs: list[Run]) -> list[Task]:
        """The unfinished ``runs`` as tasks for :func:`smf.suite.jobs.run_tasks`, in plan order, each unfinished
        shared stage (retrofit, background) a task of its own just before the first run that needs it."""
        tasks, created = [], set()
        for run in runs:
            if self.done(run):
                continue
            needs: tuple = ()
            if run.recipe == "sparse":
                directories = sparse_stage_dirs(self.layout, run, seed_config(self.config, run.seed))
                for kind, directory in zip(SHARED_STAGES, directories):
                    if kind not in shared_stages(seed_config(self.config, run.seed)):
                        continue
                    key = (kind, str(directory))
                    if key not in created and not (directory / STAGE_MARKER).is_file():
                        tasks.append(Task(key, (kind, run), needs))
                        created.add(key)
                    needs = (key,) if key in created else needs
            tasks.append(Task(("run", run.name), ("run", run), needs, run.name))
        return tasks

    def run_in_processes(self, runs: list[Run], jobs: int, failed: dict[str, str]) -> None:
        """Every unfinished run of ``runs`` in ``jobs`` worker processes (:meth:`tasks`); ``failed`` gets the run
        name (a shared stage: the first run that needs it) -> error of the first task that raised, which is then
        raised again."""
        done = sum(self.done(run) for run in runs)
        threads = self.config.threads or 1
        logger.info("%d worker processes, %d torch thread%s each", jobs, threads, "" if threads == 1 else "s")
        active: list[str] = []
        with tqdm(total=len(runs), initial=done, desc=f"suite {self.config.name}", unit="run") as progress:
            def started(task: Task) -> None:
                active.append(task.run or f"{task.key[0]} for {task.payload[1].name}")
                progress.set_postfix_str(", ".join(active))

            def finished(task: Task, _) -> None:
                active.remove(task.run or f"{task.key[0]} for {task.payload[1].name}")
                progress.set_postfix_str(", ".join(active))
                if task.run is not None:
                    progress.update(1)

            failure = run_tasks(self.tasks(runs), jobs, _work, _start_worker,
                                (self.config, threads, logging.getLogger().level), finished, started,
                                {"TQDM_DISABLE": "1"})
        if failure is not None:
            task, error = failure
            failed[task.payload[1].name] = f"{type(error).__name__}: {error}".splitlines()[0][:200]
            raise error

    def run(self, jobs: int = 1) -> list[dict]:
        """Every planned run, skipping finished ones (in ``jobs`` worker processes when more than one); returns
        their results in plan order."""
        runs = plan_runs(self.config)
        self.config.output_dir.mkdir(parents=True, exist_ok=True)
        use_threads(self.config.threads, self.config.model)
        prepare_science_inputs(self.config)  # the world's files and the pretrained model, when configured
        recorded = self.record_plan()
        self.register_hypotheses(recorded)
        todo = len(self.pending())
        logger.info("suite %s: %d runs (%d finished, %d to do) in %s", self.config.name, len(runs),
                    len(runs) - todo, todo, self.config.output_dir)
        results, failed = [], {}
        once = _OncePerSuite()
        for name in DATA_LOGGERS:
            logging.getLogger(name).addFilter(once)
        try:
            if jobs > 1 and todo:
                self.run_in_processes(runs, jobs, failed)
            with tqdm(runs, desc=f"suite {self.config.name}", unit="run", disable=jobs > 1) as progress:
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


_WORKER: list[SuiteRunner] = []  # a worker process's runner (smf.suite.jobs): set once by _start_worker


def _start_worker(config: SuiteConfig, threads: int, level: int) -> None:
    """Set up a worker process of :meth:`SuiteRunner.run_in_processes` (started with ``TQDM_DISABLE``: the parent
    shows the suite's progress): logging as the parent's, ``threads`` torch threads, a runner of ``config``."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    once = _OncePerSuite()
    for name in DATA_LOGGERS:
        logging.getLogger(name).addFilter(once)
    use_threads(threads, config.model)
    _WORKER.append(SuiteRunner(config))


def _work(payload: tuple[str, Run]) -> dict:
    """One task in a worker process: ("run", run) -> its results; (shared stage kind, run) -> the stage's marker."""
    kind, run = payload
    runner = _WORKER[0]
    return runner.run_one(run) if kind == "run" else runner.shared_stage(run, kind)


def run_suite(config: SuiteConfig, jobs: int = 1) -> list[dict]:
    """Run (or finish) the suite of ``config`` (in ``jobs`` worker processes when more than one); see
    :class:`SuiteRunner`."""
    return SuiteRunner(config).run(jobs)
