"""Triton kernel: AdamW on some rows of a table in place (smf_kernels/ops/row_adamw.py has the formulas).

One program per selected row: it reads the row's gradient, parameter and both moments once and
writes them once, looping BLOCK_D-column tiles; the row's step count and bias corrections are
computed once per program (the corrections in float64, rounded to float32, as RowSparseAdamW's).
Values are rounded to the table's dtype where torch's optimizer stores them (moments, the decayed
parameter), so a bf16 table follows the torch path within bf16 rounding. The row id is guarded
(:func:`guards.in_range`): an out-of-range id touches nothing and raises the launch's flag. With
``state_slots`` (HAS_SLOTS) the moments and the step count of row ``rows[t]`` are row ``state_slots[t]``
of the (S, D) / (S,) state (the compact form), guarded the same way; without, row ``rows[t]``.
"""
from __future__ import annotations

import math

import triton
import triton.language as tl

from smf_kernels.triton_kernels.guards import in_range, new_error_flag, raise_if_flagged
from smf_kernels.triton_kernels.launch import LaunchPlan, next_pow2


@triton.jit
def row_adamw_kernel(
    p_ptr, m_ptr, v_ptr, step_ptr, rows_ptr, slots_ptr, g_ptr, valid_ptr, lr_ptr, scale_ptr, err_ptr,
    M, S, D, stride_p, stride_g, one_minus_beta1, beta2, one_minus_beta2, log2_beta1, log2_beta2, eps, weight_decay,
    HAS_VALID: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    one = tl.arange(0, 1)
    row = tl.load(rows_ptr + t + one)  # (1,): the guard and the masks take blocks
    live = in_range(err_ptr, row, M, one == 0)
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + t + one)
        live = live & in_range(err_ptr, slot, S, one == 0)
    else:
        slot = row
    if HAS_VALID:
        live = live & (tl.load(valid_ptr + t + one) != 0)
    if tl.max(live.to(tl.int32), axis=0) != 0:
        r = tl.max(row, axis=0)
        s = tl.max(slot, axis=0)
        step = tl.load(step_ptr + s) + 1
        tl.store(step_ptr + s, step)
        lr = tl.load(lr_ptr).to(tl.float64)
        steps = step.to(tl.float64)
        step_size = (lr / (1.0 - tl.exp2(steps * log2_beta1))).to(tl.float32)
        correction2 = tl.sqrt(1.0 - tl.exp2(steps * log2_beta2)).to(tl.float32)
        decay = (1.0 - lr * weight_decay).to(tl.float32)
        scale = tl.load(scale_ptr).to(tl.float32) if HAS_SCALE else 1.0
        dtype = p_ptr.dtype.element_ty
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = cols < D
            offsets = r * stride_p + cols
            state_offsets = s * D + cols  # the state is contiguous
            g = (tl.load(g_ptr + t * stride_g + cols, mask=mask, other=0.0) * scale).to(dtype).to(tl.float32)
            m = tl.load(m_ptr + state_offsets, mask=mask, other=0.0).to(tl.float32)
            m = (m + one_minus_beta1 * (g - m)).to(dtype)
            v = tl.load(v_ptr + state_offsets, mask=mask, other=0.0).to(tl.float32)
            v = ((v * beta2).to(dtype).to(tl.float32) + one_minus_beta2 * g * g).to(dtype)
            tl.store(m_ptr + state_offsets, m, mask=mask)
            tl.store(v_ptr + state_offsets, v, mask=mask)
            denom = tl.sqrt(v.to(tl.float32)) / correction2 + eps
            p = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            if weight_decay != 0.0:
                p = (p * decay).to(dtype).to(tl.float32)
            tl.store(p_ptr + offsets, (p - m.to(tl.float32) / denom * step_size).to(dtype), mask=mask)


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else float("-inf")  # beta = 0: no averaging, beta^s = 0


def plan_row_adamw(param, exp_avg, exp_avg_sq, row_step, rows, grad, valid, lr, grad_scale, beta1, beta2, eps,
                   weight_decay, state_slots=None):
    """(plan, error_flag): one program per row of ``rows``; param and its state must be contiguous (updated in
    place), ``lr`` a 0-d float64 tensor and ``grad_scale`` None or a 0-d float32 tensor on param's device;
    ``state_slots`` None (state by row) or (T,) int64 (state by slot, of ``row_step.shape[0]`` slots).

    Scalars reach a kernel as float32: the bias corrections' powers come from log2(beta) taken here in
    double (beta2 = 0.999 itself in float32 would move 1 - beta2 by 1e-5 relative)."""
    num_rows, dim = param.shape
    flag = new_error_flag(param.device)
    grad = grad.contiguous()
    plan = LaunchPlan(
        row_adamw_kernel, (rows.numel(),),
        (param, exp_avg, exp_avg_sq, row_step, rows.contiguous(),
         state_slots.contiguous() if state_slots is not None else rows, grad,
         valid.contiguous() if valid is not None else rows, lr, grad_scale if grad_scale is not None else lr, flag,
         num_rows, row_step.shape[0], dim, param.stride(0), grad.stride(0), 1.0 - beta1, beta2, 1.0 - beta2, _log2(beta1),
         _log2(beta2), eps, weight_decay),
        dict(HAS_VALID=valid is not None, HAS_SCALE=grad_scale is not None, HAS_SLOTS=state_slots is not None,
             BLOCK_D=min(1024, next_pow2(dim)),
             num_warps=4),
    )
    return plan, flag


def row_adamw(param, exp_avg, exp_avg_sq, row_step, rows, grad, valid, lr, grad_scale, beta1, beta2, eps,
              weight_decay, state_slots=None):
    plan, flag = plan_row_adamw(param, exp_avg, exp_avg_sq, row_step, rows, grad, valid, lr, grad_scale, beta1,
                                beta2, eps, weight_decay, state_slots)
    if rows.numel() > 0:
        plan.launch()
        slots = "" if state_slots is None else f" and state_slots in [0, {row_step.shape[0]})"
        raise_if_flagged(flag, f"rows must lie in [0, {param.shape[0]}){slots}")

