"""Row-sparse AdamW applied to some rows of a table in place (docs/method.md#what-sparse-means), as one op.

The update :class:`~smf_kernels.sparse.RowSparseAdamW` makes from a sparse gradient, taken from a compact
``(T, D)`` gradient of the rows ``rows`` instead: no COO tensor, no index_select / index_copy round trips
(the ``ext`` and ``triton`` backends update each row's parameter and moments in one pass). For every
selected row ``r = rows[t]`` (with ``valid[t]``)::

    g = grad[t] * grad_scale
    s[r] += 1
    m[r] = m[r] + (1 - beta1) * (g - m[r])
    v[r] = beta2 * v[r] + (1 - beta2) * g^2
    p[r] = p[r] * (1 - lr * weight_decay) - lr / (1 - beta1^s[r]) * m[r] / (sqrt(v[r]) / sqrt(1 - beta2^s[r]) + eps)

Every other row, its moments and its step count keep their bits.

State by row or by slot: without ``state_slots`` the moments and step counts are indexed by row ((M, D) and
(M,), the dense form); with a (T,) ``state_slots`` row ``rows[t]``'s moments and step count are row
``state_slots[t]`` of (S, D) / (S,) storage (the compact form of :class:`~smf_kernels.sparse.RowSparseAdamW`,
which holds state only for the rows it has updated). The arithmetic is the same, so both forms give the same bits.
"""
from __future__ import annotations

import math

import torch

from smf_kernels._checks import (FLOAT_DTYPES, check_ascending, check_index_range, check_row_gradient,
                                 check_same_device, check_scalar, check_tensor)
from smf_kernels._precision import accumulation_dtype, no_autocast
from smf_kernels.backends import implementation, resolve_backend


def check_hyper_parameters(lr: torch.Tensor | float | None, beta1: float, beta2: float, eps: float,
                            weight_decay: float) -> None:
    """ValueError naming the first hyper-parameter that is not as :class:`~smf_kernels.sparse.RowSparseAdamW`
    takes it: ``lr``, ``eps`` and ``weight_decay`` finite and >= 0, ``betas`` in [0, 1).

    Runs inside the op, before any row moves, so that every backend and a compiled step check the same values
    (and in :func:`row_adamw_` first, on the host, for numbers). ``lr``: a number, None (not checked here), or
    a 0-d tensor: read on the CPU; on an accelerator a device-side assertion (no host sync in the step; a
    violation aborts the next synchronising call, as an out-of-range row does).
    """
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must lie in [0, 1), got ({beta1}, {beta2})")
    for name, value in (("eps", eps), ("weight_decay", weight_decay)):
        if not 0.0 <= value < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
        torch._assert_async((lr >= 0) & torch.isfinite(lr), "lr must be a finite number >= 0")
    elif lr is not None and not 0.0 <= float(lr) < math.inf:
        raise ValueError(f"lr must be a finite number >= 0, got {float(lr)}")


def _factor(value: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """A 0-d float64 tensor on ``device`` (a learning rate may be a tensor, so a scheduler's change
    is data, not a new compiled graph)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64).reshape(())
    return torch.tensor(float(value), dtype=torch.float64, device=device)


@torch.library.custom_op("smf_kernels::row_adamw_", mutates_args=("param", "exp_avg", "exp_avg_sq", "row_step"))
def _row_adamw(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, row_step: torch.Tensor,
               rows: torch.Tensor, grad: torch.Tensor, valid: torch.Tensor | None, lr: torch.Tensor,
               grad_scale: torch.Tensor | None, beta1: float, beta2: float, eps: float, weight_decay: float,
               backend: str, state_slots: torch.Tensor | None = None) -> None:
    check_hyper_parameters(lr, beta1, beta2, eps, weight_decay)
    if rows.numel() == 0:
        return
    check_index_range("rows", rows, param.shape[0])  # the values are checked here, compiled or not
    check_ascending("rows", rows)
    if state_slots is not None:  # distinct slots in range: sorted, they must ascend (no host sync off the CPU)
        check_index_range("state_slots", state_slots, row_step.shape[0])
        check_ascending("state_slots (sorted; distinct slots)", torch.sort(state_slots)[0])
    with no_autocast(param.device):  # one pass per row (ext on CPU, triton), or the torch ops
        implementation(backend).row_adamw(param, exp_avg, exp_avg_sq, row_step, rows, grad, valid, lr, grad_scale,
                                          beta1, beta2, eps, weight_decay, state_slots)


@_row_adamw.register_fake
def _(param, exp_avg, exp_avg_sq, row_step, rows, grad, valid, lr, grad_scale, beta1, beta2, eps, weight_decay,
      backend, state_slots=None):
    return None


def row_adamw_(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    row_step: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float | torch.Tensor,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    grad_scale: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    state_slots: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """AdamW on rows ``rows`` of ``param`` and its state, in place (see the module docstring).

    Args:
        param: (M, D) float table.
        exp_avg, exp_avg_sq: (M, D) its first and second moments, param's dtype and device; (S, D) with
            ``state_slots``.
        row_step: (M,) int64 per-row step counts; (S,) per-slot with ``state_slots``.
        rows: (T,) int64 strictly ascending row ids in [0, M).
        grad: (T, D) gradient of those rows, row t for rows[t]; float32 (float64 for a float64 table).
        lr: learning rate >= 0, a float or a 0-d floating tensor (no recompilation when a scheduler changes it).
        betas, eps, weight_decay: as torch.optim.AdamW: betas in [0, 1), eps and weight_decay finite and >= 0.
        grad_scale: optional 0-d tensor multiplying grad first (a clipping coefficient).
        valid: optional (T,) bool; rows with ``valid[t] == False`` are left alone (a fixed-size selection
            padded with rows that were not read).
        state_slots: optional (T,) int64 distinct slots in [0, S): row ``rows[t]``'s moments and step count
            are row ``state_slots[t]`` of ``exp_avg``, ``exp_avg_sq`` and ``row_step`` (every t, also those
            ``valid`` leaves alone: their slot is not touched).
        backend: "torch", "triton", "ext" or None (see :mod:`smf_kernels.backends`).
    """
    check_tensor("param", param, ndim=2, dtypes=FLOAT_DTYPES, shape_doc="(M, D)")
    check_row_gradient(param, rows, grad, grad_scale, valid)
    if state_slots is None:
        state_rows, letter = param.shape[0], "M"
    else:
        check_tensor("state_slots", state_slots, ndim=1, dtypes=(torch.int64,), shape_doc="(T,)")
        if state_slots.shape != rows.shape:
            raise ValueError(f"state_slots must have shape (T,) = {tuple(rows.shape)}, got {tuple(state_slots.shape)}")
        check_tensor("row_step", row_step, ndim=1, dtypes=(torch.int64,), shape_doc="(S,)")
        state_rows, letter = row_step.shape[0], "S"
    for name, state in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        check_tensor(name, state, ndim=2, dtypes=(param.dtype,), shape_doc=f"({letter}, D) of param's dtype")
        if state.shape != (state_rows, param.shape[1]):
            raise ValueError(f"{name} must have shape ({letter}, D) = {(state_rows, param.shape[1])}, got "
                             f"{tuple(state.shape)}")
    check_tensor("row_step", row_step, ndim=1, dtypes=(torch.int64,), shape_doc=f"({letter},)")
    if row_step.shape[0] != state_rows:
        raise ValueError(f"row_step must have shape ({letter},) = ({state_rows},), got {tuple(row_step.shape)}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for name, value in (("lr", lr), ("betas[0]", betas[0]), ("betas[1]", betas[1]), ("eps", eps),
                        ("weight_decay", weight_decay)):
        check_scalar(name, value)
    beta1, beta2, eps, weight_decay = float(betas[0]), float(betas[1]), float(eps), float(weight_decay)
    # numbers on the host now (a clear error on any device); a tensor lr inside the op, where compiled steps run
    check_hyper_parameters(None if isinstance(lr, torch.Tensor) else lr, beta1, beta2, eps, weight_decay)
    check_same_device("param", param, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, row_step=row_step, rows=rows,
                      grad=grad, valid=valid, state_slots=state_slots)
    name = resolve_backend(backend, param.device, param.dtype)
    dtype = accumulation_dtype(param.dtype)
    scale = None if grad_scale is None else grad_scale.detach().to(device=param.device, dtype=dtype).reshape(())
    with torch.no_grad():  # an in-place update of a leaf that requires grad, as an optimizer makes
        _row_adamw(param, exp_avg, exp_avg_sq, row_step, rows, grad.contiguous(), valid, _factor(lr, param.device),
                   scale, beta1, beta2, eps, weight_decay, name, state_slots)
