"""DenseGradSink: where the ablations' backwards put a value table's dense (M, D) gradient, held apart from ``.grad``
until the step's end (:mod:`smf_kernels.sparse.updates`), so that a value gradient made by a forward run before the
step begins is refused at its end as the exact update refuses it, and a step with no backward moves no value row
(the table gets no ``.grad``, which a dense optimizer leaves alone)."""
from __future__ import annotations

import torch

from smf_kernels.ops.weighted_gather import GradientSink, gather_backward


class DenseGradSink(GradientSink):
    """The dense (M, D) value gradient of one table over a step's backwards, held apart from ``.grad`` until the
    step's end; ``mask`` (an (M,) bool tensor read at each backward, or None) zeroes the rows outside it first (the
    authors' per-micro-batch selection). :attr:`grad` stays None while no backward reached the table."""

    def __init__(self, device: torch.device, mask: torch.Tensor | None = None) -> None:
        self.device, self.mask = device, mask
        self.grad: torch.Tensor | None = None
        self.closed = False

    @property
    def reached(self) -> torch.Tensor:
        """0-d bool on the table's device: whether a backward of the step reached the table."""
        return torch.tensor(self.grad is not None, device=self.device)

    def backward(self, grad_out, values, indices, weights, gate, read, backend, deterministic, need_weights):
        if self.closed:
            raise RuntimeError("a backward of a memory forward run in a step that has ended (finish_step or "
                               "abort_step came before this backward): run every backward of a step before its "
                               "end, and drop graphs of aborted steps")
        grad, grad_weights, grad_gate, _ = gather_backward(grad_out, values, indices, weights, None, gate, read,
                                                               backend, deterministic, True, need_weights, False)
        grad = grad.to(values.dtype)
        if self.mask is not None:
            grad = grad * self.mask.unsqueeze(1).to(grad.dtype)
        self.grad = grad if self.grad is None else self.grad.add_(grad)
        return grad_weights, grad_gate

    def close(self) -> None:
        self.closed = True
