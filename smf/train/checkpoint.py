"""Training checkpoints for exact resume, written atomically.

``{output_dir}/checkpoint.pt`` holds, after optimizer step ``step``: the trainable parameters
(by name in the unwrapped model), the optimizer and scheduler states, the RNG states of python,
numpy and torch (CPU and CUDA) of every rank, and the step (which fixes the data position, see
:mod:`smf.train.data`). Frozen parameters are rebuilt from the base model / adapter on resume.
Parameters sharded by FSDP2 (``--fsdp``) are saved whole, as one process saves them
(:func:`smf.train.fsdp.consolidated`), and each rank takes its part back on resume.
Memories split over the processes (``--shard-memories``) keep their value columns and the optimizer
state split like them in one file per rank, which ``checkpoint.pt`` names (:mod:`smf.train.sharding`).
The file is written to a temporary name, synced and renamed over the old one, so a crash while
saving leaves the previous checkpoint intact.

Loading never unpickles arbitrary objects: ``torch.load(weights_only=True)`` accepts only tensors,
containers and plain values (so the numpy RNG state is stored as a tensor), and a file that is not
such a checkpoint (crafted, truncated, random, or written for another model) raises ConfigError
before the model, optimizer or RNGs are touched.
"""
from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import numpy as np
import torch
from torch import nn

from smf.errors import ConfigError
from smf.files import write_atomic, write_text_atomic
from smf.train.fsdp import local_part, local_part_of, shard_optimizer_state
from smf.train.sharding import load_memory_shards
from smf_kernels import ProductKeyMemory
from smf_kernels.memory import rename_legacy_projections
from smf_kernels.sharded.checkpoint import replicated_optimizer_state, sharded_parameters

CHECKPOINT_FILE = "checkpoint.pt"
LOG_FILE = "train_log.jsonl"


def rng_state() -> dict:
    """RNG states of python, numpy, torch CPU and (when available) every CUDA device of this process,
    as tensors and plain values (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    numpy_state = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    return {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_save(obj, path: Path) -> None:
    """``torch.save(obj)`` to ``path``, atomically (:func:`smf.files.write_atomic`)."""
    def save(tmp: Path) -> None:
        with open(tmp, "wb") as handle:
            torch.save(obj, handle)

    write_atomic(path, save)


def save_checkpoint(path: Path, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                    rng_states: list[dict], run_options: dict, shards: dict | None = None) -> None:
    """Write the checkpoint (see module docstring); ``rng_states`` holds one entry per rank. ``shards``: the
    shard files of sharded memories (:func:`smf.train.sharding.save_memory_shards`), which hold their values
    and optimizer state split by columns; the rest is saved here."""
    sharded = sharded_parameters(model)
    trainable = {name: p.detach().cpu().clone() for name, p in model.named_parameters()
                 if p.requires_grad and name not in sharded}
    optimizer_state = replicated_optimizer_state(model, optimizer) if sharded else optimizer.state_dict()
    state = {"step": step, "trainable": trainable, "optimizer": optimizer_state,
             "scheduler": scheduler.state_dict(), "rng": rng_states, "options": run_options}
    if shards is not None:
        state["shards"] = shards
    atomic_save(state, path)


def _read_checkpoint(path: Path) -> dict:
    """The checkpoint's contents, loaded without unpickling arbitrary objects; ConfigError if the file
    is not a checkpoint of :func:`save_checkpoint`'s layout."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, AttributeError, TypeError,
            KeyError, IndexError) as err:
        raise ConfigError(f"{path} is not a loadable training checkpoint (truncated, corrupt, from an older "
                          f"version, or holding objects other than tensors and plain values): {err}") from err
    fields = {"step": int, "trainable": dict, "optimizer": dict, "scheduler": dict, "rng": list, "options": dict}
    if not isinstance(state, dict) or any(not isinstance(state.get(k), t) for k, t in fields.items()):
        raise ConfigError(f"{path} is not a training checkpoint: expected a dict with fields {sorted(fields)}")
    if not all(isinstance(t, torch.Tensor) for t in state["trainable"].values()):
        raise ConfigError(f"{path} is not a training checkpoint: 'trainable' must map names to tensors")
    shards = state.get("shards")
    if shards is not None and not (isinstance(shards, dict) and isinstance(shards.get("dir"), str)
                                   and isinstance(shards.get("world"), int)):
        raise ConfigError(f"{path} is not a training checkpoint: 'shards' must be {{'dir': str, 'world': int}}")
    return state


# Per-element optimizer state (torch's AdamW, RowSparseAdamW): the parameter's shape; second moments never negative.
# RowSparseAdamW's compact row state (``held_rows``: moments by slot) is checked by its load_state_dict.
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _check_optimizer_state(path: Path, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """ConfigError unless ``saved`` (an optimizer state_dict) has ``optimizer``'s groups and parameters and its
    moments fit them: torch's optimizers load moments of any shape and fail (or compute garbage) steps later."""
    groups, states = saved.get("param_groups"), saved.get("state")
    if (not isinstance(groups, list) or not isinstance(states, dict) or len(groups) != len(optimizer.param_groups)
            or any(not isinstance(g, dict) or not isinstance(g.get("params"), list)
                   or len(g["params"]) != len(group["params"]) for g, group in zip(groups, optimizer.param_groups))):
        raise ConfigError(f"{path}: its optimizer state is for other parameter groups than this run's optimizer")
    for group_index, (saved_group, group) in enumerate(zip(groups, optimizer.param_groups)):
        for position, (index, param) in enumerate(zip(saved_group["params"], group["params"])):
            state = states.get(index) or {}
            where = f"{path}: optimizer state of parameter {position} of group {group_index} {tuple(param.shape)}"
            if not isinstance(state, dict):
                raise ConfigError(f"{where} is not a mapping")
            for key in _MOMENTS:
                value = state.get(key)
                if value is None or "held_rows" in state:
                    continue
                if not isinstance(value, torch.Tensor) or value.shape != param.shape:
                    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise ConfigError(f"{where}: {key} is {shape}, not the parameter's shape")
                if key != "exp_avg" and bool((value < 0).any()):
                    raise ConfigError(f"{where}: {key} holds negative values")
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.numel() == 1 and float(step) < 0:
                raise ConfigError(f"{where}: step is negative")


def load_checkpoint(path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, rank: int,
                    world_size: int) -> int:
    """Restore everything saved by :func:`save_checkpoint` (this rank's RNG); returns the step.

    Everything is checked before the model is touched: on ConfigError the model is unchanged (and so is the
    optimizer, when its saved state does not fit it). A checkpoint of sharded memories loads onto any number of
    processes (each takes its columns from the shard files); then rank r continues the RNG streams of the
    writer's rank r modulo its process count.
    """
    state = _read_checkpoint(path)
    for name, module in model.named_modules():  # written before the memory projections were renamed
        if isinstance(module, ProductKeyMemory):
            rename_legacy_projections(state["trainable"], f"{name}." if name else "")
    sharded = sharded_parameters(model)
    saved_world = len(state["rng"])
    if saved_world != world_size and not sharded:
        raise ConfigError(f"{path} was written by {saved_world} processes; resume with the same number, "
                          f"not {world_size}")
    if bool(sharded) != ("shards" in state):
        raise ConfigError(f"{path} was written {'with' if 'shards' in state else 'without'} --shard-memories; "
                          "resume it the same way")
    params = {name: p for name, p in model.named_parameters() if p.requires_grad and name not in sharded}
    if set(params) != set(state["trainable"]):
        raise ConfigError(f"{path} holds other trainable parameters than this run's model; was it written by "
                          "another recipe or configuration?")
    for name, param in params.items():
        saved = state["trainable"][name]
        if saved.shape != param.shape or saved.dtype != param.dtype:
            raise ConfigError(f"{path}: parameter {name} is {tuple(saved.shape)} {saved.dtype} in the checkpoint "
                              f"but {tuple(param.shape)} {param.dtype} in this run's model")
    if not sharded:  # a sharded run's moments live in the shard files, checked as they load
        _check_optimizer_state(path, optimizer, state["optimizer"])
    try:
        if sharded:
            load_memory_shards(path.parent, state["shards"], model, optimizer, state["optimizer"])
        else:
            optimizer.load_state_dict(state["optimizer"])
            shard_optimizer_state(optimizer)  # whole moments of FSDP-sharded parameters -> this rank's part
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"][rank % saved_world])
    except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as err:
        raise ConfigError(f"{path}: its optimizer, scheduler or RNG state does not fit this run: {err}") from err
    with torch.no_grad():
        for name, param in params.items():
            local_part_of(param).copy_(local_part(state["trainable"][name], param))
    return int(state["step"])


def truncate_log(path: Path, step: int) -> None:
    """Drop log rows of steps after ``step`` (written after the checkpoint, before a crash)."""
    if not path.is_file():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in rows if json.loads(line)["step"] <= step]
    write_text_atomic(path, "".join(line + "\n" for line in kept))
