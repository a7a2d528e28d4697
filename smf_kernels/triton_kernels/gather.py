"""Triton kernel: the weighted gather + read histogram (the forward), without host syncs.

Each launcher is split into a ``plan_*`` function returning the :class:`LaunchPlan` it launches,
which benchmarks/triton_aot.py compiles for sm_90 / sm_80. The kernel accumulates in fp32 and
tiles the value row in BLOCK_D columns, so any width D works (896 is not a power of two).

* gather_forward_kernel: out[n] = sum_l w[n,l] * V[idx[n,l]]; the first column
  tile of each token block also bumps counts[idx] for valid tokens (relaxed
  integer atomics: exact and order-independent). Up to D = 1024 one tile holds
  the whole row, so a token loads its ids and weights once.

Its backward is :mod:`smf_kernels.triton_kernels.row_backward` (row-owned, no float atomics).

Index guards: every access through a loaded index is masked by :func:`guards.in_range`; the
launcher raises "indices must lie in [0, M)".
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


def row_tile_config(dim: int) -> dict:
    """Column tile, tokens per program and warps of the forward: one token's whole row (up to D = 1024) per
    program over 4 warps, so each token loads its ids and weights once. On an H100 at the paper size
    (N = 16,384, D = 896; benchmarks/RESULTS.md, "Launch configurations") that took bf16 from 0.31 to
    0.25 ms and fp32 from 0.68 to 0.65 ms against 8 tokens over 8 warps."""
    return {"BLOCK_D": min(1024, next_pow2(dim)), "BLOCK_N": 1, "num_warps": 4}


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
