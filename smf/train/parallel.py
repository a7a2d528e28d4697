"""The parallelisms of a run, applied to its model by one ordered function before its step and optimizer are
built (torchtitan's ``parallelize``): the memories split by value columns (``--shard-memories``,
:mod:`smf.train.sharding`), then the base model under FSDP2 (``--fsdp``, :mod:`smf.train.fsdp`) or DDP
(:func:`smf.train.distributed.parallelize_ddp`), then ``--compile``. The optimizer, built afterwards, holds the
parameters as they are then (FSDP's sharded ones), so nothing rewrites it."""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from smf.train.config import RunConfig
from smf.train.distributed import Parallelism, World, parallelize_ddp
from smf.train.fsdp import parallelize_fsdp
from smf.train.sharding import parallelize_memories
from smf.vocabulary import RECIPE_KINDS
from smf_kernels.memory import memories_of
from smf_kernels.sharded import ddp_ignored_names
from smf_kernels.sparse.memory_step import step_reduced_names


def parallelize(model: nn.Module, config: RunConfig, world: World) -> Parallelism:
    """Apply ``config``'s parallelisms to ``model`` in order (see the module docstring; collective); FSDP and DDP
    leave alone what the sparse step (``--recipe sparse``) or the sharded read reduces itself. Returns how they
    take part in a step, its ``module`` the one the forwards run through."""
    if config.shard_memories:
        parallelize_memories(model, world)
    reduced = step_reduced_names(memories_of(model)) if RECIPE_KINDS[config.recipe].sparse_step else []
    kept_out = list(dict.fromkeys(reduced + ddp_ignored_names(model)))
    if config.fsdp:
        parallel = parallelize_fsdp(model, world, kept_out)
    else:
        parallel = parallelize_ddp(model, world, kept_out)
    module = parallel.module or model
    if config.compile:  # the compiled module syncs DDP's gradients at every micro-batch (no_sync is not reached)
        return Parallelism(torch.compile(module, mode="reduce-overhead"))
    return replace(parallel, module=module)
