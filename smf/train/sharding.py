"""``--shard-memories``: the trainer's memories split by value columns over the torchrun processes
(:mod:`smf_kernels.sharded`, docs/sharding.md).

- :func:`parallelize_memories` replaces the model's memories by sharded copies, over a process group of
  their own (their collectives never interleave with DDP's reducer on one communicator), first of the
  parallelisms (:func:`smf.train.parallel.parallelize`), before the step and the optimizer are built; DDP and
  FSDP then leave the shards alone (their gradients are averaged by the sharded read;
  :func:`smf_kernels.sharded.ddp_ignored_names`), and clipping takes the whole tables' norm;
- checkpoints: every rank writes its shard file of a step into ``checkpoint-shards/step-{step}/`` before
  rank 0 writes ``checkpoint.pt`` naming that folder (so a kill at any moment leaves a checkpoint whose
  shards are complete); older folders are removed once the new checkpoint is in place. A checkpoint
  loads onto any number of processes.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from smf.train.distributed import World, barrier
from smf_kernels.sharded import shard_memories
from smf_kernels.sharded.checkpoint import load_shards, save_shard, sharded_parameters

logger = logging.getLogger(__name__)

SHARDS_DIR = "checkpoint-shards"


def parallelize_memories(model: nn.Module, world: World) -> None:
    """Split every memory of ``model`` by value columns over all ``world`` processes (collective)."""
    group = dist.new_group(list(range(world.size))) if world.size > 1 else None
    names = shard_memories(model, group)
    logger.info("memories %s split by value columns over %d processes", ", ".join(names), world.size)


def _shard_file(directory: Path, rank: int, size: int) -> Path:
    return directory / f"rank-{rank}-of-{size}.pt"


def save_memory_shards(output_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                       world: World) -> dict | None:
    """Every rank writes its shard file of step ``step`` (collective); returns what ``checkpoint.pt`` records
    about them, ``{"dir": relative folder, "world": processes}``, or None when no memory is sharded."""
    if not sharded_parameters(model):
        return None
    relative = f"{SHARDS_DIR}/step-{step}"
    save_shard(_shard_file(output_dir / relative, world.rank, world.size), model, optimizer)
    barrier(world)  # every shard is on disk before rank 0 names the folder in checkpoint.pt
    return {"dir": relative, "world": world.size}


def remove_stale_shards(output_dir: Path, shards: dict) -> None:
    """Delete every shard folder but the one ``checkpoint.pt`` names (rank 0, after writing it)."""
    for folder in (output_dir / SHARDS_DIR).glob("step-*"):
        if folder.name != Path(shards["dir"]).name:
            shutil.rmtree(folder, ignore_errors=True)


def load_memory_shards(output_dir: Path, shards: dict, model: nn.Module, optimizer: torch.optim.Optimizer,
                       optimizer_state: dict) -> None:
    """Load the shard files ``checkpoint.pt`` names into this rank's columns, and ``optimizer_state`` (the
    checkpoint's replicated optimizer state) with this rank's columns of the split state into ``optimizer``.
    ValueError if the files are missing or do not fit."""
    directory, size = output_dir / shards["dir"], int(shards["world"])
    paths = [_shard_file(directory, rank, size) for rank in range(size)]
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise ValueError(f"the checkpoint's shard files are missing: {', '.join(missing)}")
    load_shards(paths, model, optimizer, optimizer_state)
