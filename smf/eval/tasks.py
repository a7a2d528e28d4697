"""Evaluate one model on the three tasks of docs/method.md#evaluation, as the suite and ``smf eval`` do, or on a
user's own evaluation sets by role (docs/own-data.md).

Metric keys (those of a Table 1 record): ``medmcqa_acc``, ``wikitext_ppl``, ``triviaqa_acc``; for own data
``learn_acc``, ``heldout_ppl``, ``retain_acc``.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path

from torch import nn

from smf.data import load_medmcqa, load_triviaqa, load_wikitext
from smf.data.own_data import as_triviaqa_rows, load_own
from smf.data.paths import OWN_SCHEMAS
from smf.eval.medmcqa import count_rows, evaluate_medmcqa
from smf.eval.multiple_choice import evaluate_multiple_choice
from smf.eval.triviaqa import evaluate_triviaqa
from smf.eval.wikitext import evaluate_wikitext
from smf.data.paths import DataPaths
from smf.eval.settings import EvalSettings
from smf.errors import ConfigError
from smf.model.precision import authors_bf16_weights, cast_like_the_authors
from smf.vocabulary import EVAL_ROLES, METRIC_OF_TASK


def _load_role(data: DataPaths, role: str) -> tuple[list[dict], str]:
    """(rows, schema) of own-data evaluation role ``role``; ConfigError if it has no file."""
    path = getattr(data, f"eval_{role}")
    if path is None:
        raise ConfigError(f"task {role!r} needs the eval_{role} file (--eval-{role}, or data.eval_{role} of the "
                          "suite config)")
    return load_own(path, f"eval_{role}", OWN_SCHEMAS[f"eval_{role}"])


def load_eval_sets(data: DataPaths, settings: EvalSettings, protocol: str) -> dict[str, object]:
    """The rows of each task in ``settings.tasks``: MedMCQA validation, WikiText-103 test (the protocol's
    config), TriviaQA validation (first ``triviaqa_examples``), from ``data``'s local files or the hub; an own-data
    role (learn, heldout, retain): (rows, schema) of its whole file."""
    roles = [task for task in settings.tasks if task in EVAL_ROLES]
    if roles:
        return {role: _load_role(data, role) for role in roles}
    if data.own:
        raise ConfigError(f"tasks {list(settings.tasks)} are the paper's; own data is evaluated by role "
                          f"({', '.join(data.eval_roles) or 'give an eval_learn, eval_heldout or eval_retain file'})")
    loaders = {
        "medmcqa": lambda: load_medmcqa("validation", path=data.medmcqa_validation),
        "wikitext": lambda: load_wikitext("test", path=data.wikitext, protocol=protocol),
        "triviaqa": lambda: load_triviaqa("validation", path=data.triviaqa, n=settings.triviaqa_examples),
    }
    return {task: loaders[task]() for task in settings.tasks}


def evaluate_model(model: nn.Module, tokenizer, eval_sets: dict[str, object], settings: EvalSettings,
                   output_dir: str | Path, protocol: str, rows: dict | None = None
                   ) -> tuple[dict[str, float], dict[str, float]]:
    """Run each task of ``eval_sets`` under ``protocol``; per-example lines go to ``{output_dir}/{task}.jsonl``.

    Under a protocol with bf16 weights (``authors``) on a CUDA device with bf16, ``model`` is first cast to bf16
    in place, memories included (:func:`smf.model.precision.cast_like_the_authors`), as the authors evaluate.

    Returns (metrics by metric key, seconds by task). ``rows``: a dict that receives, by task, how many rows
    were scored and skipped where a task passes some over (MedMCQA's multi-answer questions:
    :func:`smf.eval.medmcqa.count_rows`).
    """
    output_dir = Path(output_dir)
    if authors_bf16_weights(protocol, "auto", next(model.parameters()).device):
        cast_like_the_authors(model)  # the authors evaluate in bf16 (dtype "auto"), memories included
    runners = {
        "medmcqa": lambda rows, path: evaluate_medmcqa(
            model, tokenizer, rows, limit=settings.medmcqa_examples,
            questions_per_batch=settings.medmcqa_questions_per_batch, output_path=path, protocol=protocol),
        "wikitext": lambda rows, path: evaluate_wikitext(
            model, tokenizer, rows, window=settings.wikitext_window, stride=settings.wikitext_stride,
            windows_per_batch=settings.wikitext_windows_per_batch, output_path=path, protocol=protocol),
        "triviaqa": lambda rows, path: evaluate_triviaqa(
            model, tokenizer, rows, limit=settings.triviaqa_examples, batch_size=settings.triviaqa_batch_size,
            max_new_tokens=settings.triviaqa_max_new_tokens, output_path=path, protocol=protocol),
        "heldout": lambda own, path: evaluate_wikitext(
            model, tokenizer, own[0], window=settings.wikitext_window, stride=settings.wikitext_stride,
            windows_per_batch=settings.wikitext_windows_per_batch, output_path=path, protocol=protocol,
            name="heldout"),
    }

    def accuracy(role, own, path):  # learn and retain: a qa file by the TriviaQA rule, an mc file by the MedMCQA rule
        rows, schema = own
        if schema == "mc":
            return evaluate_multiple_choice(model, tokenizer, rows, output_path=path, protocol=protocol,
                                            questions_per_batch=settings.medmcqa_questions_per_batch, name=role)
        return evaluate_triviaqa(model, tokenizer, as_triviaqa_rows(rows), limit=None,
                                 batch_size=settings.triviaqa_batch_size,
                                 max_new_tokens=settings.triviaqa_max_new_tokens, output_path=path, protocol=protocol,
                                 name=role)

    runners.update(learn=functools.partial(accuracy, "learn"), retain=functools.partial(accuracy, "retain"),
                   retain_heldout=functools.partial(accuracy, "retain_heldout"))
    metrics, seconds = {}, {}
    for task, task_rows in eval_sets.items():
        started = time.perf_counter()
        metrics[METRIC_OF_TASK[task]] = runners[task](task_rows, output_dir / f"{task}.jsonl")
        seconds[task] = round(time.perf_counter() - started, 3)
        if rows is not None and task == "medmcqa":
            rows[task] = count_rows(task_rows, settings.medmcqa_examples)
    return metrics, seconds
