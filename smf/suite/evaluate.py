"""Evaluate one model on the three probes of SPEC §6, and load whatever a run produced for it.

Metric keys (those of a Table 1 record): ``medmcqa_acc``, ``wikitext_ppl``, ``triviaqa_acc``.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from smf.data import load_medmcqa, load_triviaqa, load_wikitext
from smf.eval import evaluate_medmcqa, evaluate_triviaqa, evaluate_wikitext
from smf.suite.config import DataPaths, EvalSettings
from smf.train.artifacts import FINAL_DIR, RUN_CONFIG, load_base, load_trained_model
from smf.errors import ConfigError

METRIC_OF_TASK = {"medmcqa": "medmcqa_acc", "wikitext": "wikitext_ppl", "triviaqa": "triviaqa_acc"}


def load_eval_sets(data: DataPaths, settings: EvalSettings, protocol: str) -> dict[str, object]:
    """The rows of each task in ``settings.tasks``: MedMCQA validation, WikiText-103 test (the protocol's
    config), TriviaQA validation (first ``triviaqa_examples``), from ``data``'s local files or the hub."""
    loaders = {
        "medmcqa": lambda: load_medmcqa("validation", path=data.medmcqa_validation),
        "wikitext": lambda: load_wikitext("test", path=data.wikitext, protocol=protocol),
        "triviaqa": lambda: load_triviaqa("validation", path=data.triviaqa, n=settings.triviaqa_examples),
    }
    return {task: loaders[task]() for task in settings.tasks}


def evaluate_model(model: nn.Module, tokenizer, eval_sets: dict[str, object], settings: EvalSettings,
                   output_dir: str | Path, protocol: str) -> tuple[dict[str, float], dict[str, float]]:
    """Run each task of ``eval_sets`` under ``protocol``; per-example lines go to ``{output_dir}/{task}.jsonl``.

    Returns (metrics by metric key, seconds by task).
    """
    output_dir = Path(output_dir)
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
    }
    metrics, seconds = {}, {}
    for task, rows in eval_sets.items():
        started = time.perf_counter()
        metrics[METRIC_OF_TASK[task]] = runners[task](rows, output_dir / f"{task}.jsonl")
        seconds[task] = round(time.perf_counter() - started, 3)
    return metrics, seconds


def load_for_eval(model: str, adapter: str | Path | None, device: torch.device,
                  backend: str | None = None) -> tuple[nn.Module, object]:
    """(model in eval mode, tokenizer) for ``smf eval``.

    ``model``: hub id, local directory (a full-finetune ``final/`` folder is one) or 'tiny'.
    ``adapter`` (optional), recognised by its files:

    - a training run directory (``run_config.json`` and ``final/``): its artefact, on the base
      model the run recorded;
    - a memory adapter (``memory_adapter.json``): memories attached to ``model``;
    - a peft LoRA adapter (``adapter_config.json``): LoRA on ``model``;
    - a transformers model directory (``config.json``): a fully finetuned model (``model`` unused).
    """
    if adapter is None:
        loaded, tokenizer = load_base(model, device)
        return loaded.eval(), tokenizer
    adapter = Path(adapter)
    if not adapter.is_dir():
        raise ConfigError(f"--adapter: no such directory {str(adapter)!r}")
    if (adapter / RUN_CONFIG).is_file() and (adapter / FINAL_DIR).is_dir():
        return load_trained_model(adapter, device, backend=backend)
    if (adapter / "memory_adapter.json").is_file():
        from smf.model import load_memory_adapter

        loaded, tokenizer = load_base(model, device)
        load_memory_adapter(loaded, adapter, backend=backend)
        return loaded.to(device).eval(), tokenizer
    if (adapter / "adapter_config.json").is_file():
        from peft import PeftModel

        loaded, tokenizer = load_base(model, device)
        return PeftModel.from_pretrained(loaded, adapter).to(device).eval(), tokenizer
    if (adapter / "config.json").is_file():
        loaded, tokenizer = load_base(str(adapter), device)
        return loaded.eval(), tokenizer
    raise ConfigError(f"--adapter {str(adapter)!r} is none of: a training run directory ({RUN_CONFIG} + "
                      f"{FINAL_DIR}/), a memory adapter (memory_adapter.json), a peft LoRA adapter "
                      "(adapter_config.json), a finetuned model (config.json)")
