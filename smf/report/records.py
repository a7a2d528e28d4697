"""The check ``smf report`` makes of each results file of a suite before reading it: every field the suite's
record writer (:meth:`smf.suite.runner.SuiteRunner.run_one`) puts there, with its type, so that a hand-edited or
damaged file is named in one line (file and field) instead of stopping the report with a traceback.

A record: ``condition``, ``seed``, ``update`` (optional, "exact") and ``variant`` (present only for a run of a suite's
``variants``) those of the run the file is named after;
``metrics`` an object holding the metric key of every evaluated task (:data:`smf.vocabulary.METRIC_OF_TASK`),
each a finite number or null (accuracies in [0, 1], perplexities >= 1), and no key the evaluation does not
write; ``timing`` an object of non-negative seconds (``eval_s`` one per task); ``sparse_steps`` null or the
step statistics; ``config_hash``, ``artefact``, ``model`` and ``finished_at`` strings (the last three optional:
older files lack them). A run of an ``lr_sweep`` holds ``lr``, the rate in its file name, and a number (not null)
for the learning metric the sweep ranks rates by (``learn_acc``, else ``medmcqa_acc``); a run without a swept rate
holds no ``lr``. ``reads`` is absent or the run's (``loss``: a count_reads ablation run). ``epochs`` is absent or
the epochs of the run's schedule_sweep configuration; ``cost`` (absent in older files) null or the training stage's
steps, tokens, parameter counts and estimated flops (:mod:`smf.suite.cost`); ``timing``'s ``*_cpu_s`` fields are
CPU seconds and ``sparse_steps.row_change`` / ``row_change_vs_start`` median relative row changes, each a number >= 0
where present.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

from smf.errors import ConfigError
from smf.vocabulary import METRIC_OF_TASK

STAGE_SECONDS = ("retrofit_s", "background_s", "train_s", "wall_s", "retrofit_cpu_s", "background_cpu_s",
                 "train_cpu_s", "eval_cpu_s", "cpu_s")
COST_FIELDS = ("steps", "tokens", "parameters", "trained", "flops")
SPARSE_STEP_FIELDS = ("steps", "selected_rows", "rows_moved_outside")
OPTIONAL_STRINGS = ("artefact", "model", "finished_at")
LEARNING_METRICS = ("learn_acc", "medmcqa_acc")  # a sweep's ranking metric: own data's, else the paper's


_MISSING = object()  # the value shown for a field that is not there


def _shown(value: object) -> str:
    """``value`` as JSON would spell it, cut to a readable length (one line: repr escapes newlines)."""
    if value is _MISSING:
        return "nothing"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _key(name: str) -> str:
    """A key as part of a field path: plain when it is a simple name, else quoted (one line, readable)."""
    return name if name.replace("_", "").isalnum() and name.isascii() else _shown(name)


def _is_number(value: object) -> bool:
    """A finite int or float (not a bool; not an int too large for a float)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


class _Refused(Exception):
    """One field of a record is wrong: (field, what it must be, its value)."""


def _require(ok: bool, field: str, expected: str, value: object) -> None:
    if not ok:
        raise _Refused(field, expected, value)


def _check_metrics(metrics: object, metric_keys: Iterable[str], known: set[str]) -> None:
    _require(isinstance(metrics, dict), "metrics", "an object of metric key -> number", metrics)
    for key in metric_keys:
        _require(key in metrics, f"metrics.{key}", "present (the suite evaluates its task)", _MISSING)
    for key, value in metrics.items():
        _require(key in known, f"metrics.{_key(key)}",
                 f"a metric key the evaluation writes ({', '.join(sorted(known))})", key)
        if value is None:
            continue
        _require(_is_number(value), f"metrics.{key}", "a finite number or null", value)
        if key.endswith("_acc"):
            _require(0 <= value <= 1, f"metrics.{key}", "an accuracy in [0, 1]", value)
        elif key.endswith("_ppl"):
            _require(value >= 1, f"metrics.{key}", "a perplexity >= 1", value)


def _check_timing(timing: object) -> None:
    _require(isinstance(timing, dict), "timing", "an object of seconds", timing)
    _require("eval_s" in timing, "timing.eval_s", "present (seconds per evaluated task)", _MISSING)
    _require(isinstance(timing["eval_s"], dict), "timing.eval_s", "an object of task -> seconds", timing["eval_s"])
    for task, seconds in timing["eval_s"].items():
        _require(_is_number(seconds) and seconds >= 0, f"timing.eval_s.{_key(task)}", "seconds >= 0", seconds)
    for key in STAGE_SECONDS:
        if key in timing:
            _require(_is_number(timing[key]) and timing[key] >= 0, f"timing.{key}", "seconds >= 0", timing[key])


def _check_counts(record: dict, name: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """Every ``required`` key of ``record`` (the results file's ``name`` object) present, and it and every present
    ``optional`` key a number >= 0."""
    for key in required:
        _require(key in record, f"{name}.{key}", "present", _MISSING)
    for key in (*required, *(key for key in optional if key in record)):
        _require(_is_number(record[key]) and record[key] >= 0, f"{name}.{key}", "a number >= 0", record[key])


def _check_sparse_steps(steps: object) -> None:
    if steps is None:
        return
    _require(isinstance(steps, dict), "sparse_steps", "null or an object of step statistics", steps)
    _check_counts(steps, "sparse_steps", tuple(SPARSE_STEP_FIELDS), ("row_change", "row_change_vs_start"))


def _check_cost(cost: object) -> None:
    if cost is None:
        return
    _require(isinstance(cost, dict), "cost", "null or an object of the training stage's cost", cost)
    _check_counts(cost, "cost", tuple(COST_FIELDS))


def _check_rate(record: dict, run) -> None:
    """``lr``: absent for a run without a swept rate, else the rate in the file's name (exactly: both are the
    config's float)."""
    if run.lr is None:
        _require("lr" not in record, "lr", "absent (the run the file is named after has no swept rate)",
                 record.get("lr"))
        return
    rate = record.get("lr", _MISSING)
    _require(_is_number(rate) and rate == run.lr, "lr", f"{run.lr:g} (the rate the file is named after)", rate)


def _check(record: dict, run, metric_keys: Iterable[str], known: set[str]) -> None:
    hash_ = record.get("config_hash", _MISSING)
    _require(isinstance(hash_, str), "config_hash", "the run's configuration hash (a string)", hash_)
    for field, expected in (("condition", run.condition), ("seed", run.seed)):
        _require(field in record, field, f"present ({expected!r}, the run the file is named after)", _MISSING)
        same = record[field] == expected and type(record[field]) is type(expected)
        _require(same, field, f"{expected!r} (the run the file is named after)", record[field])
    update = record.get("update", "exact")
    _require(update == run.update, "update", f"{run.update!r} (the run the file is named after)", update)
    variant = record.get("variant")
    _require(variant == run.variant, "variant", f"{run.variant!r} (the run the file is named after)"
             if run.variant else "absent (the run the file is named after has no variant)", variant)
    reads = record.get("reads")
    _require(reads == run.reads, "reads", f"{_shown(run.reads)} (the run the file is named after)",
             record.get("reads", _MISSING))
    _check_rate(record, run)
    epochs = record.get("epochs")
    _require(epochs == run.epochs, "epochs", f"{run.epochs} (the epochs the file is named after)" if run.epochs
             else "absent (the run the file is named after has its stage's configured epochs)", epochs)
    _check_metrics(record.get("metrics"), metric_keys, known)
    learning = next((key for key in LEARNING_METRICS if key in metric_keys), None)
    if run.lr is not None and learning is not None:
        _require(record["metrics"][learning] is not None, f"metrics.{learning}",
                 "a finite number (the sweep chooses the rate by it)", None)
    _check_timing(record.get("timing"))
    _check_sparse_steps(record.get("sparse_steps"))
    _check_cost(record.get("cost"))
    for field in OPTIONAL_STRINGS:
        if field in record:
            _require(isinstance(record[field], str), field, "a string", record[field])


def check_results_record(path: str | Path, record: dict, run, tasks: Iterable[str]) -> None:
    """ConfigError in one line naming ``path`` and the first wrong field of ``record``, the results of ``run``
    (a :class:`smf.suite.plan.Run`) whose suite evaluated ``tasks`` (see the module docstring)."""
    metric_keys = [METRIC_OF_TASK[task] for task in tasks if task in METRIC_OF_TASK]
    try:
        _check(record, run, metric_keys, set(METRIC_OF_TASK.values()))
    except _Refused as refused:
        field, expected, value = refused.args
        raise ConfigError(f"{path}: field {field} must be {expected}, got {_shown(value)}") from None
