"""Row-sparse SGD: plain SGD on the rows a step updates, nothing else moves
(docs/method.md#the-row-optimizer-and-alphas-rate).

The update Lin et al. (2025) train memory rows with: for every selected row ``r = rows[t]`` (with ``valid[t]``)::

    g = grad[t] * grad_scale
    p[r] = p[r] - lr * (g + weight_decay * p[r])

computed in the gradient's dtype (float32; float64 for a float64 table) and rounded to the table's once. No
momentum (the update keeps no state), so a row moves in proportion to its own gradient, where AdamW's first step
moves a freshly selected row by about ``lr * sqrt(D)`` whatever its gradient. Rows outside the selection keep
their bits. Weight decay is torch.optim.SGD's (added to the gradient, so a row decays only when selected).
Parameters with dense gradients (e.g. alpha) get exactly torch.optim.SGD's update (``momentum=0``).
Hyper-parameters are read from ``param_groups`` at every step, so LR schedulers work unchanged.
"""
from __future__ import annotations

import math

import torch

from smf_kernels._checks import (FLOAT_DTYPES, check_ascending, check_index_range, check_row_gradient,
                                 check_same_device, check_scalar, check_tensor)


def check_sgd_hyper_parameters(lr: float | torch.Tensor, weight_decay: float | torch.Tensor) -> None:
    """TypeError / ValueError naming the first of ``lr`` and ``weight_decay`` that is not a finite number >= 0
    (a real number or a one-element floating tensor). A tensor on an accelerator is checked there (a device-side
    assertion, no host sync: a violation aborts the next synchronising call)."""
    for name, value in (("lr", lr), ("weight_decay", weight_decay)):
        check_scalar(name, value)
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            torch._assert_async(((value >= 0) & torch.isfinite(value)).all(), f"{name} must be a finite number >= 0")
        elif not 0.0 <= float(value) < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0, got {float(value)}")


def _times(factor: float | torch.Tensor, tensor: torch.Tensor) -> torch.Tensor | float:
    """``factor`` as a multiplier of ``tensor``: a number stays a number (torch's ``alpha=``); a tensor learning
    rate or weight decay is read on ``tensor``'s device as a 0-d tensor of its dtype, never on the host."""
    if isinstance(factor, torch.Tensor):
        return factor.detach().to(device=tensor.device, dtype=tensor.dtype).reshape(())
    return float(factor)


def _add_scaled(base: torch.Tensor, other: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
    """``base + factor * other`` out of place: torch's ``add(alpha=)`` for a number, a tensor product otherwise."""
    factor = _times(factor, base)
    return base.add(other, alpha=factor) if isinstance(factor, float) else base + factor * other


class RowSparseSGD(torch.optim.Optimizer):
    """SGD that updates only the rows a step updates (see module docstring).

    Args:
        params: parameters or param groups, as for torch.optim.SGD. Parameters updated by rows
            (:meth:`step_rows`) must be 2-D (M, D).
        lr, weight_decay: as torch.optim.SGD (finite, >= 0).
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.0) -> None:
        check_sgd_hyper_parameters(lr, weight_decay)
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim.Optimizer.load_state_dict, after refusing (ValueError, nothing loaded) the state of
        another optimizer: SGD keeps no per-parameter state, so saved moments or step counts (RowSparseAdamW's)
        mean the run would silently change optimizer."""
        saved = state_dict.get("state") if isinstance(state_dict, dict) else None
        if not isinstance(saved, dict):
            raise ValueError("state_dict must be a dict with 'state' and 'param_groups', as state_dict() returns")
        held = sorted({key for state in saved.values() if isinstance(state, dict) for key in state})
        if held:
            raise ValueError(f"this state was saved by another optimizer (it holds {', '.join(held)}); RowSparseSGD "
                             "keeps none: resume with the optimizer that wrote it")
        super().load_state_dict(state_dict)

    def check_groups(self) -> None:
        """TypeError / ValueError naming the first param group whose ``lr`` or ``weight_decay`` is not a finite
        number >= 0 (a scheduler or a caller may have changed them since the constructor checked them)."""
        for index, group in enumerate(self.param_groups):
            try:
                check_sgd_hyper_parameters(group["lr"], group["weight_decay"])
            except (TypeError, ValueError) as err:
                raise type(err)(f"RowSparseSGD param group {index}: {err}") from None

    @torch.no_grad()
    def step(self, closure=None):
        """torch.optim.SGD's update (no momentum) of every parameter with a dense ``.grad``; the rows of a
        sparse table go through :meth:`step_rows`. Every group's hyper-parameters are checked before any
        parameter moves."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.check_groups()
        for group in self.param_groups:
            if any(p.grad is not None and p.grad.is_sparse for p in group["params"]):
                raise ValueError("RowSparseSGD takes a table's rows through step_rows(), not a sparse .grad")
        for group in self.param_groups:
            lr, weight_decay = group["lr"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad if _no_decay(weight_decay) else _add_scaled(param.grad, param, weight_decay)
                if isinstance(lr, torch.Tensor):
                    param.copy_(_add_scaled(param, grad, -lr))
                else:
                    param.add_(grad, alpha=-float(lr))
        return loss

    @torch.no_grad()
    def step_rows(self, param: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, *,
                  grad_scale: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> None:
        """SGD on rows ``rows`` of ``param`` (one of this optimizer's parameters); nothing else moves.

        Args:
            param: an (M, D) floating parameter of this optimizer (its ``.grad`` is not read).
            rows: (T,) int64 strictly ascending row ids in [0, M).
            grad: (T, D) float32 (float64 for a float64 table) gradient of those rows.
            grad_scale: optional one-element tensor multiplying ``grad`` first (a clipping coefficient).
            valid: optional (T,) bool; rows with ``valid[t] == False`` keep their bits.
        """
        group = next((g for g in self.param_groups if any(p is param for p in g["params"])), None)
        if group is None:
            raise ValueError("param is not a parameter of this optimizer")
        lr, weight_decay = group["lr"], group["weight_decay"]
        check_sgd_hyper_parameters(lr, weight_decay)
        _check_row_arguments(param, rows, grad, grad_scale, valid)
        if rows.numel() == 0:
            return
        check_index_range("rows", rows, param.shape[0])
        check_ascending("rows", rows)
        dtype = grad.dtype
        g = grad if grad_scale is None else grad * grad_scale.to(device=grad.device, dtype=dtype).reshape(())
        old = param.index_select(0, rows)
        old_wide = old.to(dtype)
        if not _no_decay(weight_decay):
            g = _add_scaled(g, old_wide, weight_decay)
        updated = _add_scaled(old_wide, g, -lr).to(param.dtype)
        if valid is not None:  # rows padding the selection keep their bits
            updated = torch.where(valid.unsqueeze(1), updated, old)
        param.index_copy_(0, rows, updated)


def _no_decay(weight_decay: float | torch.Tensor) -> bool:
    """True for a weight decay given as the number 0 (a tensor's value is not read on the host)."""
    return not isinstance(weight_decay, torch.Tensor) and weight_decay == 0


def _check_row_arguments(param, rows, grad, grad_scale, valid) -> None:
    check_tensor("param", param, ndim=2, dtypes=FLOAT_DTYPES, shape_doc="(M, D)")
    check_row_gradient(param, rows, grad, grad_scale, valid)
    check_same_device("param", param, rows=rows, grad=grad, valid=valid)
