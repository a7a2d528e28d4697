"""Background read statistics of each memory layer (docs/method.md#slot-selection), saved with safetensors.

Per layer: ``N`` background batches seen, the document frequency ``df(i)``
(batches in which slot ``i`` was read at least once) and the token-level read
total ``b(i)``. The file also records each layer's ``ProductKeyMemory.config()``
so statistics cannot silently be used with a different memory.

File layout (safetensors): tensors ``"{layer}.doc_freq"`` and ``"{layer}.reads"``
((M,) int64 each); metadata ``"smf_background"`` = JSON
``{"version": 1, "layers": {layer: {"config": {...}, "num_batches": N}}}``.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from smf_kernels._checks import check_tensor
from smf_kernels.memory import ProductKeyMemory

FORMAT_KEY = "smf_background"
FORMAT_VERSION = 1


class BackgroundStats:
    """Background statistics for a set of named memory layers.

    Args:
        configs: layer name -> ``ProductKeyMemory.config()`` of that layer.

    Attributes (per layer name):
        num_batches: N, int.
        doc_freq: (M,) int64 CPU tensor, df(i).
        reads: (M,) int64 CPU tensor, b(i).
    """

    def __init__(self, configs: Mapping[str, dict]) -> None:
        if not configs:
            raise ValueError("configs must name at least one memory layer")
        self.configs = {name: dict(config) for name, config in configs.items()}
        self.num_batches = {name: 0 for name in self.configs}
        self.doc_freq = {name: self._zeros(config) for name, config in self.configs.items()}
        self.reads = {name: self._zeros(config) for name, config in self.configs.items()}

    @staticmethod
    def _zeros(config: dict) -> torch.Tensor:
        return torch.zeros(config["n_keys"] ** 2, dtype=torch.int64)

    @classmethod
    def for_memories(cls, memories: Mapping[str, ProductKeyMemory]) -> "BackgroundStats":
        """Empty statistics for the named memories (e.g. ``SparseMemoryController.memories``)."""
        return cls({name: memory.config() for name, memory in memories.items()})

    def add_batch(self, name: str, counts: torch.Tensor) -> None:
        """Add one background batch's read counts ((M,) int64, any device) of layer ``name``."""
        if name not in self.configs:
            raise KeyError(f"unknown memory layer {name!r}; known layers: {sorted(self.configs)}")
        check_tensor("counts", counts, ndim=1, dtypes=(torch.int64,), shape_doc="(M,)")
        if counts.shape != self.reads[name].shape:
            raise ValueError(
                f"counts of layer {name!r} must have shape (M,) = {tuple(self.reads[name].shape)}, "
                f"got {tuple(counts.shape)}"
            )
        counts = counts.cpu()
        if bool((counts < 0).any()):
            raise ValueError(f"counts of layer {name!r} must be >= 0 (read counts), got a minimum of {int(counts.min())}")
        self.num_batches[name] += 1
        self.doc_freq[name] += (counts > 0).to(torch.int64)
        self.reads[name] += counts

    def check_matches(self, memories: Mapping[str, ProductKeyMemory]) -> None:
        """Raise ValueError unless ``memories`` has exactly these layer names and configs, and each layer's
        counts are ones counting can produce (see :meth:`load`)."""
        names, expected = set(memories), set(self.configs)
        if names != expected:
            raise ValueError(
                f"background statistics are for memory layers {sorted(expected)} but the model has "
                f"{sorted(names)}"
            )
        for name, memory in memories.items():
            if memory.config() != self.configs[name]:
                raise ValueError(
                    f"background statistics of layer {name!r} were built for config {self.configs[name]}, "
                    f"but the layer has config {memory.config()}"
                )
            check_counts(f"background statistics of layer {name!r}", self.doc_freq[name], self.reads[name],
                          self.num_batches[name])

    def save(self, path: str | Path) -> None:
        """Write the statistics to a safetensors file at ``path`` (overwritten if it exists).

        Tensors ``{layer}.doc_freq`` and ``{layer}.reads``, (n_keys**2,) int64 each; the
        safetensors metadata holds the format version and, per layer, the memory config and the
        number of batches counted. Read back with :meth:`load`.
        """
        tensors = {}
        for name in self.configs:
            tensors[f"{name}.doc_freq"] = self.doc_freq[name].contiguous()
            tensors[f"{name}.reads"] = self.reads[name].contiguous()
        layers = {name: {"config": self.configs[name], "num_batches": self.num_batches[name]}
                  for name in self.configs}
        metadata = {FORMAT_KEY: json.dumps({"version": FORMAT_VERSION, "layers": layers})}
        save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path, memories: Mapping[str, ProductKeyMemory] | None = None) -> "BackgroundStats":
        """Load statistics saved by :meth:`save`; with ``memories``, also :meth:`check_matches` them.

        Only safetensors and JSON are parsed (no pickle). A missing file raises FileNotFoundError;
        a truncated, corrupt or inconsistent one ValueError naming the problem: every tensor is checked
        against the size its header claims before anything of that size is allocated, and its values
        against what counting can produce (``0 <= doc_freq <= num_batches``, ``reads >= doc_freq``, no reads
        where ``doc_freq`` is 0), which the scores rely on (a negative count makes every score NaN).
        """
        if not Path(path).is_file():
            raise FileNotFoundError(f"no background statistics file at {str(path)!r}")
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
            tensors = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {err}") from err
        if FORMAT_KEY not in metadata:
            raise ValueError(f"{path} is not a background statistics file (no {FORMAT_KEY!r} metadata)")
        try:
            header = json.loads(metadata[FORMAT_KEY])
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: its {FORMAT_KEY!r} metadata is not valid JSON: {err}") from err
        if not isinstance(header, dict) or header.get("version") != FORMAT_VERSION:
            version = header.get("version") if isinstance(header, dict) else None
            raise ValueError(f"{path} has background statistics version {version}, expected {FORMAT_VERSION}")
        layers = header.get("layers")
        if (not isinstance(layers, dict) or not layers
                or not all(_is_layer_header(layer) for layer in layers.values())):
            raise ValueError(f"{path}: 'layers' must map each layer name to {{'config': {{'n_keys': int >= 1, ...}}, "
                             "'num_batches': int >= 0}")
        for name, layer in layers.items():
            num_slots = layer["config"]["n_keys"] ** 2
            for field in ("doc_freq", "reads"):
                tensor = tensors.get(f"{name}.{field}")
                if tensor is None:
                    raise ValueError(f"{path} lacks the tensor {name}.{field}")
                if tensor.dtype != torch.int64 or tuple(tensor.shape) != (num_slots,):
                    raise ValueError(f"{path}: {name}.{field} must be (M,) = ({num_slots},) int64 (n_keys "
                                     f"{layer['config']['n_keys']} in its header), got {tuple(tensor.shape)} "
                                     f"{tensor.dtype}")
            check_counts(f"{path}: layer {name!r}", tensors[f"{name}.doc_freq"], tensors[f"{name}.reads"],
                          layer["num_batches"])
        stats = cls({name: layer["config"] for name, layer in layers.items()})  # sizes checked: the file's own
        for name, layer in layers.items():
            stats.num_batches[name] = int(layer["num_batches"])
            stats.doc_freq[name], stats.reads[name] = tensors[f"{name}.doc_freq"], tensors[f"{name}.reads"]
        if memories is not None:
            stats.check_matches(memories)
        return stats


def check_counts(where: str, doc_freq: torch.Tensor, reads: torch.Tensor, num_batches: int) -> None:
    """ValueError unless the counts are ones that counting ``num_batches`` batches can produce."""
    if bool((doc_freq < 0).any()) or bool((reads < 0).any()):
        raise ValueError(f"{where}: {'doc_freq' if bool((doc_freq < 0).any()) else 'reads'} holds negative counts")
    if bool((doc_freq > num_batches).any()):
        raise ValueError(f"{where}: doc_freq values up to {int(doc_freq.max())} exceed num_batches {num_batches} (a "
                         "slot cannot be read in more batches than were counted)")
    if bool((reads < doc_freq).any()):
        raise ValueError(f"{where}: reads are fewer than doc_freq at some slots (each batch that reads a slot adds "
                         "at least one read)")


def _is_layer_header(layer: object) -> bool:
    def int_at_least(value: object, low: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= low

    return (isinstance(layer, dict) and isinstance(layer.get("config"), dict)
            and int_at_least(layer["config"].get("n_keys"), 1) and int_at_least(layer.get("num_batches"), 0))
