"""Triton kernels: weighted gather + read histogram, and its backwards.

Every kernel tiles the value row in BLOCK_D columns, so any width D works
(896 is not a power of two), and accumulates in fp32.

* gather_forward_kernel: out[n] = sum_l w[n,l] * V[idx[n,l]]; the first column
  tile of each token block also bumps counts[idx] for valid tokens (integer
  atomics: exact and order-independent).
* gather_backward_weights_kernel: dW[n,l] = V[idx[n,l]] . dOut[n] (no atomics).
* scatter_rows_kernel: dV[target] += w[n,l] * dOut[n] with fp32 atomics, where
  target = idx (dense) or slot_of_row[idx] (sparse; -1 = not selected, skipped).
* segment_rows_kernel: the deterministic alternative. Reads sorted by row form
  segments; each segment is summed in a fixed order and written once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def gather_forward_kernel(
    v_ptr, idx_ptr, w_ptr, out_ptr, counts_ptr, valid_ptr,
    N, L, D, stride_v, stride_idx, stride_w, stride_out,
    HAS_COUNTS: tl.constexpr, HAS_VALID: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # int64: rows * stride can pass 2**31
    row_mask = rows < N
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    tile_mask = row_mask[:, None] & (cols[None, :] < D)
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for l in range(0, L):
        idx = tl.load(idx_ptr + rows * stride_idx + l, mask=row_mask, other=0)
        w = tl.load(w_ptr + rows * stride_w + l, mask=row_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + idx[:, None] * stride_v + cols[None, :], mask=tile_mask, other=0.0)
        acc += w[:, None] * v.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tile_mask)
    if HAS_COUNTS:
        if pid_d == 0:
            ls = tl.arange(0, BLOCK_L)
            read_mask = row_mask[:, None] & (ls[None, :] < L)
            if HAS_VALID:
                valid = tl.load(valid_ptr + rows, mask=row_mask, other=0) != 0
                read_mask = read_mask & valid[:, None]
            idx2 = tl.load(idx_ptr + rows[:, None] * stride_idx + ls[None, :], mask=read_mask, other=0)
            ones = tl.full((BLOCK_N, BLOCK_L), 1, tl.int64)
            tl.atomic_add(counts_ptr + idx2, ones, mask=read_mask)


@triton.jit
def gather_backward_weights_kernel(
    v_ptr, idx_ptr, g_ptr, gw_ptr,
    N, L, D, stride_v, stride_idx, stride_g, stride_gw,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # int64: rows * stride can pass 2**31
    row_mask = rows < N
    for l in range(0, L):
        idx = tl.load(idx_ptr + rows * stride_idx + l, mask=row_mask, other=0)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            tile_mask = row_mask[:, None] & (cols[None, :] < D)
            v = tl.load(v_ptr + idx[:, None] * stride_v + cols[None, :], mask=tile_mask, other=0.0)
            g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=tile_mask, other=0.0)
            acc += tl.sum(v.to(tl.float32) * g.to(tl.float32), axis=1)
        tl.store(gw_ptr + rows * stride_gw + l, acc, mask=row_mask)


@triton.jit
def scatter_rows_kernel(
    g_ptr, idx_ptr, w_ptr, slot_ptr, dst_ptr,
    N, L, D, stride_g, stride_idx, stride_w,
    HAS_SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # int64: rows * stride can pass 2**31
    row_mask = rows < N
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    for l in range(0, L):
        idx = tl.load(idx_ptr + rows * stride_idx + l, mask=row_mask, other=0)
        w = tl.load(w_ptr + rows * stride_w + l, mask=row_mask, other=0.0).to(tl.float32)
        if HAS_SLOTS:
            target = tl.load(slot_ptr + idx, mask=row_mask, other=-1)
            keep = row_mask & (target >= 0)
        else:
            target = idx
            keep = row_mask
        tl.atomic_add(dst_ptr + target[:, None] * D + cols[None, :], w[:, None] * g,
                      mask=keep[:, None] & col_mask[None, :])


@triton.jit
def segment_rows_kernel(
    g_ptr, w_ptr, order_ptr, seg_start_ptr, seg_target_ptr, dst_ptr,
    S, L, D, stride_g,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dst[target[s]] = sum over the reads p of segment s (in sorted order) of w[p] * g[p // L].

    order: flat read ids (n * L + l) sorted by row; seg_start: (S + 1,) offsets
    into order; seg_target: (S,) destination row, -1 = skip. Fixed summation order.
    """
    pid_s = tl.program_id(0)
    pid_d = tl.program_id(1)
    segs = (pid_s * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    seg_mask = segs < S
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    start = tl.load(seg_start_ptr + segs, mask=seg_mask, other=0)
    end = tl.load(seg_start_ptr + segs + 1, mask=seg_mask, other=0)
    target = tl.load(seg_target_ptr + segs, mask=seg_mask, other=-1)
    longest = tl.max(end - start, axis=0)
    acc = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    for p in range(0, longest):
        pos = start + p
        live = seg_mask & (pos < end)
        read = tl.load(order_ptr + pos, mask=live, other=0)
        w = tl.load(w_ptr + read, mask=live, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + (read // L)[:, None] * stride_g + cols[None, :],
                    mask=live[:, None] & col_mask[None, :], other=0.0)
        acc += w[:, None] * g.to(tl.float32)
    keep = seg_mask & (target >= 0)
    tl.store(dst_ptr + target[:, None] * D + cols[None, :], acc, mask=keep[:, None] & col_mask[None, :])


def _block_d(dim: int) -> int:
    return min(128, triton.next_power_of_2(dim))


def gather_forward(values, indices, weights, counts, valid, block_n: int = 16):
    values, indices, weights = values.contiguous(), indices.contiguous(), weights.contiguous()
    num_tokens, per_token = indices.shape
    dim = values.shape[1]
    out = torch.empty(num_tokens, dim, dtype=values.dtype, device=values.device)
    if num_tokens == 0:
        return out
    block_d = _block_d(dim)
    grid = (triton.cdiv(num_tokens, block_n), triton.cdiv(dim, block_d))
    gather_forward_kernel[grid](
        values, indices, weights, out,
        counts if counts is not None else indices, valid if valid is not None else indices,
        num_tokens, per_token, dim, values.stride(0), indices.stride(0), weights.stride(0), out.stride(0),
        HAS_COUNTS=counts is not None, HAS_VALID=valid is not None,
        BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_L=triton.next_power_of_2(per_token),
    )
    return out


def gather_backward_weights(grad_out, values, indices, block_n: int = 16):
    values, indices = values.contiguous(), indices.contiguous()
    num_tokens, per_token = indices.shape
    dim = values.shape[1]
    grad_weights = torch.empty(num_tokens, per_token, dtype=torch.float32, device=values.device)
    if num_tokens == 0:
        return grad_weights
    gather_backward_weights_kernel[(triton.cdiv(num_tokens, block_n),)](
        values, indices, grad_out, grad_weights,
        num_tokens, per_token, dim, values.stride(0), indices.stride(0), grad_out.stride(0),
        grad_weights.stride(0), BLOCK_N=block_n, BLOCK_D=_block_d(dim),
    )
    return grad_weights


def scatter_rows(grad_out, indices, weights, slots, out_rows, block_n: int = 16):
    """fp32 (out_rows, D) sums of w * grad_out per target row, with atomics."""
    indices, weights = indices.contiguous(), weights.contiguous()
    num_tokens, per_token = indices.shape
    dim = grad_out.shape[1]
    dst = torch.zeros(out_rows, dim, dtype=torch.float32, device=grad_out.device)
    if num_tokens == 0:
        return dst
    block_d = _block_d(dim)
    grid = (triton.cdiv(num_tokens, block_n), triton.cdiv(dim, block_d))
    scatter_rows_kernel[grid](
        grad_out, indices, weights, slots if slots is not None else indices, dst,
        num_tokens, per_token, dim, grad_out.stride(0), indices.stride(0), weights.stride(0),
        HAS_SLOTS=slots is not None, BLOCK_N=block_n, BLOCK_D=block_d,
    )
    return dst


def segment_rows(grad_out, indices, weights, slots, out_rows, block_s: int = 16):
    """Deterministic version of :func:`scatter_rows`: sort reads by row, sum each row's segment once."""
    num_tokens, per_token = indices.shape
    dim = grad_out.shape[1]
    dst = torch.zeros(out_rows, dim, dtype=torch.float32, device=grad_out.device)
    if num_tokens == 0:
        return dst
    flat = indices.reshape(-1)
    sorted_rows, order = torch.sort(flat, stable=True)
    seg_rows, seg_len = torch.unique_consecutive(sorted_rows, return_counts=True)  # host sync
    seg_start = torch.zeros(seg_rows.numel() + 1, dtype=torch.int64, device=flat.device)
    seg_start[1:] = torch.cumsum(seg_len, 0)
    seg_target = seg_rows if slots is None else slots[seg_rows]
    block_d = _block_d(dim)
    grid = (triton.cdiv(seg_rows.numel(), block_s), triton.cdiv(dim, block_d))
    segment_rows_kernel[grid](
        grad_out, weights.contiguous().reshape(-1), order, seg_start, seg_target, dst,
        seg_rows.numel(), per_token, dim, grad_out.stride(0),
        BLOCK_S=block_s, BLOCK_D=block_d,
    )
    return dst
