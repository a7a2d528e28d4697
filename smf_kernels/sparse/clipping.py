"""Global-norm gradient clipping over every gradient of a step, a sharded table counting as the whole table."""
from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch
import torch.distributed as dist

from smf_kernels.sharded.placement import NormPart, placement_of


def check_max_norm(max_norm: object) -> float:
    """``max_norm`` as a float: a real number or a one-element tensor (torch's ``clip_grad_norm_`` takes any of
    them through ``float()``), > 0, inf meaning no clipping. TypeError / ValueError otherwise: torch accepts a
    NaN norm (every gradient becomes NaN) and a negative one (the coefficient flips every gradient's sign)."""
    if (isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1 and max_norm.dtype != torch.bool
            and not max_norm.is_complex()):
        max_norm = float(max_norm)
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):
        raise TypeError(f"max_norm must be a number > 0 (inf: no clipping), got {type(max_norm).__name__}")
    value = float(max_norm)
    if math.isnan(value) or value <= 0:
        raise ValueError(f"max_norm must be a number > 0 (inf: no clipping), got {value}")
    return value


def clip_sharded_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale all (dense) gradients in place so that their joint L2 norm is at most ``max_norm``, a column shard of
    a sharded value table (:mod:`smf_kernels.sharded`) counting with the norm of the whole table's gradient: the
    shards' squared norms are summed over its group (one all_reduce per shard; every rank of the group must clip
    together; an FSDP2 shard likewise, over its mesh: each parameter's placement,
    :func:`~smf_kernels.sharded.placement.placement_of`). Otherwise ``torch.nn.utils.clip_grad_norm_``
    (norm_type 2), whose name it leaves alone: that one would take a shard's norm for the table's. No host sync.
    ``max_norm``: :func:`check_max_norm`.

    Returns:
        The total norm before clipping, a 0-d tensor: float32, or float64 (the norm taken in float64)
        when a gradient is float64; 0 if no gradients.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    with_grad = [param for param in parameters if param.grad is not None]
    if any(param.grad.is_sparse for param in with_grad):
        raise ValueError("clip_sharded_grad_norm_ takes dense gradients; a sparse .grad was given")
    placements = [placement_of(param) for param in with_grad]
    total, coef = norm_and_clip_coefficient([place.local(param.grad) for place, param in zip(placements, with_grad)],
                                            max_norm, [place.norm_part for place in placements])
    for param in with_grad:
        param.grad.mul_(coef.to(param.grad.dtype))
    return total


def norm_and_clip_coefficient(grads: list[torch.Tensor], max_norm: float,
                              shards: list[NormPart | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, coefficient): the joint L2 norm of ``grads`` (a 0-d float32 tensor, float64 when a gradient is
    float64; 0 without grads) and the factor ``min(1, max_norm / (total + 1e-6))`` that clips them to
    ``max_norm``, as :func:`clip_sharded_grad_norm_` applies it. ``shards[i]``, when not None (a
    :class:`~smf_kernels.sharded.placement.NormPart`, a parameter's placement's ``norm_part``), says ``grads[i]``
    holds one rank's part of a gradient split over its group (a column shard, smf_kernels.sharded; an FSDP shard):
    its norm is then that of the whole gradient. No host sync.
    ``max_norm``: :func:`check_max_norm`."""
    return clip_coefficient(grads, check_max_norm(max_norm), shards)


def clip_coefficient(grads: list[torch.Tensor], max_norm: float,
                     shards: list[NormPart | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`norm_and_clip_coefficient` of a ``max_norm`` already checked (:func:`check_max_norm`: a float > 0),
    for the finishing sequence, which checks it once per step before anything moves."""
    if not grads:
        return torch.zeros(()), torch.ones(())
    shards = shards if shards is not None else [None] * len(grads)
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    norms = torch.stack([_whole_norm(g, shard, dtype) for g, shard in zip(grads, shards)])
    total = torch.linalg.vector_norm(norms)
    return total, torch.clamp(max_norm / (total + 1e-6), max=1.0)


def _whole_norm(grad: torch.Tensor, shard: NormPart | None, dtype: torch.dtype) -> torch.Tensor:
    """The L2 norm (in ``dtype``) of ``grad``, or, for a ``shard``, of the whole gradient its group's shards make."""
    norm = torch.linalg.vector_norm(grad, dtype=dtype)
    if shard is None:
        return norm
    squared = norm.square()
    dist.all_reduce(squared, group=shard.group)
    return squared.sqrt()
