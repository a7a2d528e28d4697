"""Parameters kept out of FSDP2 (``fully_shard(..., ignored_params=...)``): their gradients are nobody's to reduce.

A model whose base is sharded by FSDP2 while its memories stay plain tensors (replicated on every rank, or
column-sharded by :mod:`smf_kernels.sharded`) needs the gradients of its plain trainable parameters averaged
over the data-parallel ranks, as DDP would; :func:`average_gradients` does that in one all_reduce.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def average_gradients(parameters: Iterable[torch.Tensor], group=None) -> None:
    """Replace the ``.grad`` of each of ``parameters`` (those with one) by its mean over the ranks of ``group``
    (None: the default group), in one all_reduce of their concatenation. Every rank must call it with the same
    parameters holding gradients of the same shapes; a no-op without torch.distributed or with one rank."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))
    for grad, part in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(part.view_as(grad))
