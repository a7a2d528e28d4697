"""Knowledge patches of models with memories (:mod:`smf_kernels.patch`): the value rows (and any other memory tensor
or ``alpha``) a finetune changed, saved against the memory adapter or base model it started from
(docs/hf.md#knowledge-patches)."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from smf.model.adapter import ADAPTER_WEIGHTS
from smf.model.attach import memory_blocks
from smf.model.loading import adapter_dir
from smf_kernels.memory import rename_legacy_projections
from smf_kernels.patch import MemoryPatch


class AdapterTensors(Mapping):
    """The tensors of a memory adapter (:func:`smf.model.save_memory_adapter`) under the state names of ``model``,
    which holds that adapter's memories: each read from the file when asked for (a table at a time)."""

    def __init__(self, model: nn.Module, directory: str | Path) -> None:
        self.path = adapter_dir(directory) / ADAPTER_WEIGHTS
        with safe_open(str(self.path), framework="pt") as handle:
            stored = list(handle.keys())
        paths = {id(module): name for name, module in model.named_modules()}
        self.keys_in_file = {}  # the model's state name -> the key in the adapter file
        for block in memory_blocks(model):
            block_path = paths[id(block)]
            names = {key: key for key in stored if key.startswith(f"layers.{block.layer_index}.")}
            rename_legacy_projections(names, f"layers.{block.layer_index}.memory.")  # an adapter of the old names
            for name, key in names.items():
                self.keys_in_file[f"{block_path}.{name.split('.', 2)[2]}"] = key

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self.path), framework="pt") as handle:
            return handle.get_tensor(self.keys_in_file[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_in_file)

    def __len__(self) -> int:
        return len(self.keys_in_file)


def save_patch(model: nn.Module, base: nn.Module | Mapping[str, torch.Tensor] | str | Path, directory: str | Path,
               rows: Mapping[str, torch.Tensor] | None = None,
               optimizer: torch.optim.Optimizer | None = None) -> MemoryPatch:
    """Write the knowledge patch that turns ``base`` into ``model`` to ``directory`` and return it.

    ``base``: the memory adapter the finetune started from (its folder or its retrofit run directory: every memory
    tensor and ``alpha`` it holds is compared), the model before finetuning, or a mapping of state name -> tensor
    (:meth:`MemoryPatch.between <smf_kernels.patch.MemoryPatch.between>`). ``rows``: memory module path -> (K,)
    int64 ascending rows to save of its values (e.g. those the optimizer touched) instead of the rows that differ;
    ``optimizer``: its state of the saved rows travels too (:meth:`MemoryPatch.load_optimizer_rows
    <smf_kernels.patch.MemoryPatch.load_optimizer_rows>` puts it back to continue training).
    """
    if isinstance(base, (str, Path)):
        base = AdapterTensors(model, base)
    patch = MemoryPatch.between(model, base, rows=rows, optimizer=optimizer)
    patch.save(directory)
    return patch


def load_patch(directory: str | Path) -> MemoryPatch:
    """The knowledge patch saved in ``directory``, checked whole (:meth:`MemoryPatch.load
    <smf_kernels.patch.MemoryPatch.load>`); merge it with ``patch.merge(model)``, undo it with
    ``patch.unmerge(model)``."""
    return MemoryPatch.load(directory)
