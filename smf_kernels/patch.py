"""Knowledge patches: the rows of the memory tables a run changed, saved apart from the tables themselves.

Sparse Memory Finetuning moves a few value rows of large tables; a :class:`MemoryPatch` holds only those: for each
memory's ``values`` table (M, D), the changed rows' indices (K,) (ascending, unique) and the rows (K, D) in the
table's dtype; for any other tensor of the patch's scope that changed (a memory's keys or projections, a trainable
scale such as ``alpha``), the whole tensor. Each entry names its tensor by the model's state name and records two
fingerprints: the base tensor it was made against and the tensor it leaves (:func:`fingerprint`: sha256 over shape,
dtype, the memory's config and the bytes, read in chunks).

On disk (a directory, docs/hf.md#knowledge-patches): ``patch.safetensors`` holds ``{name}:indices`` (int32 where
the table has at most 2**31 rows, else int64) and ``{name}:rows`` per row entry and ``{name}:tensor`` per
whole-tensor entry; ``patch.json`` (compact) holds the format name and version, per entry its name, kind (``rows`` /
``tensor``), whole shape, dtype, row count and both fingerprints, and the sha256 of ``patch.safetensors``. Both files
are written to a temporary name and renamed (the JSON last). Bytes: the changed rows, 4 (or 8) per index, about 300
per entry for the headers. Optionally (``optimizer=``) a row entry also carries the optimizer's state of its rows
(``{name}:row_step`` (K,) int64, ``{name}:exp_avg`` and ``{name}:exp_avg_sq`` (K, D); ``"moments": true``), which
:meth:`MemoryPatch.load_optimizer_rows` puts back so that training continues from the merged patch.

:meth:`MemoryPatch.merge` checks every entry against the model (shape, dtype, base fingerprint) before it writes
anything, keeps the rows it replaces (the same bytes as the patch, on the tables' device) and writes the patch's;
:meth:`MemoryPatch.unmerge` checks that the model still holds what the merge left (result fingerprints), then puts the
kept rows back, bit for bit. Patches stack: merged in order, unmerged in reverse (a patch whose tables another
merged later has changed is refused). :meth:`MemoryPatch.load` checks the files whole (checksum, names, shapes,
dtypes, indices in range and strictly ascending, finite values) before returning.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save
from torch import nn

from smf_kernels.memory import ProductKeyMemory

PATCH_WEIGHTS = "patch.safetensors"
PATCH_CONFIG = "patch.json"
FORMAT, VERSION = "smf-memory-patch", 1
CHUNK_BYTES = 64 << 20  # what one step of hashing or comparing reads of a table
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-size integers: bitwise equality


def fingerprint(tensor: torch.Tensor, memory: dict | None = None) -> str:
    """``"sha256:<hex>"`` of ``tensor``'s shape, dtype, ``memory`` (the config of the memory it belongs to, or None)
    and bytes (C order), read in chunks of :data:`CHUNK_BYTES` (a table on an accelerator is copied to the host
    one chunk at a time). Cost: about one sha256 pass over the bytes (docs/hf.md#knowledge-patches)."""
    digest = _header_digest(tensor, memory)
    for chunk in _row_chunks(tensor.detach()):
        _hash_chunk(digest, chunk)
    return f"sha256:{digest.hexdigest()}"


def _header_digest(tensor: torch.Tensor, memory: dict | None):
    """A sha256 fed with what a fingerprint covers besides the bytes: shape, dtype, the memory's config."""
    header = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", ""), "memory": memory}
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode())


def _hash_chunk(digest, chunk: torch.Tensor) -> None:
    """Feed ``chunk``'s bytes (C order, copied to the host) to ``digest``."""
    digest.update(chunk.contiguous().reshape(-1).view(torch.uint8).cpu().numpy())


def _row_chunks(tensor: torch.Tensor):
    """Consecutive slices of ``tensor`` along its first dimension of about :data:`CHUNK_BYTES` each (a 0-d tensor:
    itself)."""
    if tensor.dim() == 0:
        yield tensor
        return
    row_bytes = max(1, tensor[:1].numel() * tensor.element_size())
    step = max(1, CHUNK_BYTES // row_bytes)
    for start in range(0, tensor.shape[0], step):
        yield tensor[start:start + step]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed as integers of its element size (bitwise comparison: -0.0 != 0.0, NaN == the same NaN)."""
    return tensor.contiguous().view(_BITS[tensor.element_size()])


@dataclass
class PatchEntry:
    """One tensor of a patch. ``indices`` (K,) int64 and ``data`` (K, D): the rows of a values table (M, D) =
    ``shape``; ``indices`` None: ``data`` is the whole tensor. ``base`` / ``result``: :func:`fingerprint` (with the
    config of the memory the tensor belongs to) before / after the patch."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    base: str
    result: str
    data: torch.Tensor
    indices: torch.Tensor | None = None
    moments: dict[str, torch.Tensor] | None = None  # the optimizer's state of the rows (:data:`ROW_MOMENTS`)

    @property
    def kind(self) -> str:
        return "tensor" if self.indices is None else "rows"

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "shape": list(self.shape),
                "dtype": str(self.dtype).replace("torch.", ""), "rows": None if self.indices is None else
                len(self.indices), "moments": self.moments is not None, "base": self.base, "result": self.result}


def memory_scope(model: nn.Module) -> dict[str, dict | None]:
    """The tensors a patch of ``model`` covers when its base is a module: every tensor of the state of each
    :class:`~smf_kernels.ProductKeyMemory` (with the memory's config) and every other parameter that requires grad
    (e.g. a trainable ``alpha``; config None), by state name."""
    scope = {}
    for path, memory in model.named_modules():
        if isinstance(memory, ProductKeyMemory):
            for name in memory.state_dict():
                scope[f"{path}.{name}" if path else name] = memory.config()
    for name, param in model.named_parameters():
        if param.requires_grad:
            scope.setdefault(name, None)
    return scope


def _value_tables(model: nn.Module) -> dict[str, str]:
    """State name of each memory's values table -> the memory's module path."""
    return {f"{path}.values" if path else "values": path for path, module in model.named_modules()
            if isinstance(module, ProductKeyMemory)}


def _memory_configs(model: nn.Module) -> dict[str, dict]:
    """State name of every tensor of a memory -> that memory's config."""
    return {name: config for name, config in memory_scope(model).items() if config is not None}


class MemoryPatch:
    """The entries (:class:`PatchEntry`, by tensor name) that turn a base model's memories into a finetuned one's;
    see the module docstring. Build one with :meth:`between`, read one with :meth:`load`."""

    def __init__(self, entries: list[PatchEntry]) -> None:
        self.entries = {entry.name: entry for entry in entries}
        self._replaced: dict[str, torch.Tensor] | None = None  # what merge() overwrote, for unmerge()

    @classmethod
    def between(cls, model: nn.Module, base: nn.Module | Mapping[str, torch.Tensor],
                rows: Mapping[str, torch.Tensor] | None = None,
                optimizer: torch.optim.Optimizer | None = None) -> "MemoryPatch":
        """The patch that turns ``base`` into ``model``.

        Args:
            model: the finetuned model.
            base: the model before finetuning (a module: the tensors of :func:`memory_scope` of ``model``), or a
                mapping of state name -> base tensor (e.g. read lazily from a file), each compared in the model's
                dtype.
            rows: optional, memory module path -> (K,) int64 ascending rows to save of its values table (e.g. those
                an optimizer touched), instead of the rows that differ bitwise from the base; every other row must
                be unchanged (checked). Memories not named are compared.
            optimizer: optional; the optimizer's state of the saved rows (``row_step``, ``exp_avg``,
                ``exp_avg_sq``: :class:`~smf_kernels.sparse.RowSparseAdamW`'s) travels with them, so that training
                can continue from the merged patch (:meth:`load_optimizer_rows`); every row the optimizer has
                touched is saved (a row whose bits did not move still has state that did). A table the optimizer
                has not stepped gets none; one it steps densely is refused.

        Tensors equal to the base bit for bit get no entry; ValueError for a model without memories, a base
        without one of its values tables, a tensor the model lacks or of another shape, or a ``rows`` entry that is
        not ascending, unique and in range.
        """
        state = model.state_dict(keep_vars=True)
        tables = _value_tables(model)
        if not tables:
            raise ValueError(f"model: a {type(model).__name__} without memories (no ProductKeyMemory): a knowledge "
                             "patch holds the changes of a model's memories")
        configs = _memory_configs(model)
        names = list(memory_scope(model)) if isinstance(base, nn.Module) else list(base)
        base_state = base.state_dict(keep_vars=True) if isinstance(base, nn.Module) else base
        unmatched = [name for name in tables if name not in base_state]
        if unmatched:  # its changes would be left out of the patch without a word
            raise ValueError(f"base: lacks the model's values table(s) {unmatched} (a base with memories at other "
                             "layers?)")
        rows = dict(rows or {})
        unknown = sorted(set(rows) - set(tables.values()))
        if unknown:
            raise ValueError(f"rows: {unknown} are not memories of the model (its memories: {sorted(tables.values())})")
        entries = []
        for name in names:
            if name not in state:
                raise ValueError(f"base: {name!r} is not a tensor of the model")
            tensor = state[name].detach()
            if name not in base_state:
                raise ValueError(f"base: the base model has no tensor {name!r}")
            base_tensor = base_state[name].detach()
            for where, held in (("model", tensor), ("base", base_tensor)):
                if held.is_meta:
                    raise ValueError(f"{where}: {name} is a meta tensor, which holds no values (not loaded yet?)")
            if base_tensor.shape != tensor.shape:
                raise ValueError(f"base: {name} is {tuple(base_tensor.shape)} in the base but {tuple(tensor.shape)} "
                                 "in the model")
            memory = configs.get(name)
            if name in tables:
                touched = (_touched_rows(optimizer, state[name])
                           if optimizer is not None and tables[name] not in rows else None)
                entry = _row_entry(name, tensor, base_tensor, memory, rows.get(tables[name]), touched)
                if entry is not None and optimizer is not None:
                    entry.moments = _row_moments(name, optimizer, state[name], entry.indices)
            elif not torch.equal(_bits(base_tensor.to(tensor.device, tensor.dtype)), _bits(tensor)):
                entry = PatchEntry(name, tuple(tensor.shape), tensor.dtype,
                                   fingerprint(base_tensor.to(tensor.dtype), memory), fingerprint(tensor, memory),
                                   tensor.to("cpu", copy=True))
            else:
                entry = None
            if entry is not None:
                entries.append(entry)
        return cls(entries)

    # -- files -------------------------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Write ``patch.safetensors`` and ``patch.json`` into ``directory`` (created), each atomically; returns it.
        ValueError before anything is written for an entry holding non-finite values (:meth:`load` refuses them),
        NotADirectoryError for a ``directory`` that is a file."""
        directory = Path(directory)
        for entry in self.entries.values():
            if not all(bool(torch.isfinite(t).all()) for t in (entry.data, *(entry.moments or {}).values())):
                raise ValueError(f"patch entry {entry.name} holds non-finite values (a run that diverged?); nothing "
                                 f"was written to {str(directory)!r}")
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(f"directory: {str(directory)!r} is a file, not a folder for a knowledge patch")
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for entry in self.entries.values():
            if entry.indices is None:
                tensors[f"{entry.name}:tensor"] = entry.data.contiguous()
            else:
                tensors[f"{entry.name}:indices"] = entry.indices.to(_index_dtype(entry.shape[0]))
                tensors[f"{entry.name}:rows"] = entry.data.contiguous()
                tensors.update({f"{entry.name}:{key}": value.contiguous()
                                for key, value in (entry.moments or {}).items()})
        blob = save(tensors)
        config = {"format": FORMAT, "version": VERSION, "weights_sha256": hashlib.sha256(blob).hexdigest(),
                  "entries": [entry.to_json() for entry in self.entries.values()]}
        _write_atomic(directory / PATCH_WEIGHTS, blob)
        _write_atomic(directory / PATCH_CONFIG, (json.dumps(config, separators=(",", ":")) + "\n").encode())
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> "MemoryPatch":
        """The patch saved in ``directory``, checked whole first: FileNotFoundError for a missing file, ValueError
        for a truncated, corrupt or edited one (naming the file and what is wrong)."""
        directory = Path(directory)
        config_path, weights_path = directory / PATCH_CONFIG, directory / PATCH_WEIGHTS
        for path in (config_path, weights_path):
            if not path.is_file():
                raise FileNotFoundError(f"no knowledge patch in {str(directory)!r}: {path.name} is missing")
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{config_path} is not a knowledge patch config (not valid JSON: {err})") from None
        if (not isinstance(config, dict) or config.get("format") != FORMAT or config.get("version") != VERSION
                or not isinstance(config.get("entries"), list) or not isinstance(config.get("weights_sha256"), str)):
            raise ValueError(f"{config_path} is not a knowledge patch config: expected a JSON object with format "
                             f"{FORMAT!r}, version {VERSION}, 'weights_sha256' and an 'entries' list")
        blob = weights_path.read_bytes()
        if hashlib.sha256(blob).hexdigest() != config["weights_sha256"]:
            raise ValueError(f"{weights_path} is not the file {PATCH_CONFIG} describes (its sha256 differs: truncated, "
                             "corrupt or replaced)")
        try:
            tensors = load(blob)
        except (SafetensorError, ValueError, RuntimeError) as err:
            raise ValueError(f"{weights_path} is not a readable safetensors file: {err}") from None
        entries = [_read_entry(config_path, index, spec, tensors) for index, spec in enumerate(config["entries"])]
        expected = {key for entry in entries for key in _tensor_keys(entry)}
        if len({entry.name for entry in entries}) != len(entries) or set(tensors) != expected:
            missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
            raise ValueError(f"{weights_path} does not match {PATCH_CONFIG}: entries named twice, or tensors "
                             f"missing {missing} / unexpected {unexpected}")
        return cls(entries)

    # -- applying ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def merge(self, model: nn.Module) -> None:
        """Write the patch into ``model`` after checking every entry against it (nothing is written unless all
        fit): the tensor exists with the entry's shape and dtype, its fingerprint is the entry's base one.
        The replaced rows and tensors are kept for :meth:`unmerge`. ValueError otherwise, naming the tensor and
        both fingerprints."""
        if self._replaced is not None:
            raise ValueError("this patch is merged already; unmerge it first (or load it again to merge it into "
                             "another model)")
        targets = self._targets(model, "base")
        replaced = {}
        for name, entry in self.entries.items():
            target = targets[name]
            if entry.indices is None:
                replaced[name] = target.detach().clone()
                target.copy_(entry.data.to(target.device))
            else:
                indices = entry.indices.to(target.device)
                replaced[name] = target.index_select(0, indices)
                target.index_copy_(0, indices, entry.data.to(target.device))
        self._replaced = replaced

    @torch.no_grad()
    def unmerge(self, model: nn.Module) -> None:
        """Put back what :meth:`merge` replaced, bit for bit, after checking that ``model`` holds exactly what the
        merge left (a patch merged after this one must be unmerged first). ValueError otherwise, nothing changed."""
        if self._replaced is None:
            raise ValueError("this patch is not merged: unmerge needs the rows its merge() replaced, which the "
                             "MemoryPatch that merged it keeps")
        targets = self._targets(model, "result")
        for name, entry in self.entries.items():
            target, kept = targets[name], self._replaced[name]
            if entry.indices is None:
                target.copy_(kept)
            else:
                target.index_copy_(0, entry.indices.to(target.device), kept)
        self._replaced = None

    @torch.no_grad()
    def load_optimizer_rows(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Write the optimizer rows the patch carries (saved with ``between(..., optimizer=)``) into ``optimizer``'s
        state of ``model``'s tables (a table without state gets zero state first, as
        :class:`~smf_kernels.sparse.RowSparseAdamW`'s first update by rows), so that training continues from the
        merged patch as it would have from the finetuned model. Every table is checked first (a parameter of
        ``optimizer``, state by rows or none); ValueError otherwise, nothing changed."""
        state = model.state_dict(keep_vars=True)
        owned = {id(param) for group in optimizer.param_groups for param in group["params"]}
        carried = [entry for entry in self.entries.values() if entry.moments is not None]
        if not carried:
            raise ValueError("this patch carries no optimizer rows (saved without optimizer=)")
        if not hasattr(optimizer, "set_row_state"):
            raise ValueError(f"optimizer: a {type(optimizer).__name__} keeps no state by rows (RowSparseAdamW does)")
        for entry in carried:
            table = state.get(entry.name)
            if table is None or id(table) not in owned or tuple(table.shape) != entry.shape:
                raise ValueError(f"patch entry {entry.name}: the model has no {entry.shape} parameter of that name "
                                 "that the optimizer steps")
            if "step" in (optimizer.state.get(table) or {}):
                raise ValueError(f"patch entry {entry.name}: the optimizer's state of it is not by rows")
        for entry in carried:
            table = state[entry.name]
            optimizer.set_row_state(table, entry.indices.to(device=table.device, dtype=torch.int64),
                                    {key: rows.to(table.device) for key, rows in entry.moments.items()})

    def _targets(self, model: nn.Module, expected: str) -> dict[str, torch.Tensor]:
        """The model's tensor of every entry, each checked (shape, dtype, ``expected`` fingerprint: "base" or
        "result") before any is returned."""
        state = model.state_dict(keep_vars=True)
        configs = _memory_configs(model)
        targets = {}
        for name, entry in self.entries.items():
            target = state.get(name)
            if target is None:
                raise ValueError(f"patch entry {name!r}: the model has no such tensor (a patch for another model?)")
            if target.is_meta:
                raise ValueError(f"patch entry {name}: the model's tensor is a meta tensor, which holds no values (not "
                                 "loaded yet?); nothing was changed")
            if tuple(target.shape) != entry.shape or target.dtype != entry.dtype:
                raise ValueError(f"patch entry {name}: the patch is for a {entry.shape} {entry.dtype} tensor, the "
                                 f"model's is {tuple(target.shape)} {target.dtype}")
            found, wanted = fingerprint(target, configs.get(name)), getattr(entry, expected)
            if found != wanted:
                what = ("the patch was made for another base" if expected == "base" else
                        "the model no longer holds what this patch's merge left (unmerge later patches first)")
                raise ValueError(f"patch entry {name}: {what}: the patch expects fingerprint {wanted}, the model's "
                                 f"tensor has {found}; nothing was changed")
            targets[name] = target.detach() if isinstance(target, nn.Parameter) else target
        return targets


def _row_entry(name: str, table: torch.Tensor, base: torch.Tensor, memory: dict | None,
               rows: torch.Tensor | None, touched: torch.Tensor | None = None) -> PatchEntry | None:
    """The row entry of values table ``name`` (M, D) against ``base`` (M, D): the rows that differ bitwise (and
    the optimizer's ``touched`` rows, whose state moved even where a row's bits did not), or ``rows`` (checked:
    every other row unchanged); None when no row changed and none was given."""
    if rows is not None:
        _check_indices(f"rows[{name!r}]", rows, table.shape[0])
        rows = rows.to(table.device)
    base_digest = _header_digest(table, memory)
    result_digest = base_digest.copy()
    changed, start = [], 0
    for base_chunk, chunk in zip(_row_chunks(base.detach()), _row_chunks(table.detach())):
        base_chunk = base_chunk.to(table.device, table.dtype)
        differs = (_bits(base_chunk) != _bits(chunk)).any(dim=1).nonzero().squeeze(1) + start
        changed.append(differs)
        _hash_chunk(base_digest, base_chunk)
        _hash_chunk(result_digest, chunk)
        start += chunk.shape[0]
    changed = torch.cat(changed)
    if rows is not None:
        missed = changed[~torch.isin(changed, rows)]
        if missed.numel():
            raise ValueError(f"rows[{name!r}] misses rows that changed, e.g. {missed[:5].tolist()} "
                             f"({missed.numel()} in all)")
        changed = rows
    elif touched is not None:
        changed = torch.unique(torch.cat([changed, touched.to(changed.device)]))
    if changed.numel() == 0:
        return None
    return PatchEntry(name, tuple(table.shape), table.dtype, f"sha256:{base_digest.hexdigest()}",
                      f"sha256:{result_digest.hexdigest()}", table.detach().index_select(0, changed).cpu(),
                      changed.cpu().to(torch.int64))


def _check_indices(where: str, indices: torch.Tensor, num_rows: int) -> None:
    """ValueError unless ``indices`` is (K,) int64, strictly ascending, within [0, num_rows)."""
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.dtype != torch.int64:
        shape = tuple(indices.shape) if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise ValueError(f"{where} must be a (K,) int64 tensor of row indices, got {shape} "
                         f"{getattr(indices, 'dtype', '')}".rstrip())
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= num_rows):
        raise ValueError(f"{where} holds indices outside [0, {num_rows}): min {int(indices.min())}, "
                         f"max {int(indices.max())}")
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise ValueError(f"{where} must be strictly ascending (no repeated rows)")


_DTYPES = {name: getattr(torch, name) for name in ("float64", "float32", "bfloat16", "float16")}
_FIELDS = {"name": str, "kind": str, "shape": list, "dtype": str, "base": str, "result": str}


def _read_entry(path: Path, index: int, spec, tensors: dict[str, torch.Tensor]) -> PatchEntry:
    """Entry ``index`` of ``path``'s ``entries`` with its tensors, checked (ValueError naming what is wrong)."""
    where = f"{path}: entries[{index}]"
    if not isinstance(spec, dict) or any(not isinstance(spec.get(k), t) for k, t in _FIELDS.items()):
        fields = ", ".join(f"{key} ({kind.__name__})" for key, kind in _FIELDS.items())
        raise ValueError(f"{where} must be an object with {fields}")
    name, shape = spec["name"], spec["shape"]
    where = f"{path}: entry {name!r}"
    if spec["kind"] not in ("rows", "tensor") or spec["dtype"] not in _DTYPES:
        raise ValueError(f"{where}: kind must be 'rows' or 'tensor' and dtype one of {sorted(_DTYPES)}")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape) or (
            spec["kind"] == "rows" and len(shape) != 2):
        raise ValueError(f"{where}: shape must be positive ints (two for a row entry), got {shape}")
    dtype, shape = _DTYPES[spec["dtype"]], tuple(shape)
    entry = PatchEntry(name, shape, dtype, spec["base"], spec["result"], None)
    if spec["kind"] == "rows":
        count = spec.get("rows")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{where}: rows must be a positive int, got {count!r}")
        indices, data = tensors.get(f"{name}:indices"), tensors.get(f"{name}:rows")
        if indices is None or data is None:
            raise ValueError(f"{where}: {PATCH_WEIGHTS} lacks {name}:indices or {name}:rows")
        if indices.dtype != _index_dtype(shape[0]):
            raise ValueError(f"{where}: indices must be {_index_dtype(shape[0])} for {shape[0]} rows, got "
                             f"{indices.dtype}")
        entry.indices = indices.to(torch.int64)
        _check_indices(f"{where}: indices", entry.indices, shape[0])
        expected = (count, shape[1])
    else:
        data = tensors.get(f"{name}:tensor")
        if data is None:
            raise ValueError(f"{where}: {PATCH_WEIGHTS} lacks {name}:tensor")
        expected = shape
    if tuple(data.shape) != expected or data.dtype != dtype or (entry.indices is not None
                                                                 and len(entry.indices) != expected[0]):
        raise ValueError(f"{where}: its data must be {expected} {dtype}, got {tuple(data.shape)} {data.dtype} "
                         f"({'' if entry.indices is None else f'{len(entry.indices)} indices'})")
    if not bool(torch.isfinite(data).all()):
        raise ValueError(f"{where} holds non-finite values (saved by a run that diverged?)")
    entry.data = data
    if spec.get("moments") is True and entry.indices is not None:
        entry.moments = _read_moments(where, name, tensors, data)
    elif spec.get("moments") not in (None, False):
        raise ValueError(f"{where}: moments must be true (a row entry) or false, got {spec['moments']!r}")
    return entry


def _index_dtype(num_rows: int) -> torch.dtype:
    """How a table of ``num_rows`` rows stores its row indices on disk: int32 when they fit (half the bytes), else
    int64."""
    return torch.int32 if num_rows <= 2 ** 31 else torch.int64


def _tensor_keys(entry: PatchEntry) -> tuple[str, ...]:
    if entry.indices is None:
        return (f"{entry.name}:tensor",)
    return (f"{entry.name}:indices", f"{entry.name}:rows", *(f"{entry.name}:{key}" for key in entry.moments or ()))


ROW_MOMENTS = ("row_step", "exp_avg", "exp_avg_sq")  # a table's optimizer state by rows (RowSparseAdamW's)


def _touched_rows(optimizer: torch.optim.Optimizer, table: torch.Tensor) -> torch.Tensor | None:
    """The rows of ``table`` with the optimizer's state by rows (:meth:`RowSparseAdamW.touched_rows
    <smf_kernels.sparse.RowSparseAdamW.touched_rows>`), or None (no such state)."""
    state = optimizer.state.get(table) or {}
    if not state or "step" in state or not hasattr(optimizer, "touched_rows"):
        return None
    return optimizer.touched_rows(table)


def _row_moments(name: str, optimizer: torch.optim.Optimizer, table: torch.Tensor,
                 indices: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The optimizer's state of rows ``indices`` of ``table`` (:meth:`RowSparseAdamW.row_state
    <smf_kernels.sparse.RowSparseAdamW.row_state>`, either of its forms; None: no state yet); ValueError for an
    optimizer or a state that is not by rows."""
    if not hasattr(optimizer, "row_state"):
        raise ValueError(f"optimizer: a {type(optimizer).__name__} keeps no state by rows (RowSparseAdamW does)")
    state = optimizer.state.get(table) or {}
    if not state:
        return None
    if "step" in state:
        raise ValueError(f"optimizer: its state of {name} is not by rows (a dense update's)")
    rows = optimizer.row_state(table, indices.to(device=table.device, dtype=torch.int64))
    return {key: rows[key].cpu() for key in ROW_MOMENTS}


def _read_moments(where: str, name: str, tensors: dict[str, torch.Tensor], rows: torch.Tensor) -> dict:
    """The optimizer rows of entry ``name`` (rows ``rows`` (K, D)), checked."""
    moments = {key: tensors.get(f"{name}:{key}") for key in ROW_MOMENTS}
    for key, value in moments.items():
        shape, dtype = ((rows.shape[0],), torch.int64) if key == "row_step" else (tuple(rows.shape), rows.dtype)
        if value is None or tuple(value.shape) != shape or value.dtype != dtype:
            raise ValueError(f"{where}: {name}:{key} must be {shape} {dtype}, got "
                             f"{'nothing' if value is None else (tuple(value.shape), value.dtype)}")
        if key != "row_step" and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{where}: {name}:{key} holds non-finite values")
        if key != "exp_avg" and bool((value < 0).any()):
            raise ValueError(f"{where}: {name}:{key} holds negative values")
    return moments


def _write_atomic(path: Path, data: bytes) -> None:
    """``data`` to ``path`` through a synced temporary file renamed over it (a crash leaves the old file or the
    new one, never a mix)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
