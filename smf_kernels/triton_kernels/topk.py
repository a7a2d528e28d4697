"""Triton kernel: fused product-key top-k (docs/method.md#the-memory-layer steps 2-3), exact under the ranking rule.

One program handles BLOCK_M tokens of one head:

1. Both half-score tiles (BLOCK_M, NK_P) come from ``tl.dot``: bf16/fp16 inputs
   on tensor cores with fp32 accumulation (products of 16-bit floats are exact
   in fp32, so this is the reference's fp32 sum up to summation order); fp32
   inputs in IEEE fp32 (no TF32, whose rounding could change the selection).
   Under the CPU interpreter 16-bit inputs are upcast and multiplied in fp32 too
   (its dot multiplies the raw bf16 bit patterns); the products are the same.
2. Each score becomes one int64 key, ``ordered(score) * 2**32 + (2**32 - 1 - id)``,
   whose integer order is the ranking of :func:`smf_kernels.reference.ranked_topk`
   (NaN > +inf > finite > -inf, equal scores to the lower id). A bitonic
   ``tl.topk`` on those keys replaces k rounds of argmax.
3. Of the k x k sums of the two sorted lists only pairs with (ia+1)(ib+1) <= k
   can reach the top-k (each is outranked by every pair above-left of it), about
   50 candidates for k = 16 instead of 256. That argument needs the sum to be
   monotone in each list; it fails only when +inf in one half meets -inf in the
   other (their sum is NaN, the top rank). A block holding such a row takes the
   full k x k candidate set instead, so the selection stays exact.

Nothing but the final (scores, slot ids) reaches global memory.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.jit import constexpr_function

from smf_kernels.triton_kernels.launch import LaunchPlan, cdiv, next_pow2



@triton.jit
def _ranking_keys(scores, ids):
    """int64 keys whose descending order ranks ``scores`` (fp32) as ranked_topk does, ties to lower ``ids``."""
    bits = scores.to(tl.int32, bitcast=True)
    bits = tl.where(scores == 0.0, 0, bits)  # -0.0 ranks equal to +0.0
    bits = tl.where(scores != scores, 0x7FC00000, bits)  # every NaN is one NaN, above +inf
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: larger magnitude ranks lower
    return (ordered.to(tl.int64) << 32) + ((4294967296 - 1) - ids.to(tl.int64))


@triton.jit
def _key_score(keys):
    """The fp32 score a ranking key was made from (NaN canonical, -0.0 as +0.0)."""
    ordered = (keys >> 32).to(tl.int32)
    bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _key_id(keys):
    return ((4294967296 - 1) - (keys - ((keys >> 32) << 32))).to(tl.int32)


@constexpr_function
def _log2(n):
    return int(n).bit_length() - 1


@triton.jit
def _position(n_dims: tl.constexpr, axis: tl.constexpr):
    """0/1 along hypercube axis ``axis`` (counted from the innermost), broadcastable to the cube."""
    return tl.reshape(tl.arange(0, 2), [1] * (n_dims - axis - 1) + [2] + [1] * axis)


@triton.jit
def _compare_swap(cube, descending_here, axis: tl.constexpr):
    """One bitonic compare-and-swap across hypercube axis ``axis`` (int64 keys).

    The partner of each element is the pair's sum minus itself (exact in wrapping int64
    arithmetic): one plain reduction, which the interpreter runs vectorised too.
    """
    n_dims: tl.constexpr = len(cube.shape)
    partner = tl.sum(cube, axis=n_dims - 1 - axis, keep_dims=True) - cube
    upper = _position(n_dims, axis)
    return tl.where((cube > partner) != (descending_here ^ upper), partner, cube)


@triton.jit
def _bitonic_merge(cube, stage: tl.constexpr, order: tl.constexpr):
    """Merge runs of 2**stage along the innermost axes; order 0 ascending, 1 descending, 2 alternating."""
    if order == 2:
        descending_here = _position(len(cube.shape), stage)
    else:
        descending_here = order
    for i in tl.static_range(stage):
        cube = _compare_swap(cube, descending_here, stage - 1 - i)
    return cube


@triton.jit
def _row_topk(x, K: tl.constexpr):
    """The K (a power of two) largest int64 keys of each row of x (R, C), largest first.

    Bitonic top-k: sort runs of K, then repeatedly keep the larger of each pair of
    runs and re-merge, as tl.topk does, but with a compare-and-swap the interpreter
    runs at numpy speed (tl.topk's xor reduction runs element by element there).
    """
    log_n: tl.constexpr = _log2(x.shape[1])
    log_k: tl.constexpr = _log2(K)
    cube = tl.reshape(x, [2] * _log2(x.numel))
    for i in tl.static_range(1, log_k + 1):
        cube = _bitonic_merge(cube, i, 2 if i < log_n else 1)
    for i in tl.static_range(log_k + 1, log_n + 1):
        cube = tl.max(cube, axis=len(cube.shape) - 1 - log_k)
        cube = _bitonic_merge(cube, log_k, 2 if i < log_n else 1)
    return tl.reshape(cube, [x.shape[0], K])


@triton.jit
def _half_keys(q_ptr, k_ptr, rows, row_mask, half_offset, stride_qn, stride_kk, n_keys,
               HALF: tl.constexpr, NK_P: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    """Ranking keys (BLOCK_M, NK_P) of one query half against one sub-key table; padded keys rank last.

    The dot runs over BLOCK_D-wide slices of the half (a loop, not one unrolled dot).
    """
    cols = tl.arange(0, NK_P)
    s = tl.zeros((rows.shape[0], NK_P), tl.float32)
    for d0 in range(0, HALF, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + rows[:, None] * stride_qn + half_offset + d[None, :],
                    mask=row_mask[:, None] & (d[None, :] < HALF), other=0.0)
        k = tl.load(k_ptr + cols[None, :] * stride_kk + d[:, None],
                    mask=(cols[None, :] < n_keys) & (d[:, None] < HALF), other=0.0)  # (BLOCK_D, NK_P)
        if IEEE:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), s, input_precision="ieee")
        else:
            s = tl.dot(q, k, s)  # 16-bit inputs, fp32 accumulation
    s = tl.where(cols[None, :] < n_keys, s, float("-inf"))  # padded ids > every real id: ranked below real -inf
    return _ranking_keys(s, cols[None, :])


@triton.jit
def _pair_keys(a_scores, b_scores, ia, ib, live, TOPK: tl.constexpr):
    """Ranking keys of the candidate pairs (ia, ib); candidate id c = ia * TOPK + ib as in the reference."""
    keys = _ranking_keys(a_scores + b_scores, ia * TOPK + ib)
    return tl.where(live, keys, tl.full(keys.shape, -2147483648, tl.int64) << 32)  # -2**63: below every key


@triton.jit
def _store_pairs(best, a_keys, b_keys, n_keys, out_scores, out_slots, out_mask, TOPK: tl.constexpr):
    """Store the best pair keys (BLOCK_M, K_P) as scores and slot ids i * n_keys + j."""
    cand = _key_id(best)
    i = _key_id(tl.gather(a_keys, cand // TOPK, axis=1))
    j = _key_id(tl.gather(b_keys, cand % TOPK, axis=1))
    tl.store(out_scores, _key_score(best), mask=out_mask)
    tl.store(out_slots, i.to(tl.int64) * n_keys + j, mask=out_mask)


@triton.jit
def _best_pruned_pairs(a_keys, b_keys, cand_ptr, TOPK: tl.constexpr, K_P: tl.constexpr, C_P: tl.constexpr):
    """Top keys (BLOCK_M, K_P) among the pairs with (ia+1)(ib+1) <= TOPK, listed at cand_ptr."""
    packed = tl.load(cand_ptr + tl.arange(0, C_P))[None, :] + tl.zeros((a_keys.shape[0], 1), tl.int32)
    live = packed >= 0  # ia * K_P + ib, -1 = padding
    ia = tl.where(live, packed // K_P, 0)
    ib = tl.where(live, packed % K_P, 0)
    a = _key_score(tl.gather(a_keys, ia, axis=1))
    b = _key_score(tl.gather(b_keys, ib, axis=1))
    return _row_topk(_pair_keys(a, b, ia, ib, live, TOPK), K_P)


@triton.jit
def _best_of_all_pairs(a_keys, b_keys, TOPK: tl.constexpr, K_P: tl.constexpr):
    """Top keys (BLOCK_M, K_P) among all TOPK x TOPK pairs: one first-half rank at a time, merged
    into a running top-K_P (small in registers; only blocks where +inf meets -inf come here)."""
    ranks = tl.arange(0, K_P)[None, :]
    b = _key_score(b_keys)
    best = tl.full(a_keys.shape, -2147483648, tl.int64) << 32
    for ia in range(TOPK):
        a = _key_score(tl.sum(tl.where(ranks == ia, a_keys, 0), axis=1))[:, None]
        row = _pair_keys(a, b, ia + tl.zeros_like(ranks), ranks, ranks < TOPK, TOPK)
        best = _row_topk(tl.reshape(tl.join(best, row), (a_keys.shape[0], 2 * K_P)), K_P)
    return best


@triton.jit
def product_key_topk_kernel(
    q_ptr, k_ptr, cand_ptr, out_scores_ptr, out_idx_ptr,
    N, n_keys,
    stride_qn, stride_qh, stride_kh, stride_kc, stride_kk, stride_on, stride_oh,
    HALF: tl.constexpr, NK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    TOPK: tl.constexpr, K_P: tl.constexpr, C_P: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # int64: rows * stride can pass 2**31
    row_mask = rows < N
    q_head = q_ptr + head * stride_qh
    k_head = k_ptr + head * stride_kh

    a_keys = _row_topk(_half_keys(q_head, k_head, rows, row_mask, 0, stride_qn, stride_kk, n_keys,
                                HALF, NK_P, BLOCK_D, IEEE), K_P)
    b_keys = _row_topk(_half_keys(q_head, k_head + stride_kc, rows, row_mask, HALF, stride_qn, stride_kk, n_keys,
                                HALF, NK_P, BLOCK_D, IEEE), K_P)

    out_cols = tl.arange(0, K_P)[None, :]
    out_off = rows[:, None] * stride_on + head * stride_oh + out_cols
    out_mask = row_mask[:, None] & (out_cols < TOPK)

    # +inf in one half's top-k meeting -inf in the other's breaks the pruning (inf - inf = NaN).
    ranks = tl.arange(0, K_P)[None, :] < TOPK
    a_s = _key_score(a_keys)
    b_s = _key_score(b_keys)
    a_pos = tl.max((ranks & (a_s == float("inf"))).to(tl.int32), axis=1)
    a_neg = tl.max((ranks & (a_s == float("-inf"))).to(tl.int32), axis=1)
    b_pos = tl.max((ranks & (b_s == float("inf"))).to(tl.int32), axis=1)
    b_neg = tl.max((ranks & (b_s == float("-inf"))).to(tl.int32), axis=1)
    mixed = tl.max((a_pos & b_neg) | (a_neg & b_pos), axis=0)
    if mixed != 0:
        best = _best_of_all_pairs(a_keys, b_keys, TOPK, K_P)
    else:
        best = _best_pruned_pairs(a_keys, b_keys, cand_ptr, TOPK, K_P, C_P)
    _store_pairs(best, a_keys, b_keys, n_keys, out_scores_ptr + out_off, out_idx_ptr + out_off, out_mask, TOPK)


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, next_pow2(n))


@functools.lru_cache(maxsize=None)
def _candidate_pairs(topk: int, k_pad: int, device: torch.device) -> torch.Tensor:
    """(C_P,) int32 packed ranks ia * k_pad + ib of the pairs with (ia+1)(ib+1) <= topk, padded with -1
    to a power of two; built once per (topk, device), so a launch copies nothing from the host."""
    pairs = [ia * k_pad + ib for ia in range(topk) for ib in range(topk) if (ia + 1) * (ib + 1) <= topk]
    # >= 16 wide: the widths the AOT report and tests cover
    pairs += [-1] * (_pow2_at_least(len(pairs), 16) - len(pairs))
    return torch.tensor(pairs, dtype=torch.int32, device=device)


def topk_block_config(half: int, k_pad: int, dtype: torch.dtype) -> dict:
    """Block sizes and warps for the top-k kernel, measured on an H100 at the paper shape and held to the
    AOT budgets (benchmarks/RESULTS.md, "Launch configurations"; no spills, >= 25% estimated occupancy on
    sm_90, under Triton 3.6 and 3.7). 16-bit queries: 64 tokens per program over 8 warps took the lookup
    from 0.63 ms (16 tokens, 4 warps) to 0.17 ms at N = 16,384. fp32 runs its dot on the FMA path: it keeps
    16 tokens and 8 warps (more tokens measured up to 14% faster but spill under Triton 3.7) and takes
    64-wide slices: 16-wide ones (measured on the H100) hit ptxas's 128 registers with a 16-byte spill
    under Triton 3.6, 32-wide ones a 32-byte spill under 3.7; 64-wide ones take 122-128 registers and no
    spill under both, for 72 KB of pipelined shared memory (two blocks still fit an SM).

    Warps are capped at one per 32 elements of a (BLOCK_M, K_P) top-k tile: with more, Triton lays
    warps across the K_P axis and cannot lower tl.gather along it (a compiler assertion in Triton
    3.6 and 3.7, seen on an H100 for top-k < 16)."""
    block_m = 16 if dtype == torch.float32 else 64
    warps = max(1, min(8, block_m * k_pad // 32))
    block_d = min(64 if dtype == torch.float32 else 32, _pow2_at_least(half, 16))
    return {"BLOCK_M": block_m, "BLOCK_D": block_d, "num_warps": warps}


def plan_product_key_topk(query: torch.Tensor, keys: torch.Tensor, topk: int) -> tuple[LaunchPlan, tuple]:
    """The launch the op makes: (plan, (scores, slots)) with outputs allocated, query/keys made contiguous."""
    query = query.contiguous()
    keys = keys.contiguous()
    num_tokens, heads, _ = query.shape
    n_keys, half = keys.shape[2], keys.shape[3]
    scores = torch.empty(num_tokens, heads, topk, dtype=torch.float32, device=query.device)
    slots = torch.empty(num_tokens, heads, topk, dtype=torch.int64, device=query.device)
    k_pad = _pow2_at_least(topk, 1)
    config = topk_block_config(half, k_pad, query.dtype)
    block_m = config["BLOCK_M"]
    pairs = _candidate_pairs(topk, k_pad, query.device)
    plan = LaunchPlan(
        product_key_topk_kernel, (cdiv(num_tokens, block_m), heads),
        (query, keys, pairs, scores, slots, num_tokens, n_keys,
         query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
         scores.stride(0), scores.stride(1)),
        # NK_P >= 16: tl.dot's smallest N
        dict(HALF=half, BLOCK_D=config["BLOCK_D"], NK_P=_pow2_at_least(n_keys, 16),
             TOPK=topk, K_P=k_pad, C_P=pairs.numel(), BLOCK_M=block_m,
             IEEE=query.dtype == torch.float32 or query.device.type == "cpu",
             num_warps=config["num_warps"]),
    )
    return plan, (scores, slots)


def product_key_topk(query: torch.Tensor, keys: torch.Tensor, topk: int):
    """query (N, H, key_dim), keys (H, 2, n_keys, key_dim//2) -> fp32 scores, int64 slots (N, H, topk)."""
    plan, (scores, slots) = plan_product_key_topk(query, keys, topk)
    if query.shape[0] > 0:
        plan.launch()
    return scores, slots
