"""A stream of tasks (``stream:`` of a suite config; docs/science.md#a-stream-of-tasks): every trained run of the
suite learns the world's new people as tasks A, B, C, ... (:mod:`smf.data.stream_tasks`) one after another, each
stage starting from the previous stage's result, and is evaluated after every stage on the old facts, the held-out
texts and every task (earlier, current and later ones: the whole accuracy matrix).

How each method continues (each stage trains ``stages.{recipe}``'s epochs, or those of the run's ``schedule_sweep``
configuration, on its task at the run's rate):

- sparse: stage 1 trains the retrofit's memories as a single-task run does; stage k trains the memories stage k-1
  left (its adapter), the base model frozen throughout. The background statistics are the retrofit's, computed once
  on the background corpus and kept for every stage: they stand for what the model reads on ordinary text, which a
  stream does not change (the background corpus is the old people's; recomputing them on the trained memories would
  let each stage's own updates redefine "ordinary").
- lora: merge, then a new adapter: after stage k its adapter is merged into the weights it was trained on
  (``stage{k}-merged/``, a plain model), and stage k+1 trains a fresh adapter of the same rank on that model: every
  stage gets the same trainable capacity, as a model finetuned week by week would.
- full: stage k continues from stage k-1's weights (a new optimizer and schedule per stage, as for every method).

On a base pretrained with its memories (``pretrain.memory``) nothing is retrofitted: stage 1 of every method starts
from the base with its pretrained memories (sparse: they are the memories it trains, its background statistics
computed on them; LoRA and full: they are part of the network, frozen under LoRA), and later stages continue from
what the previous stage left, memories included (the merged LoRA model and the full model hold them).

Stage k's run directory is ``stream/{run}/stage{k}-task{X}/``, the last stage's the run's usual ``train/{run}/``
(so Table 1, ``smf eval`` and the diagnostics read the model after the whole stream); its evaluation goes to
``eval/{run}/stage{k}/`` (``taskX/learn.jsonl`` per task) and its record to ``stream/{run}/stage{k}.json``, written
last. A killed stream resumes at the stage it was in: finished stages (record written) are read back, the stage in
progress resumes its trainer's checkpoint (or only its evaluation). The base condition is evaluated once, as stage 0.

The run's results file (:mod:`smf.suite.runner`'s fields) holds the last stage's metrics, with ``learn_acc`` the
last task's accuracy, and ``stream``: the tasks and every stage's record.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import gc
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from smf.data.stream_tasks import StreamOptions, task_name, write_stream_tasks
from smf.data.world import WorldOptions, build_world
from smf.environment import environment
from smf.errors import ConfigError
from smf.eval.tasks import evaluate_model, load_eval_sets
from smf.files import read_json_object, write_json_atomic
from smf.model.loading import FINAL_DIR, load_model, load_run
from smf.suite.config import SuiteConfig, pretrained_adapter, seed_config
from smf.suite.cost import log_records, parameter_counts, sparse_step_stats, training_cost
from smf.suite.fingerprints import run_hash, run_hashes
from smf.suite.plan import Run, SuiteLayout, sparse_stage_dirs, stage_config
from smf.train.checkpoint import LOG_FILE
from smf.train.config import RunConfig
from smf.vocabulary import METRIC_OF_TASK

STREAM_DIR = "stream"
MERGED_MARKER = "merged.json"


@dataclasses.dataclass(frozen=True)
class StreamLayout:
    """Where a stream run's stages live in a suite directory (module docstring)."""

    root: Path
    tasks: int

    def stage_dir(self, run: Run, stage: int) -> Path:
        """Trainer directory of 1-based ``stage`` (the last one: the run's ``train/{run}``)."""
        if stage == self.tasks:
            return SuiteLayout(self.root).train_dir(run)
        return self.root / STREAM_DIR / run.name / f"stage{stage}-task{task_name(stage - 1)}"

    def merged_dir(self, run: Run, stage: int) -> Path:
        """The LoRA run's model after ``stage`` with that stage's adapter merged (the next stage's base)."""
        return self.root / STREAM_DIR / run.name / f"stage{stage}-merged"

    def record_path(self, run: Run, stage: int) -> Path:
        return self.root / STREAM_DIR / run.name / f"stage{stage}.json"

    def eval_dir(self, run: Run, stage: int) -> Path:
        return SuiteLayout(self.root).eval_dir(run) / f"stage{stage}"


def stream_task_files(config: SuiteConfig) -> list[dict[str, str]]:
    """The task files of ``config`` (one seed's: :func:`~smf.suite.config.seed_config`), written beside its world
    files when missing or changed (once per process: building a world takes most of a CPU-second): per task, role
    (train, eval_learn) -> path."""
    return _task_files(json.dumps(config.world, sort_keys=True), StreamOptions.from_dict(config.stream).tasks,
                       str(Path(config.data.train).parent))


@functools.lru_cache(maxsize=None)
def _task_files(world: str, tasks: int, world_dir: str) -> list[dict[str, str]]:
    return write_stream_tasks(build_world(WorldOptions.from_dict(json.loads(world))), tasks,
                              Path(world_dir) / f"stream-{tasks}tasks")


def merge_lora(run_dir: Path, merged_dir: Path, device) -> Path:
    """The LoRA run in ``run_dir`` with its adapter merged into its base, saved as a plain model in ``merged_dir``
    (with its tokenizer and :data:`MERGED_MARKER`, moved into place whole); reused when already there."""
    if (merged_dir / MERGED_MARKER).is_file():
        return merged_dir
    partial = merged_dir.with_name(merged_dir.name + ".partial")
    for stale in (merged_dir, partial):
        if stale.exists():
            shutil.rmtree(stale)
    model, tokenizer = load_run(run_dir, device)
    try:
        merged = model.merge_and_unload()
        merged.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
    finally:
        del model
        gc.collect()
    (partial / MERGED_MARKER).write_text(json.dumps({"adapter": str(run_dir / FINAL_DIR)}) + "\n")
    os.replace(partial, merged_dir)
    return merged_dir


def stream_step_stats(stage_dirs: list[Path]) -> dict:
    """:func:`smf.suite.cost.sparse_step_stats` over every stage of a sparse stream run (its steps in order)."""
    return sparse_step_stats([record for directory in stage_dirs for record in log_records(directory / LOG_FILE)])


class StreamRun:
    """One run of a stream suite (``run_one`` of :class:`smf.suite.runner.SuiteRunner` hands it over); ``train_stage``
    is the runner's ``ensure_stage`` (train a stage unless its marker says it finished)."""

    def __init__(self, runner, run: Run, train_stage: Callable[[str, RunConfig], dict]) -> None:
        self.runner, self.run, self.train_stage = runner, run, train_stage
        self.config = seed_config(runner.config, run.seed)
        self.tasks = StreamOptions.from_dict(self.config.stream).tasks
        self.layout = StreamLayout(runner.layout.root, self.tasks)
        self.expected_hash = run_hash(runner.config, run)
        self.files = stream_task_files(self.config)
        self._eval_sets: dict = {}

    def stage_config(self, stage: int) -> tuple[RunConfig, dict]:
        """(trainer options of 1-based ``stage``, markers of the stages it needs first: the retrofit and background
        of a sparse run's first stage)."""
        run, layout = self.run, self.layout
        data = dataclasses.replace(self.config.data, train=self.files[stage - 1]["train"])
        previous = None if stage == 1 else layout.stage_dir(run, stage - 1)
        if run.recipe == "sparse":
            retrofit_dir, background_dir = sparse_stage_dirs(self.runner.layout, run, self.config)
            markers = self.runner.shared_markers(run) if stage == 1 else {}
            return stage_config(dataclasses.replace(self.config, data=data), "sparse", run.seed,
                                layout.stage_dir(run, stage), mode=run.mode, rule=run.rule,
                                adapter=previous or retrofit_dir, background=background_dir,
                                update="authors" if run.update == "authors" else None, lr=run.lr,
                                count_reads=run.reads, variant=run.variant, epochs=run.epochs), markers
        model, adapter = self.config.model, pretrained_adapter(self.config)
        if previous is not None:  # the previous stage's model, its memories (if any) part of it
            model, adapter = str(previous / FINAL_DIR) if run.recipe == "full" else str(
                merge_lora(previous, layout.merged_dir(run, stage - 1), self.runner.device)), None
        return stage_config(dataclasses.replace(self.config, data=data, model=model), run.recipe, run.seed,
                            layout.stage_dir(run, stage), lr=run.lr, epochs=run.epochs, adapter=adapter), {}

    def eval_sets(self, task: int | None) -> dict:
        """The evaluation sets of the old knowledge (``task`` None: every configured role but learn), or of task
        ``task`` (0-based: its eval_learn file as the learn role)."""
        if task not in self._eval_sets:
            settings = self.eval_settings(task)
            data = self.config.data if task is None else dataclasses.replace(
                self.config.data, eval_learn=self.files[task]["eval_learn"])
            self._eval_sets[task] = load_eval_sets(data, settings, self.config.protocol)
        return self._eval_sets[task]

    def eval_settings(self, task: int | None):
        tasks = ("learn",) if task is not None else tuple(t for t in self.config.eval.tasks if t != "learn")
        return dataclasses.replace(self.config.eval, tasks=tasks)

    def evaluate(self, stage: int, run_dir: Path | None) -> tuple[dict, dict, dict]:
        """(metrics of the old knowledge, accuracy per task name, seconds per evaluation) of the model after
        ``stage`` (``run_dir`` None: the base model)."""
        model, tokenizer = load_model(self.config.model, run_dir or pretrained_adapter(self.config), self.runner.device)
        out_dir = self.layout.eval_dir(self.run, stage)
        if run_dir is not None:
            self._counts = parameter_counts(model, self.run.recipe)
        try:
            metrics, seconds = evaluate_model(model, tokenizer, self.eval_sets(None), self.eval_settings(None),
                                              out_dir, self.config.protocol)
            accuracy = {}
            for index in range(self.tasks):
                name = task_name(index)
                task_metrics, task_seconds = evaluate_model(model, tokenizer, self.eval_sets(index),
                                                            self.eval_settings(index), out_dir / f"task{name}",
                                                            self.config.protocol)
                accuracy[name] = task_metrics[METRIC_OF_TASK["learn"]]
                seconds[f"learn_task{name}"] = task_seconds["learn"]
        finally:
            del model
            gc.collect()
            if self.runner.device.type == "cuda":
                torch.cuda.empty_cache()
        return metrics, accuracy, seconds

    def stage_record(self, stage: int) -> dict:
        """The record of ``stage`` (0: the base model, base condition only): read back when written by this run's
        configuration, else trained (or resumed) and evaluated, and written."""
        path = self.layout.record_path(self.run, stage)
        if path.is_file():
            record = read_json_object(path, "stream stage record", ("config_hash", "metrics", "tasks"))
            if record["config_hash"] not in run_hashes(self.runner.config, self.run):
                raise ConfigError(f"{path} was written by a suite with other settings (config hash "
                                  f"{record['config_hash']} != {self.expected_hash}); delete {path.parent} to "
                                  "recompute that stream, or use another output_dir")
            return record
        markers = {}
        run_dir = None
        if stage:
            options, markers = self.stage_config(stage)
            markers["train"] = self.train_stage("train", options)
            run_dir = self.layout.stage_dir(self.run, stage)
        cpu_started = time.process_time()
        metrics, accuracy, seconds = self.evaluate(stage, run_dir)
        cost = None if run_dir is None else training_cost(log_records(run_dir / LOG_FILE), self._counts)
        record = {"stage": stage, "task": task_name(stage - 1) if stage else None, "config_hash": self.expected_hash,
                  "artefact": self.config.model if run_dir is None else str(run_dir / FINAL_DIR),
                  "metrics": metrics, "tasks": accuracy,
                  "train_s": {kind: marker["seconds"] for kind, marker in markers.items()}, "eval_s": seconds,
                  "cost": cost,
                  "train_cpu_s": {kind: marker["cpu_seconds"] for kind, marker in markers.items()
                                  if marker.get("cpu_seconds") is not None},
                  "eval_cpu_s": round(time.process_time() - cpu_started, 3)}
        write_json_atomic(path, record)
        return record

    def results(self) -> dict:
        """Every stage (module docstring), then the run's results file, written last; returns the results."""
        run, started, cpu_started = self.run, time.perf_counter(), time.process_time()
        stages = [self.stage_record(stage) for stage in ([0] if run.recipe is None else range(1, self.tasks + 1))]
        final = stages[-1]
        last = task_name(self.tasks - 1)
        order = [METRIC_OF_TASK[task] for task in self.config.eval.tasks]
        metrics = {key: final["tasks"][last] if key == METRIC_OF_TASK["learn"] else final["metrics"][key]
                   for key in order}
        eval_s = {task: final["eval_s"][f"learn_task{last}" if task == "learn" else task]
                  for task in self.config.eval.tasks}
        trained = {kind: round(sum(s["train_s"].get(kind, 0) for s in stages), 3)
                   for kind in ("retrofit", "background", "train") if any(kind in s["train_s"] for s in stages)}
        trained_cpu = {kind: round(sum(s.get("train_cpu_s", {}).get(kind, 0) for s in stages), 3)
                       for kind in trained if any(kind in s.get("train_cpu_s", {}) for s in stages)}
        results = {
            "condition": run.condition, "seed": run.seed, "update": run.update, "metrics": metrics,
            **({} if run.lr is None else {"lr": run.lr}), **({"reads": run.reads} if run.reads else {}),
            **({"variant": run.variant} if run.variant else {}),
            **({} if run.epochs is None else {"epochs": run.epochs}),
            "sparse_steps": stream_step_stats([self.layout.stage_dir(run, stage) for stage in range(1, self.tasks + 1)])
            if run.recipe == "sparse" else None,
            "timing": {**{f"{kind}_s": seconds for kind, seconds in trained.items()},
                       **{f"{kind}_cpu_s": seconds for kind, seconds in trained_cpu.items()}, "eval_s": eval_s,
                       "stream_eval_s": round(sum(sum(s["eval_s"].values()) for s in stages), 3),
                       "wall_s": round(time.perf_counter() - started, 3),
                       "cpu_s": round(time.process_time() - cpu_started, 3)},
            "cost": _summed_cost([s.get("cost") for s in stages]) if run.recipe is not None else None,
            "eval_rows": {}, "config_hash": self.expected_hash, "artefact": final["artefact"],
            "model": self.config.model, "environment": environment(),
            "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "stream": {"tasks": [task_name(index) for index in range(self.tasks)],
                       "stages": [{key: s[key] for key in ("stage", "task", "metrics", "tasks", "train_s", "eval_s")}
                                  for s in stages]},
        }
        write_json_atomic(self.runner.layout.results_path(run), results)
        return results


def _summed_cost(costs: list[dict | None]) -> dict | None:
    """The cost of a whole stream (smf.suite.cost.training_cost summed over its stages: steps, tokens, flops; the
    parameter counts are every stage's); None when a stage's record has none (written before costs were recorded)."""
    if not costs or any(cost is None for cost in costs):
        return None
    return {**costs[-1], **{key: sum(cost[key] for cost in costs) for key in ("steps", "tokens", "flops")}}
