"""Triton kernels: weighted gather + read histogram, and its backward, without host syncs.

Every kernel tiles the value row in BLOCK_D columns, so any width D works
(896 is not a power of two), and accumulates in fp32. Each launcher is split
into a ``plan_*`` function returning the :class:`LaunchPlan` it launches, which
benchmarks/triton_aot.py compiles for sm_90 / sm_80.

Every access through an id loaded from ``indices`` is masked by :func:`guards.in_range`: an
out-of-range id reads and writes nothing and raises the launch's error flag, which the launcher
turns into a Python error (the host-side checks do not run while torch.compile traces).

* gather_forward_kernel: out[n] = sum_l w[n,l] * V[idx[n,l]]; the first column
  tile of each token block also bumps counts[idx] for valid tokens (relaxed
  integer atomics: exact and order-independent). Up to D = 1024 one tile holds
  the whole row, so a token loads its ids and weights once.
* gather_backward_kernel: one pass over each grad_out row tile gives both
  dW[n,l] = V[idx[n,l]] . dOut[n] (kept in registers across the column tiles)
  and dV[target] += w[n,l] * dOut[n] (relaxed fp32 atomics), where target = idx
  (dense) or slot_of_row[idx] (sparse; -1 = not selected, skipped).
  With NEED_VALUES off it computes dW alone, without atomics: the deterministic
  path's weight gradient.
* segment_rows_kernel: the deterministic dV. Reads sorted by target form one
  segment per output row, found by binary search (no host sync, grid sized by
  the output rows); each is summed in a fixed order and written once; reads of
  unselected rows sort past the end and are never touched.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from smf_kernels.triton_kernels.guards import in_range, new_error_flag, raise_if_flagged
from smf_kernels.triton_kernels.launch import LaunchPlan, cdiv, next_pow2


@triton.jit
def gather_forward_kernel(
    v_ptr, idx_ptr, w_ptr, out_ptr, counts_ptr, valid_ptr, err_ptr,
    N, L, M, D, stride_v, stride_idx, stride_w, stride_out,
    HAS_COUNTS: tl.constexpr, HAS_VALID: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # int64: rows * stride can pass 2**31
    row_mask = rows < N
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols[None, :] < D
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for l in range(0, L):
        idx = tl.load(idx_ptr + rows * stride_idx + l, mask=row_mask, other=0)
        w = tl.load(w_ptr + rows * stride_w + l, mask=row_mask, other=0.0).to(tl.float32)
        read = in_range(err_ptr, idx, M, row_mask)  # an out-of-range id reads nothing and raises the flag
        v = tl.load(v_ptr + idx[:, None] * stride_v + cols[None, :], mask=read[:, None] & col_mask, other=0.0)
        acc += w[:, None] * v.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask)
    if HAS_COUNTS:
        if pid_d == 0:
            ls = tl.arange(0, BLOCK_L)
            read_mask = row_mask[:, None] & (ls[None, :] < L)
            if HAS_VALID:
                valid = tl.load(valid_ptr + rows, mask=row_mask, other=0) != 0
                read_mask = read_mask & valid[:, None]
            idx2 = tl.load(idx_ptr + rows[:, None] * stride_idx + ls[None, :], mask=read_mask, other=0)
            ones = tl.full((BLOCK_N, BLOCK_L), 1, tl.int64)
            tl.atomic_add(counts_ptr + idx2, ones, mask=in_range(err_ptr, idx2, M, read_mask), sem="relaxed")


@triton.jit
def gather_backward_kernel(
    v_ptr, idx_ptr, w_ptr, g_ptr, slot_ptr, dv_ptr, gw_ptr,
    N, L, D, stride_v, stride_idx, stride_w, stride_g, stride_gw,
    HAS_SLOTS: tl.constexpr, NEED_VALUES: tl.constexpr, NEED_WEIGHTS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """Both gradients in one pass: each grad_out tile is loaded once and used for every read."""
    pid_n = tl.program_id(0)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_mask = rows < N
    ls = tl.arange(0, BLOCK_L)[None, :]
    grad_w = tl.zeros((BLOCK_N, BLOCK_L), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        tile_mask = row_mask[:, None] & (cols[None, :] < D)
        g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        for l in range(0, L):
            idx = tl.load(idx_ptr + rows * stride_idx + l, mask=row_mask, other=0)
            if NEED_WEIGHTS:
                v = tl.load(v_ptr + idx[:, None] * stride_v + cols[None, :], mask=tile_mask, other=0.0)
                part = tl.sum(v.to(tl.float32) * g, axis=1)
                grad_w = tl.where(ls == l, grad_w + part[:, None], grad_w)
            if NEED_VALUES:
                w = tl.load(w_ptr + rows * stride_w + l, mask=row_mask, other=0.0).to(tl.float32)
                if HAS_SLOTS:
                    target = tl.load(slot_ptr + idx, mask=row_mask, other=-1)
                    keep = row_mask & (target >= 0)
                else:
                    target = idx
                    keep = row_mask
                tl.atomic_add(dv_ptr + target[:, None] * D + cols[None, :], w[:, None] * g,
                              mask=keep[:, None] & (cols[None, :] < D), sem="relaxed")
    if NEED_WEIGHTS:
        tl.store(gw_ptr + rows[:, None] * stride_gw + ls, grad_w, mask=row_mask[:, None] & (ls < L))


@triton.jit
def segment_rows_kernel(
    g_ptr, w_ptr, order_ptr, sorted_ptr, dst_ptr,
    R, P, L, D, stride_g,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    """dst[r] = sum over the reads p of target r (in sorted order) of w[p] * g[p // L], for r < R.

    order: (P,) flat read ids (n * L + l) sorted by target; sorted: (P,) their targets,
    ascending (reads to skip carry target R). Row r's segment is [lower(r), lower(r + 1)),
    found by a branch-free binary search over ``sorted``.
    """
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    targets = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    row_mask = targets < R
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    # lower bound of targets and targets + 1 (first position whose target is >= the key)
    start = tl.zeros((BLOCK_R,), tl.int64)
    end = tl.zeros((BLOCK_R,), tl.int64)
    step = tl.full((BLOCK_R,), 1, tl.int64) << (SEARCH_STEPS - 1)
    for _ in tl.static_range(SEARCH_STEPS):
        probe = start + step - 1
        below = tl.load(sorted_ptr + probe, mask=probe < P, other=R + 1) < targets
        start = tl.where(below, start + step, start)
        probe = end + step - 1
        below = tl.load(sorted_ptr + probe, mask=probe < P, other=R + 1) < targets + 1
        end = tl.where(below, end + step, end)
        step = step >> 1
    longest = tl.max(tl.where(row_mask, end - start, 0), axis=0)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for p in range(0, longest):
        pos = start + p
        live = row_mask & (pos < end)
        read = tl.load(order_ptr + pos, mask=live, other=0)
        w = tl.load(w_ptr + read, mask=live, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + (read // L)[:, None] * stride_g + cols[None, :],
                    mask=live[:, None] & col_mask[None, :], other=0.0)
        acc += w[:, None] * g.to(tl.float32)
    tl.store(dst_ptr + targets[:, None] * D + cols[None, :], acc, mask=row_mask[:, None] & col_mask[None, :])


def _block_d(dim: int) -> int:
    # 128 fp32 columns = one 512-byte row segment: four full 128-byte lines per load, and the
    # segment kernel's (16, 128) fp32 accumulator stays in registers over 4 warps.
    return min(128, next_pow2(dim))


def row_tile_config(dim: int) -> dict:
    """Column tile, tokens per program and warps of the forward: one token's whole row (up to D = 1024) per
    program over 4 warps, so each token loads its ids and weights once. On an H100 at the paper size
    (N = 16,384, D = 896; benchmarks/RESULTS.md, "Launch configurations") that took bf16 from 0.31 to
    0.25 ms and fp32 from 0.68 to 0.65 ms against 8 tokens over 8 warps."""
    return {"BLOCK_D": min(1024, next_pow2(dim)), "BLOCK_N": 1, "num_warps": 4}


def backward_tile_config(dim: int, dtype: torch.dtype) -> dict:
    """The backward kernels hold grad_out and value tiles at once, so they loop 256-byte column tiles
    (64 fp32 or 128 16-bit columns; ids and weights re-read from L1 per tile) over 4 warps; the whole row in
    one tile costs ~200 registers (12% occupancy, AOT report). Tokens per program: 32 for fp32, 16 for
    16-bit values, the fastest measured on an H100 at the paper size for both the dense and the T-row
    gradient (benchmarks/RESULTS.md, "Launch configurations")."""
    if dtype == torch.float32:
        return {"BLOCK_D": min(64, _block_d(dim)), "BLOCK_N": 32, "num_warps": 4}
    return {"BLOCK_D": min(128, _block_d(dim)), "BLOCK_N": 16, "num_warps": 4}


def _block_l(per_token: int) -> int:
    # tl.arange needs a power of two. At least 2: a width-1 read axis (heads = topk = 1) is a shape
    # neither the tests nor the AOT report cover, and padding it costs one masked lane.
    return max(2, next_pow2(per_token))


def _dummy(t: torch.Tensor) -> torch.Tensor:
    return t  # any tensor of the right device stands in for an absent optional pointer


def plan_gather_forward(values, indices, weights, counts, valid):
    """(plan, out, error_flag): the forward launch, its (N, D) output (values' dtype) and the (1,) int32
    flag its index guards raise."""
    values, indices, weights = values.contiguous(), indices.contiguous(), weights.contiguous()
    num_tokens, per_token = indices.shape
    num_rows, dim = values.shape
    out = torch.empty(num_tokens, dim, dtype=values.dtype, device=values.device)
    flag = new_error_flag(values.device)
    config = row_tile_config(dim)
    block_n, block_d = config["BLOCK_N"], config["BLOCK_D"]
    plan = LaunchPlan(
        gather_forward_kernel, (cdiv(num_tokens, block_n), cdiv(dim, block_d)),
        (values, indices, weights, out,
         counts if counts is not None else _dummy(indices), valid if valid is not None else _dummy(indices), flag,
         num_tokens, per_token, num_rows, dim, values.stride(0), indices.stride(0), weights.stride(0),
         out.stride(0)),
        dict(HAS_COUNTS=counts is not None, HAS_VALID=valid is not None,
             BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_L=_block_l(per_token), num_warps=config["num_warps"]),
    )
    return plan, out, flag


def gather_forward(values, indices, weights, counts, valid):
    plan, out, flag = plan_gather_forward(values, indices, weights, counts, valid)
    if indices.shape[0] > 0:
        plan.launch()
        raise_if_flagged(flag, f"indices must lie in [0, {values.shape[0]})")
    return out


def plan_gather_backward(grad_out, values, indices, weights, slots, out_rows, need_values, need_weights):
    """(plan, (grad_values fp32 (out_rows or 0, D), grad_weights fp32 (N or 0, L))): the one-pass backward.

    slots: None (dense: target = row) or (M,) int64 row -> output row, -1 = not selected.
    """
    values, indices, weights, grad_out = (values.contiguous(), indices.contiguous(), weights.contiguous(),
                                          grad_out.contiguous())
    num_tokens, per_token = indices.shape
    dim = values.shape[1]
    grad_values = torch.zeros(out_rows if need_values else 0, dim, dtype=torch.float32, device=values.device)
    grad_weights = torch.empty(num_tokens if need_weights else 0, per_token, dtype=torch.float32,
                               device=values.device)
    config = backward_tile_config(dim, values.dtype)
    plan = LaunchPlan(
        gather_backward_kernel, (cdiv(num_tokens, config["BLOCK_N"]),),
        (values, indices, weights, grad_out, slots if slots is not None else _dummy(indices),
         grad_values, grad_weights if need_weights else _dummy(grad_values),
         num_tokens, per_token, dim, values.stride(0), indices.stride(0), weights.stride(0), grad_out.stride(0),
         per_token),
        dict(HAS_SLOTS=slots is not None, NEED_VALUES=need_values, NEED_WEIGHTS=need_weights,
             BLOCK_L=_block_l(per_token), **config),
    )
    return plan, (grad_values, grad_weights)


def plan_segment_rows(grad_out, indices, weights, slots, out_rows, block_r: int = 16):
    """(plan, grad_values fp32 (out_rows, D)): the deterministic value gradient, sorted by target row.

    block_r = 16 output rows per program: each program binary-searches its rows' segments once, and
    16 x 128 fp32 accumulators over 4 warps is 16 registers a thread (no spills in the AOT report).

    Only device-side torch ops (sort, gather, where) precede the launch: no host sync.
    """
    num_tokens, per_token = indices.shape
    dim = grad_out.shape[1]
    grad_out = grad_out.contiguous()
    dst = torch.empty(out_rows, dim, dtype=torch.float32, device=grad_out.device)
    targets = indices.reshape(-1)
    if slots is not None:  # unselected rows (-1) sort past every output row
        targets = slots[targets]
        targets = torch.where(targets >= 0, targets, out_rows)
    sorted_targets, order = torch.sort(targets, stable=True)
    reads = targets.numel()
    block_d = _block_d(dim)
    plan = LaunchPlan(
        segment_rows_kernel, (cdiv(out_rows, block_r), cdiv(dim, block_d)),
        (grad_out, weights.contiguous().reshape(-1), order, sorted_targets, dst,
         out_rows, reads, per_token, dim, grad_out.stride(0)),
        # SEARCH_STEPS: enough halvings to binary-search any of the `reads` sorted targets.
        dict(BLOCK_R=block_r, BLOCK_D=block_d, SEARCH_STEPS=max(1, reads.bit_length()), num_warps=4),
    )
    return plan, dst


def gather_backward(grad_out, values, indices, weights, slots, out_rows, deterministic, need_values,
                    need_weights):
    """(grad_values fp32 (out_rows or 0, D), grad_weights fp32 (N or 0, L)).

    Default: one fused pass with atomics. Deterministic: dW by the same kernel with
    NEED_VALUES off (no atomics) and dV by sorted segments, each row summed in a fixed order.
    """
    num_tokens = indices.shape[0]
    if not deterministic:
        plan, grads = plan_gather_backward(grad_out, values, indices, weights, slots, out_rows, need_values,
                                           need_weights)
        if num_tokens > 0 and (need_values or need_weights):
            plan.launch()
        return grads
    dim, per_token = values.shape[1], indices.shape[1]
    grad_values = torch.zeros(0, dim, dtype=torch.float32, device=values.device)
    grad_weights = torch.zeros(0, per_token, dtype=torch.float32, device=values.device)
    if need_values:
        plan, grad_values = plan_segment_rows(grad_out, indices, weights, slots, out_rows)
        if num_tokens == 0:
            grad_values.zero_()
        elif out_rows > 0:
            plan.launch()
    if need_weights:
        plan, (_, grad_weights) = plan_gather_backward(grad_out, values, indices, weights, None, 0,
                                                        need_values=False, need_weights=True)
        if num_tokens > 0:
            plan.launch()
    return grad_values, grad_weights
