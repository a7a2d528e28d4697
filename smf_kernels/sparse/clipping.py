"""Global-norm gradient clipping that understands sparse COO gradients."""
from __future__ import annotations

from collections.abc import Iterable

import torch


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale all gradients in place so that their joint L2 norm is at most ``max_norm``.

    Like ``torch.nn.utils.clip_grad_norm_`` (norm_type 2), but a sparse COO
    gradient counts with the norm of its values after coalescing (duplicate
    entries of an uncoalesced gradient are summed first, as the optimizer sees
    them); sparse gradients are replaced by their coalesced form. No host sync.

    Returns:
        The total norm before clipping, a 0-d float32 tensor (0 if no gradients).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    scaled = []  # the tensors to scale: dense grads, and the values of coalesced sparse grads
    for param in parameters:
        if param.grad is None:
            continue
        if param.grad.is_sparse:
            param.grad = param.grad.coalesce()
            scaled.append(param.grad.values())
        else:
            scaled.append(param.grad)
    total, coef = norm_and_clip_coefficient(scaled, max_norm)
    for g in scaled:
        g.mul_(coef.to(g.dtype))
    return total


def norm_and_clip_coefficient(grads: list[torch.Tensor], max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, coefficient): the joint L2 norm of ``grads`` (a 0-d float32 tensor, 0 without grads) and the
    factor ``min(1, max_norm / (total + 1e-6))`` that clips them to ``max_norm``, as :func:`clip_grad_norm_`
    applies it. No host sync."""
    if not grads:
        return torch.zeros(()), torch.ones(())
    norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
    total = torch.linalg.vector_norm(norms)
    return total, torch.clamp(max_norm / (total + 1e-6), max=1.0)
