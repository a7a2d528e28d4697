"""Triton kernel: fused product-key top-k (SPEC §1 steps 2-3).

One program handles BLOCK_M tokens of one head. It computes both half-score
blocks with tl.dot (fp32), takes the top-k of each by k rounds of row-wise argmax,
forms the k x k candidate sums in registers and takes their top-k the same way.
Nothing but the final (scores, slot ids) reaches global memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_topk(scores, cols, TOPK: tl.constexpr, K_P: tl.constexpr):
    """Top-TOPK of each row of ``scores`` (BLOCK_M, C): values and column ids, descending.

    Padded columns must already hold -inf. Ties go to the lowest column.
    Returns (BLOCK_M, K_P) tensors; columns >= TOPK hold -inf / 0.
    """
    slot = tl.arange(0, K_P)[None, :]
    top_vals = tl.full((scores.shape[0], K_P), float("-inf"), tl.float32)
    top_cols = tl.zeros((scores.shape[0], K_P), tl.int32)
    for t in tl.static_range(TOPK):
        best = tl.max(scores, axis=1)
        best_col = tl.argmax(scores, axis=1).to(tl.int32)
        top_vals = tl.where(slot == t, best[:, None], top_vals)
        top_cols = tl.where(slot == t, best_col[:, None], top_cols)
        scores = tl.where(cols[None, :] == best_col[:, None], float("-inf"), scores)
    return top_vals, top_cols


@triton.jit
def _half_scores(q_ptr, k_ptr, rows, row_mask, half_offset, stride_qn, stride_kk, n_keys,
                 HALF: tl.constexpr, HALF_P: tl.constexpr, NK_P: tl.constexpr):
    """Scores (BLOCK_M, NK_P) fp32 of one query half against one sub-key table; padded keys -inf.

    Inputs are upcast to fp32 and multiplied in IEEE fp32 (no TF32): the lookup
    is memory-bound, and exact-as-the-reference scores keep the top-k identical.
    """
    d = tl.arange(0, HALF_P)
    keys = tl.arange(0, NK_P)
    q = tl.load(q_ptr + rows[:, None] * stride_qn + half_offset + d[None, :],
                mask=row_mask[:, None] & (d[None, :] < HALF), other=0.0)
    k = tl.load(k_ptr + keys[None, :] * stride_kk + d[:, None],
                mask=(keys[None, :] < n_keys) & (d[:, None] < HALF), other=0.0)  # (HALF_P, NK_P)
    s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
    return tl.where(keys[None, :] < n_keys, s, float("-inf"))


@triton.jit
def product_key_topk_kernel(
    q_ptr, k_ptr, out_scores_ptr, out_idx_ptr,
    N, n_keys,
    stride_qn, stride_qh, stride_kh, stride_kc, stride_kk, stride_on, stride_oh,
    HALF: tl.constexpr, HALF_P: tl.constexpr, NK_P: tl.constexpr,
    TOPK: tl.constexpr, K_P: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # int64: rows * stride can pass 2**31
    row_mask = rows < N
    q_head = q_ptr + head * stride_qh
    k_head = k_ptr + head * stride_kh
    key_cols = tl.arange(0, NK_P)

    s1 = _half_scores(q_head, k_head, rows, row_mask, 0, stride_qn, stride_kk, n_keys, HALF, HALF_P, NK_P)
    a, a_idx = _row_topk(s1, key_cols, TOPK, K_P)
    s2 = _half_scores(q_head, k_head + stride_kc, rows, row_mask, HALF, stride_qn, stride_kk, n_keys,
                      HALF, HALF_P, NK_P)
    b, b_idx = _row_topk(s2, key_cols, TOPK, K_P)

    # k x k candidate sums, flattened row-major: candidate c = ia * K_P + ib.
    cand = tl.reshape(a[:, :, None] + b[:, None, :], (BLOCK_M, K_P * K_P))
    cand_cols = tl.arange(0, K_P * K_P)
    scores, best = _row_topk(cand, cand_cols, TOPK, K_P)

    # Map candidate ids back to sub-key ids without a gather: select by equality.
    slot = tl.arange(0, K_P)[None, None, :]
    ia = (best // K_P)[:, :, None]
    ib = (best % K_P)[:, :, None]
    i = tl.sum(tl.where(slot == ia, a_idx[:, None, :], 0), axis=2)
    j = tl.sum(tl.where(slot == ib, b_idx[:, None, :], 0), axis=2)
    slots = i.to(tl.int64) * n_keys + j.to(tl.int64)

    out_cols = tl.arange(0, K_P)[None, :]
    out_off = rows[:, None] * stride_on + head * stride_oh + out_cols
    out_mask = row_mask[:, None] & (out_cols < TOPK)
    tl.store(out_scores_ptr + out_off, scores, mask=out_mask)
    tl.store(out_idx_ptr + out_off, slots, mask=out_mask)


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, triton.next_power_of_2(n))


def product_key_topk(query: torch.Tensor, keys: torch.Tensor, topk: int, block_m: int = 32):
    """query (N, H, key_dim), keys (H, 2, n_keys, key_dim//2) -> fp32 scores, int64 slots (N, H, topk)."""
    query = query.contiguous()
    keys = keys.contiguous()
    num_tokens, heads, key_dim = query.shape
    n_keys, half = keys.shape[2], keys.shape[3]
    scores = torch.empty(num_tokens, heads, topk, dtype=torch.float32, device=query.device)
    slots = torch.empty(num_tokens, heads, topk, dtype=torch.int64, device=query.device)
    if num_tokens == 0:
        return scores, slots
    grid = (triton.cdiv(num_tokens, block_m), heads)
    product_key_topk_kernel[grid](
        query, keys, scores, slots,
        num_tokens, n_keys,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        scores.stride(0), scores.stride(1),
        HALF=half, HALF_P=_pow2_at_least(half, 16), NK_P=_pow2_at_least(n_keys, 16),
        TOPK=topk, K_P=_pow2_at_least(topk, 1), BLOCK_M=block_m,
    )
    return scores, slots
