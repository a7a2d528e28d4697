"""Dense-masked selection: the comparison mode that reproduces the original SMF code.

The original code lets the values receive a dense (M, D) gradient, multiplies it
by the selected-row mask (a backward hook) and steps a standard
torch.optim.AdamW. Only selected rows receive gradient, but AdamW still moves
every row with non-zero momentum and applies weight decay to all rows, so rows
that are not selected in a step change anyway (docs/method.md#what-sparse-means,
#pitfalls-of-earlier-implementations). Use this mode only to measure that leak;
the default is :class:`RowSparseAdamW` on sparse gradients.

The mask is applied to the step's accumulated gradient, after the step's rows
are known (a hook during backward cannot know them under gradient
accumulation); for a single micro-batch this equals the hook.
"""
from __future__ import annotations

import torch


def mask_grad_rows_(values: torch.Tensor, rows: torch.Tensor) -> None:
    """Zero, in place, every row of the dense ``values.grad`` (M, D) not in ``rows`` ((T,) int64)."""
    grad = values.grad
    if grad is None or grad.is_sparse:
        raise ValueError("dense-masked selection needs a dense values.grad of shape (M, D); "
                         "call set_update_rows(None) on the memory so its gradient is dense")
    keep = torch.zeros(grad.shape[0], dtype=torch.bool, device=grad.device)
    keep[rows] = True
    grad.mul_(keep.unsqueeze(1).to(grad.dtype))
