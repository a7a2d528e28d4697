"""Checkpoints of sharded value tables: one file per rank, loadable onto any number of ranks.

Each rank writes its columns of every sharded table and of the optimizer state split like it (the
state tensors of the table's shape, e.g. AdamW's ``exp_avg`` and ``exp_avg_sq``) with
:func:`save_shard`. Everything else (replicated parameters, the rest of the optimizer state, such as
RowSparseAdamW's per-row ``row_step``) is the same on every rank and is the caller's to save once, from
:func:`replicated_optimizer_state`. :func:`load_shards` reads the files of a run with any number of ranks
and gives this rank the columns its current shard holds; only the overlapping columns are read
(memory-mapped).

Shard file (``torch.save``, loadable with ``weights_only=True``)::

    {"format": "smf_kernels.sharded/1", "rank": r, "size": W,
     "tables": {param_name: {"shape": [M, D], "columns": [start, stop],
                             "values": (M, stop - start), "state": {key: (M, stop - start)}}}}
"""
from __future__ import annotations

import copy
import pickle
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from smf_kernels.sharded.layout import shard_of
from smf_kernels.sharded.placement import placement_of

FORMAT = "smf_kernels.sharded/1"


def sharded_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Name -> Parameter of every sharded value table in ``model`` (whatever the group size)."""
    return {name: param for name, param in model.named_parameters() if placement_of(param).saved_apart}


def _optimizer_indices(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(param) -> its index in ``optimizer.state_dict()``."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    return {id(param): index for index, param in enumerate(params)}


def _split_keys(state: dict, param: torch.Tensor) -> list[str]:
    """The entries of one parameter's optimizer state that are split by columns like it."""
    return [key for key, value in state.items() if isinstance(value, torch.Tensor) and value.shape == param.shape]


def shard_payload(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """This rank's shard file contents (see module docstring); tensors copied to CPU."""
    tables, rank, size = {}, 0, 1
    state = optimizer.state if optimizer is not None else {}
    for name, param in sharded_parameters(model).items():
        shard = shard_of(param)
        rank, size = shard.rank, shard.size
        param_state = state.get(param, {})
        split = {key: param_state[key].detach().cpu().clone() for key in _split_keys(param_state, param)}
        tables[name] = {"shape": [param.shape[0], shard.width], "columns": [shard.start, shard.stop],
                        "values": param.detach().cpu().clone(), "state": split}
    if not tables:
        raise ValueError("model holds no sharded value table (smf_kernels.sharded.shard_memories)")
    return {"format": FORMAT, "rank": rank, "size": size, "tables": tables}


def save_shard(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Path:
    """Write this rank's shard file to ``path`` (written whole to ``path.tmp``, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(shard_payload(model, optimizer), tmp)
    tmp.replace(path)
    return path


def replicated_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` without the column-split state of sharded tables (which :func:`save_shard`
    writes): the part every rank holds alike, to be saved once."""
    state_dict = optimizer.state_dict()
    indices = _optimizer_indices(optimizer)
    state = dict(state_dict["state"])
    for param in sharded_parameters(model).values():
        index = indices.get(id(param))
        if index is None or index not in state:
            continue
        split = set(_split_keys(optimizer.state[param], param))
        state[index] = {key: value for key, value in state[index].items() if key not in split}
    return {**state_dict, "state": state}


def _read(path: Path) -> dict:
    if not path.is_file():  # a directory, a missing path, or a pipe (reading one would wait forever)
        raise ValueError(f"{path} is not a shard file: {'not a regular file' if path.exists() else 'no such file'}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable shard file (truncated or corrupt?): {err}") from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or not isinstance(payload.get("tables"), dict):
        raise ValueError(f"{path} is not a shard file of format {FORMAT!r}")
    _check_payload(path, payload)
    return payload


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_pair(value: object) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_int(v) and v >= 0 for v in value)


def _check_payload(path: Path, payload: dict) -> None:
    """ValueError naming ``path`` (and the table and entry) unless every entry of the shard file has the
    layout of the module docstring: ``rank`` in [0, size), each table's ``shape`` [M, D], ``columns``
    [start, stop] within [0, D], ``values`` and every ``state`` tensor floating of shape (M, stop - start)."""
    size, rank = payload.get("size"), payload.get("rank")
    if not _is_int(size) or size < 1:
        raise ValueError(f"{path}: entry 'size' must be an int >= 1 (the number of ranks), got {size!r}")
    if not _is_int(rank) or not 0 <= rank < size:
        raise ValueError(f"{path}: entry 'rank' must be an int in [0, size={size}), got {rank!r}")
    if not payload["tables"]:
        raise ValueError(f"{path}: entry 'tables' holds no table")
    for name, table in payload["tables"].items():
        where = f"{path}: table {name!r}"
        if not isinstance(name, str):
            raise ValueError(f"{where}: a table's key must be its parameter's name (a str), got {type(name).__name__}")
        if not isinstance(table, dict):
            raise ValueError(f"{where} must be a dict of shape, columns, values and state, got {type(table).__name__}")
        shape, columns = table.get("shape"), table.get("columns")
        if not _int_pair(shape):
            raise ValueError(f"{where}, entry 'shape': must be [M, D] (two ints >= 0), got {shape!r}")
        if not _int_pair(columns) or not columns[0] <= columns[1] <= shape[1]:
            raise ValueError(f"{where}, entry 'columns': must be [start, stop] with 0 <= start <= stop <= "
                             f"D={shape[1]}, got {columns!r}")
        expected = (shape[0], columns[1] - columns[0])
        state = table.get("state")
        if not isinstance(state, dict) or not all(isinstance(key, str) for key in state):
            raise ValueError(f"{where}, entry 'state': must be a dict of name -> tensor, got {type(state).__name__}")
        for entry, tensor in (("values", table.get("values")), *((f"state[{k!r}]", v) for k, v in state.items())):
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                what = f"dtype {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"{where}, entry {entry}: must be a floating tensor of shape (M, stop - start) = "
                                 f"{expected}, got {what}")
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{where}, entry {entry}: must have shape (M, stop - start) = {expected}, got "
                                 f"{tuple(tensor.shape)}")


def _check_alike(path: Path, payload: dict, first_path: Path, first: dict) -> None:
    """ValueError naming ``path``, the table and the entry unless each table of ``payload`` has rank 0's
    (``first``) shape, value dtype, state entries and state dtypes."""
    if set(payload["tables"]) != set(first["tables"]):
        raise ValueError(f"{path} (rank {payload['rank']}) holds tables {sorted(payload['tables'])}, {first_path} "
                         f"(rank 0) {sorted(first['tables'])}")
    for name, table in payload["tables"].items():
        ours, theirs = table, first["tables"][name]
        where = f"{path} (rank {payload['rank']}): table {name!r}"
        if list(ours["shape"]) != list(theirs["shape"]):
            raise ValueError(f"{where}, entry 'shape': {list(ours['shape'])}, but {list(theirs['shape'])} in "
                             f"{first_path} (rank 0)")
        if ours["values"].dtype != theirs["values"].dtype:
            raise ValueError(f"{where}, entry values: {ours['values'].dtype}, but {theirs['values'].dtype} in "
                             f"{first_path} (rank 0)")
        for key in sorted(set(ours["state"]) | set(theirs["state"])):
            if key not in ours["state"] or key not in theirs["state"]:
                holder, lacker = (first_path, path) if key not in ours["state"] else (path, first_path)
                raise ValueError(f"{lacker}: table {name!r}, entry state[{key!r}]: missing, but {holder} holds it")
            if ours["state"][key].dtype != theirs["state"][key].dtype:
                raise ValueError(f"{where}, entry state[{key!r}]: {ours['state'][key].dtype}, but "
                                 f"{theirs['state'][key].dtype} in {first_path} (rank 0)")


def read_shards(paths: Sequence[str | Path]) -> list[dict]:
    """The shard files of one checkpoint, each entry of each checked (ValueError naming the file, table and
    entry), checked to be ranks 0..W-1 of one run whose columns tile every table; returned in rank order
    (tensors memory-mapped)."""
    if isinstance(paths, (str, Path)):
        raise ValueError(f"paths must be a sequence of shard files (every rank's), got the one path {paths!r}")
    listed = list(paths) if isinstance(paths, Iterable) else None
    if listed is None or not all(isinstance(path, (str, Path)) for path in listed):
        raise TypeError(f"paths must be a sequence of shard file paths (str or Path), got {paths!r}")
    read = sorted(((Path(path), _read(Path(path))) for path in listed), key=lambda item: item[1]["rank"])
    if not read:
        raise ValueError("no shard files given")
    size = read[0][1]["size"]
    ranks = [payload["rank"] for _, payload in read]
    if any(payload["size"] != size for _, payload in read) or ranks != list(range(size)):
        found = ", ".join(f"{path}: rank {payload['rank']} of {payload['size']}" for path, payload in read)
        raise ValueError(f"the shard files must be ranks 0..W-1 of one run; got {found}")
    first_path, first = read[0]
    for path, payload in read[1:]:
        _check_alike(path, payload, first_path, first)
    for name in first["tables"]:
        shape = first["tables"][name]["shape"]
        end = 0
        for path, payload in read:
            start, stop = payload["tables"][name]["columns"]
            if start != end:
                raise ValueError(f"{path} (rank {payload['rank']}): table {name!r}, entry 'columns': starts at "
                                 f"{start}, but the ranks before it end at column {end}")
            end = stop
        if end != shape[1]:
            raise ValueError(f"table {name!r}: the shards cover columns [0, {end}) of {shape[1]}")
    return [payload for _, payload in read]


def _columns(payloads: list[dict], name: str, pick, start: int, stop: int) -> torch.Tensor:
    """Columns [start, stop) of table ``name``'s tensor ``pick(table)``, assembled from the shards."""
    pieces = []
    for payload in payloads:
        table = payload["tables"][name]
        first, last = table["columns"]
        low, high = max(first, start), min(last, stop)
        if low < high:
            pieces.append(pick(table)[:, low - first:high - first])
    return torch.cat(pieces, dim=1)


def load_shards(paths: Sequence[str | Path], model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                optimizer_state: dict | None = None) -> None:
    """Load the shard files ``paths`` (all ranks of the run that wrote them, any number) into this rank's
    sharded tables, and ``optimizer_state`` (from :func:`replicated_optimizer_state`) with this rank's columns
    of the split state into ``optimizer``.

    Every entry of every shard file is read and checked before anything is changed (ValueError naming the
    file, the table and the entry).
    """
    payloads = read_shards(paths)
    params = sharded_parameters(model)
    if set(params) != set(payloads[0]["tables"]):
        raise ValueError(f"the shard files hold tables {sorted(payloads[0]['tables'])} but the model's sharded "
                         f"tables are {sorted(params)}")
    if (optimizer is None) != (optimizer_state is None):
        raise ValueError("pass both optimizer and optimizer_state, or neither")
    if optimizer_state is not None and not (isinstance(optimizer_state, dict)
                                            and isinstance(optimizer_state.get("state"), dict)):
        raise ValueError("optimizer_state must be a dict with a 'state' dict (replicated_optimizer_state's)")
    values, state = {}, copy.copy(optimizer_state["state"]) if optimizer_state is not None else {}
    indices = _optimizer_indices(optimizer) if optimizer is not None else {}
    for name, param in params.items():
        shard, table = shard_of(param), payloads[0]["tables"][name]
        if table["shape"] != [param.shape[0], shard.width]:
            raise ValueError(f"table {name!r} is {table['shape']} in the shard files but "
                             f"{[param.shape[0], shard.width]} in the model")
        values[name] = _columns(payloads, name, lambda t: t["values"], shard.start, shard.stop)
        index = indices.get(id(param))
        if index is None or index not in state:
            continue
        keys = payloads[0]["tables"][name]["state"].keys()
        state[index] = {**state[index], **{key: _columns(payloads, name, lambda t, k=key: t["state"][k],
                                                         shard.start, shard.stop) for key in keys}}
    if optimizer is not None:
        optimizer.load_state_dict({**optimizer_state, "state": state})
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(values[name])
