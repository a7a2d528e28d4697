"""Base models by name (including the built-in 'tiny' one) and each recipe's final artefact.

A run directory holds ``run_config.json`` (the resolved options) and, once training finishes,
``final/``: a memory adapter for retrofit and sparse runs (see :func:`smf.model.save_memory_adapter`),
a peft adapter for LoRA, a transformers ``save_pretrained`` model for full finetuning; the tokenizer
is saved beside each. :func:`load_trained_model` turns a run directory back into a model.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from smf.model import load_base_model, load_memory_adapter, load_tokenizer
from smf.errors import ConfigError
from smf.vocabulary import TINY_MODEL

logger = logging.getLogger(__name__)

RUN_CONFIG = "run_config.json"
FINAL_DIR = "final"


def load_base(name: str, device: torch.device | str = "cpu") -> tuple[nn.Module, object]:
    """(model in fp32, tokenizer) for a hub id, a local directory, or 'tiny' (:mod:`smf.tiny`, seed 0)."""
    if name == TINY_MODEL:
        from smf.tiny import tiny_model, tiny_tokenizer

        model = tiny_model(seed=0)
        model.config._name_or_path = TINY_MODEL  # recorded in adapters, so they name their base
        return model.to(device), tiny_tokenizer()
    try:
        return load_base_model(name, device=device), load_tokenizer(name)
    except OSError as err:
        raise ConfigError(f"--model: cannot load {name!r} (not a local directory and not in the offline hub "
                          "cache); pass a local save_pretrained directory or 'tiny'") from err


def write_run_config(output_dir: Path, options: dict) -> None:
    path = output_dir / RUN_CONFIG
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(options, indent=2) + "\n")
    tmp.replace(path)


def save_final(model: nn.Module, tokenizer, recipe: str, directory: Path) -> Path:
    """Write the artefact of ``recipe`` (see module docstring) into ``directory``."""
    from smf.model import save_memory_adapter

    if recipe in ("retrofit", "sparse"):
        save_memory_adapter(model, directory)
    else:
        model.save_pretrained(directory)  # peft writes only the adapter; full writes the whole model
    tokenizer.save_pretrained(directory)
    return directory


def load_trained_model(run_dir: str | Path, device: torch.device | str = "cpu",
                       backend: str | None = None) -> tuple[nn.Module, object]:
    """(model in eval mode, tokenizer) from the ``final/`` artefact of a finished training run."""
    run_dir = Path(run_dir)
    if not (run_dir / RUN_CONFIG).is_file() or not (run_dir / FINAL_DIR).is_dir():
        raise FileNotFoundError(f"{str(run_dir)!r} is not a finished training run (needs {RUN_CONFIG} and "
                                f"{FINAL_DIR}/)")
    options = json.loads((run_dir / RUN_CONFIG).read_text())
    final = run_dir / FINAL_DIR
    recipe = options["recipe"]
    if recipe == "full":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).to(device)
        return model.eval(), AutoTokenizer.from_pretrained(final)
    model, tokenizer = load_base(options["model"], device)
    if recipe == "lora":
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, final)
    else:
        load_memory_adapter(model, final, backend=backend)
    return model.to(device).eval(), tokenizer
