"""What a training run leaves in its directory: ``run_config.json`` (the resolved options) and, once
training finishes, ``final/``: a memory adapter for retrofit and sparse runs (see
:func:`smf.model.save_memory_adapter`), a peft adapter for LoRA, a transformers ``save_pretrained``
model for full finetuning (a sparse run with ``--save-patch`` adds ``final/patch/``, the knowledge patch of its
changes against its adapter: :func:`smf.model.save_patch`); the tokenizer is saved beside each (a model with
memories: also in its ``tokenizer/`` subfolder, :func:`smf.model.save_tokenizer`). :func:`smf.model.load_run` loads
it.
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from smf.files import write_json_atomic
from smf.model import save_memory_adapter, save_patch, save_tokenizer


def write_run_config(path: Path, options: dict) -> None:
    """The run's options to ``path`` (its directory's ``run_config.json``)."""
    write_json_atomic(path, options, allow_nan=False)  # options are finite (smf.options)


PATCH_DIR = "patch"  # the knowledge patch of a --save-patch run, in its final/ folder


def save_final(model: nn.Module, tokenizer, recipe: str, directory: Path, patch_base: str | None = None) -> Path:
    """Write the artefact of ``recipe`` (see module docstring) into ``directory``; with ``patch_base`` (the memory
    adapter the run started from) also the knowledge patch against it, into ``directory/patch``."""
    if recipe in ("retrofit", "sparse"):
        save_memory_adapter(model, directory)
        if patch_base is not None:
            save_patch(model, patch_base, directory / PATCH_DIR)
    else:
        model.save_pretrained(directory)  # peft writes only the adapter; full writes the whole model
    save_tokenizer(tokenizer, directory)  # a full model with memories: also in tokenizer/ (no config.json there)
    return directory
