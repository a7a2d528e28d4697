"""torch.distributed helpers for data-parallel training under ``torchrun``, and DDP applied to a model.

``torchrun --nproc-per-node N -m smf.cli train ...`` sets WORLD_SIZE, RANK and LOCAL_RANK;
:func:`setup_distributed` then starts the default process group (NCCL on CUDA, gloo on CPU)
unless the caller already did (tests start gloo themselves).

Parallelisms are applied to the model, in order, by :func:`smf.train.parallel.parallelize` (torchtitan's
``parallelize``), before the step and the optimizer are built, through small functions, each returning the
:class:`Parallelism` the loop runs its steps with: the memories split by columns
(:func:`smf.train.sharding.parallelize_memories`), the base model under FSDP2 (:func:`smf.train.fsdp.parallelize_fsdp`)
or DDP (:func:`parallelize_ddp`).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from smf.errors import ConfigError


@dataclass(frozen=True)
class World:
    """This process's place in the job: rank, number of processes and its device."""

    rank: int
    size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(name: str, local_rank: int = 0, argument: str = "--device") -> torch.device:
    """'auto' -> cuda:{local_rank} when CUDA is available, else cpu; other names as given (``cuda``: this
    process's GPU). ConfigError naming ``argument`` for a name torch does not know or a device this machine
    lacks (no CUDA, a GPU index beyond the count, no MPS)."""
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"{argument} {name!r} is not a torch device; use auto, cpu, cuda, cuda:1, mps, ...") \
            from None
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index >= count:
            raise ConfigError(f"{argument} {name!r}: this machine has {count or 'no'} CUDA device"
                              f"{'' if count == 1 else 's'}{'' if count else ' (torch.cuda.is_available() is False)'}")
    elif device.type not in ("cpu", "meta"):
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "is_available") and not module.is_available():
            raise ConfigError(f"{argument} {name!r}: this machine has no {device.type} device")
    if device.type == "meta":
        raise ConfigError(f"{argument} {name!r}: the meta device holds no data to train or evaluate")
    return device


def setup_distributed(device_name: str) -> World:
    """Join the process group when launched with WORLD_SIZE > 1 (or already joined); else one process."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(device_name, local_rank)
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), device)
    return World(0, 1, device)


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()


def all_reduce_sum(value: torch.Tensor, world: World) -> torch.Tensor:
    """Sum of ``value`` over ranks (in place; returns it)."""
    if world.size > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def gather_objects(obj, world: World) -> list:
    """``obj`` from every rank, in rank order (on every rank)."""
    if world.size == 1:
        return [obj]
    gathered = [None] * world.size
    dist.all_gather_object(gathered, obj)
    return gathered


def _no_context(last: bool) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Parallelism:
    """How the parallelisms applied to a model take part in the loop's steps (the default: none, one process).

    ``module``: what the forwards run through (DDP's wrapper, a compiled module), None: the model itself;
    ``micro_batch(last)``: the context of one micro-batch's forward and backward, ``last`` True for the step's
    last, whose backward reduces the gradients; ``reduce_gradients()``: called after the step's last backward,
    before its finish, to average the gradients no wrapper reduced; ``sharded``: trainable parameters are split
    over the processes (a check of their values agrees over all of them).
    """

    module: nn.Module | None = None
    micro_batch: Callable[[bool], contextlib.AbstractContextManager] = _no_context
    reduce_gradients: Callable[[], None] = _nothing
    sharded: bool = False


def parallelize_ddp(model: nn.Module, world: World, kept_out: list[str]) -> Parallelism:
    """DDP over ``model``'s trainable parameters but those named in ``kept_out`` (and buffers so named: reduced by
    the sparse step or by the sharded read itself); no wrapper in one process or when nothing is left for DDP.
    All micro-batches of a step but the last run under ``no_sync``."""
    if world.size == 1:
        return Parallelism()
    if not any(p.requires_grad for name, p in model.named_parameters() if name not in kept_out):
        return Parallelism()  # only memory values train: nothing left for DDP
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, kept_out)
    device_ids = [world.device] if world.device.type == "cuda" else None
    wrapped = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    return Parallelism(wrapped, lambda last: contextlib.nullcontext() if last else wrapped.no_sync())
