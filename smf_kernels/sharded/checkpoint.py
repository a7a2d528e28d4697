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
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from smf_kernels.sharded.layout import shard_of

FORMAT = "smf_kernels.sharded/1"


def sharded_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Name -> Parameter of every sharded value table in ``model`` (whatever the group size)."""
    return {name: param for name, param in model.named_parameters() if shard_of(param) is not None}


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
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable shard file (truncated or corrupt?): {err}") from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or not isinstance(payload.get("tables"), dict):
        raise ValueError(f"{path} is not a shard file of format {FORMAT!r}")
    return payload


def read_shards(paths: Sequence[str | Path]) -> list[dict]:
    """The shard files of one checkpoint, checked to be ranks 0..W-1 of one run whose columns tile every
    table; returned in rank order (tensors memory-mapped)."""
    payloads = [_read(Path(path)) for path in paths]
    if not payloads:
        raise ValueError("no shard files given")
    size = payloads[0]["size"]
    ranks = sorted(p["rank"] for p in payloads)
    if any(p["size"] != size for p in payloads) or ranks != list(range(size)):
        raise ValueError(f"the shard files must be ranks 0..W-1 of one run; got ranks {ranks} of sizes "
                         f"{sorted({p['size'] for p in payloads})}")
    payloads.sort(key=lambda p: p["rank"])
    names = set(payloads[0]["tables"])
    for payload in payloads:
        if set(payload["tables"]) != names:
            raise ValueError(f"rank {payload['rank']}'s shard file holds tables {sorted(payload['tables'])}, "
                             f"rank 0's {sorted(names)}")
    for name in names:
        shape = payloads[0]["tables"][name]["shape"]
        end = 0
        for payload in payloads:
            table = payload["tables"][name]
            start, stop = table["columns"]
            if table["shape"] != shape or start != end or tuple(table["values"].shape) != (shape[0], stop - start):
                raise ValueError(f"table {name!r}: rank {payload['rank']}'s shard does not continue the columns "
                                 f"of a {shape} table at column {end}")
            end = stop
        if end != shape[1]:
            raise ValueError(f"table {name!r}: the shards cover columns [0, {end}) of {shape[1]}")
    return payloads


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

    Everything is read and checked before anything is changed (ValueError naming the problem).
    """
    payloads = read_shards(paths)
    params = sharded_parameters(model)
    if set(params) != set(payloads[0]["tables"]):
        raise ValueError(f"the shard files hold tables {sorted(payloads[0]['tables'])} but the model's sharded "
                         f"tables are {sorted(params)}")
    if (optimizer is None) != (optimizer_state is None):
        raise ValueError("pass both optimizer and optimizer_state, or neither")
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
