"""Triton kernels: the product-key top-k backward from the k selected sub-keys, without float atomics.

For the scores s[n, h, r] = q[n, h, :half] . K[h, 0, i_r] + q[n, h, half:] . K[h, 1, j_r] of the
slots ``i_r * n_keys + j_r`` the top-k chose, and their gradient g[n, h, r]:

* topk_query_grad_kernel: grad_query[n, h, c*half + d] = sum_r g[n, h, r] * K[h, c, sub_c(r), d]
  (sub_0 = i, sub_1 = j). A program owns BLOCK_T tokens of one (head, half c) and a column tile and
  gathers each token's k sub-key rows; programs next to each other share the (head, half) table
  (32 KB bf16 / 64 KB fp32 at the paper shape), so the gathers hit L1 / L2. No (N, H, n_keys) buffer.
* topk_key_grad_kernel: grad_keys[h, c, key, d] = sum over (n, r) with sub_c(r) = key of
  g[n, h, r] * q[n, h, c*half + d]. A program owns a chunk of tokens, one (head, half), NK_TILE
  sub-keys and a column tile. Per BLOCK_T tokens it builds the sub-key gradients G (BLOCK_T, NK_TILE)
  in registers, tokens along the lanes (each token's g summed per sub-key it picked, zero elsewhere:
  the reference's dense sub-key gradient, so 0 * inf = NaN wherever the reference has it) and adds
  q^T G to a transposed (BLOCK_D, NK_TILE) fp32 accumulator on tensor cores (G is tl.dot's
  shared-memory operand, q^T the register one: the layout that kept registers lowest). Each chunk
  writes its partial sum;
* sum_partials_kernel adds the partials in chunk order (chunks depend on N only).
No float atomics anywhere: every output element is summed in a fixed order, bit-reproducible.

The key-gradient dot (``DOT`` constexpr; every product exact or nearly, sums in fp32):
  "bf16x3" (bf16 queries): G as three bf16 parts whose sum is G exactly (each the next 8 significant
      bits, cut by truncation), three bf16 MMAs: every product g * q is exact in fp32, so this is the
      reference's fp32 sum up to summation order. A non-finite G entry stays whole in the first part.
  "tf32x3" (fp32 / fp16 queries): q and G each as a tf32 head and an exact tail, three TF32 MMAs
      (head*head + head*tail + tail*head: about 22 significant bits per product), plus a fourth
      pass for G's non-finite entries alone (a split would turn inf into NaN).
  Under the interpreter (whose tl.dot multiplies raw bf16 bit patterns) "bf16x3" upcasts its parts
  and multiplies in fp32 (the same products), so CPU tests run the split too.
  A non-finite query entry is the one case that differs from the reference: where the reference
  has +-inf in a picked sub-key's gradient, a split may give NaN (inf times a zero part).

Every access through a slot id is masked with :func:`guards.in_range` against n_keys**2 and the
launcher raises the flag: ``indices must lie in [0, n_keys**2)``. The sub-key arithmetic specialises
on n_keys (a constant divisor); the kernels need n_keys**2 < 2**31.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from smf_kernels.triton_kernels.guards import in_range, new_error_flag, raise_if_flagged
from smf_kernels.triton_kernels.launch import LaunchPlan, cdiv, next_pow2


@triton.jit
def _sub_keys(slot_ptr, err_ptr, live, half_id, N_KEYS: tl.constexpr):
    """(sub-key ids int32, ok): the first (half_id 0) or second sub-key of each slot; ok masks the
    live slots in [0, N_KEYS**2) (others raise the error flag and read as sub-key 0)."""
    slot = tl.load(slot_ptr, mask=live, other=0)
    ok = in_range(err_ptr, slot, N_KEYS * N_KEYS, live)
    s = tl.where(ok, slot, 0).to(tl.int32)  # < n_keys**2 < 2**31 once in range
    first = s // N_KEYS  # a constant divisor: a multiply and a shift
    return tl.where(half_id == 0, first, s - first * N_KEYS), ok


@triton.jit
def topk_query_grad_kernel(
    g_ptr, idx_ptr, k_ptr, gq_ptr, err_ptr,
    N, half,
    stride_gn, stride_gh, stride_in, stride_ih, stride_kh, stride_kc, stride_kk, stride_qn, stride_qh,
    N_KEYS: tl.constexpr, TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    head = tl.program_id(1) // 2
    half_id = tl.program_id(1) % 2
    rows = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # int64: rows * stride can pass 2**31
    live = rows < N
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < half
    table = k_ptr + head * stride_kh + half_id * stride_kc
    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    for r in range(TOPK):
        sub, ok = _sub_keys(idx_ptr + rows * stride_in + head * stride_ih + r, err_ptr, live, half_id, N_KEYS)
        g = tl.load(g_ptr + rows * stride_gn + head * stride_gh + r, mask=ok, other=0.0)
        key = tl.load(table + sub[:, None].to(tl.int64) * stride_kk + d[None, :],
                      mask=ok[:, None] & d_mask[None, :], other=0.0)
        acc += g[:, None] * key.to(tl.float32)
    out = gq_ptr + rows[:, None] * stride_qn + head * stride_qh + half_id * half + d[None, :]
    tl.store(out, acc, mask=live[:, None] & d_mask[None, :])


@triton.jit
def _finite(x):
    return tl.abs(x) < float("inf")  # False for +-inf and NaN


@triton.jit
def _truncate(x, LOW_BITS: tl.constexpr):
    """x (fp32) with its LOW_BITS low mantissa bits cleared (16: a bf16 value, 13: a tf32 value);
    |result| <= |x| and x - result is exact."""
    return (x.to(tl.int32, bitcast=True) & -(1 << LOW_BITS)).to(tl.float32, bitcast=True)


@triton.jit
def _dot_bf16x3(a, b, acc, EMULATE: tl.constexpr):
    """acc + a @ b for a bf16, b fp32: b = hi + mid + lo in bf16 parts, exactly where b is finite, so
    every product is exact and only the fp32 sums round. A non-finite b is all in hi (mid = lo = 0):
    its products are the reference's (inf * 0 = NaN, inf * q = +-inf)."""
    finite = _finite(b)
    b_fin = tl.where(finite, b, 0.0)
    hi = _truncate(b_fin, 16)
    rest = b_fin - hi
    hi = tl.where(finite, hi, b)
    mid = _truncate(rest, 16)
    lo = rest - mid
    if EMULATE:  # the interpreter (whose bf16 dot multiplies bit patterns): the same products in fp32
        af = a.to(tl.float32)
        acc = tl.dot(af, lo.to(tl.bfloat16).to(tl.float32), acc, input_precision="ieee")
        acc = tl.dot(af, mid.to(tl.bfloat16).to(tl.float32), acc, input_precision="ieee")
        acc = tl.dot(af, hi.to(tl.bfloat16).to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, lo.to(tl.bfloat16), acc)
        acc = tl.dot(a, mid.to(tl.bfloat16), acc)
        acc = tl.dot(a, hi.to(tl.bfloat16), acc)
    return acc


@triton.jit
def _dot_tf32x3(a, b, acc):
    """acc + a @ b for a, b fp32 on TF32 tensor cores: a = a_hi + a_lo, b = b_hi + b_lo (tf32 heads,
    exact tails), summed as a_lo b_hi + a_hi b_lo + a_hi b_hi (about 22 significant bits). Where b is
    not finite a split would make NaN (inf - inf, or inf times a zero tail) of the reference's +-inf,
    so non-finite b entries go through one more pass of their own, a @ (b where not finite, else 0),
    whose products are the reference's. (a is the query: see the module docstring for a non-finite a.)"""
    finite = _finite(b)
    a_hi = _truncate(a, 13)
    a_lo = a - a_hi
    b_fin = tl.where(finite, b, 0.0)
    b_hi = _truncate(b_fin, 13)
    b_lo = b_fin - b_hi
    acc = tl.dot(a_lo, b_hi, acc, input_precision="tf32")
    acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32")
    acc = tl.dot(a_hi, b_hi, acc, input_precision="tf32")
    # a NaN kept whole (a NaN payload in the 13 bits TF32 drops would read as inf); a_hi: a as TF32 reads it
    b_rest = tl.where(finite, 0.0, tl.where(b == b, b, float("nan")))
    return tl.dot(a_hi, b_rest, acc, input_precision="tf32")


@triton.jit
def topk_key_grad_kernel(
    g_ptr, idx_ptr, q_ptr, part_ptr, err_ptr,
    N, half, chunk_tokens, d_tiles,
    stride_gn, stride_gh, stride_in, stride_ih, stride_qn, stride_qh,
    N_KEYS: tl.constexpr, TOPK: tl.constexpr, NK_TILE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT: tl.constexpr, EMULATE: tl.constexpr,
):
    """part[chunk, head, c, key, d]: the grad_keys share of the chunk's tokens (part contiguous)."""
    chunk = tl.program_id(0)
    head = tl.program_id(1) // 2
    half_id = tl.program_id(1) % 2
    key_tile = tl.program_id(2) // d_tiles
    keys = key_tile * NK_TILE + tl.arange(0, NK_TILE)
    d = (tl.program_id(2) % d_tiles) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < half
    q_half = q_ptr + head * stride_qh + half_id * half
    start = chunk * chunk_tokens
    end = tl.minimum(start + chunk_tokens, N)
    acc = tl.zeros((BLOCK_D, NK_TILE), tl.float32)  # transposed: the sub-key gradients are tl.dot's B
    for t0 in range(start, end, BLOCK_T):
        rows = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        live = rows < end
        # G^T: the sub-key gradients of these tokens, tokens along the fast axis (one slot id per thread
        # and pick, compared with every sub-key the thread holds)
        grad_t = tl.zeros((NK_TILE, BLOCK_T), tl.float32)
        for r in range(TOPK):
            sub, ok = _sub_keys(idx_ptr + rows * stride_in + head * stride_ih + r, err_ptr, live, half_id, N_KEYS)
            g = tl.load(g_ptr + rows * stride_gn + head * stride_gh + r, mask=ok, other=0.0)
            grad_t += tl.where(keys[:, None] == sub[None, :], g[None, :], 0.0)
        grad = tl.trans(grad_t)
        q = tl.load(q_half + rows[:, None] * stride_qn + d[None, :], mask=live[:, None] & d_mask[None, :],
                    other=0.0)
        q_t = tl.trans(q)
        if DOT == "bf16x3":
            acc = _dot_bf16x3(q_t, grad, acc, EMULATE)
        else:
            acc = _dot_tf32x3(q_t.to(tl.float32), grad, acc)
    out = part_ptr + (chunk * tl.num_programs(1) + tl.program_id(1)).to(tl.int64) * N_KEYS * half
    acc = tl.trans(acc)
    tl.store(out + keys[:, None] * half + d[None, :], acc, mask=(keys[:, None] < N_KEYS) & d_mask[None, :])


@triton.jit
def sum_partials_kernel(part_ptr, out_ptr, numel, chunks, BLOCK: tl.constexpr):
    """out[e] = sum over c of part[c, e], c ascending (a fixed order)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), tl.float32)
    part = part_ptr + offs
    for _ in range(chunks):
        acc += tl.load(part, mask=mask, other=0.0)
        part += numel
    tl.store(out_ptr + offs, acc, mask=mask)


def query_grad_config(half: int) -> dict:
    """32 tokens x up to 128 columns (a whole 256 / 512-byte sub-key row) of one (head, half) per program,
    8 warps: 64 / 48 registers fp32 / bf16 on sm_90 (4 warps took 124 for fp32: 25%)."""
    return {"BLOCK_T": 32, "BLOCK_D": min(128, max(16, next_pow2(half))), "num_warps": 8}


def key_grad_config(n_keys: int, half: int) -> dict:
    """64 sub-keys x up to 128 columns per program, 32 tokens per dot step (tl.dot needs >= 16 each way),
    8 warps, so each thread compares one slot id per pick with 8 sub-keys. ptxas's registers are capped
    per dot (``maxnreg``): "tf32x3" (fp32 / fp16 queries) asks for 143 uncapped and fits 128 with no spill
    on sm_90 (25% occupancy at 8 warps; 80 spills 436 B); "bf16x3" took 102 (25%) and fits 80 with no
    spill on sm_90 under Triton 3.6 and 3.7 (37.5%; sm_80's ptxas spills 1,236 B there, 284 B at 128;
    the budget holds sm_90). 4 warps spill at 128. Chunks of >= 256 tokens (a multiple of the
    32-token step), at most 32: at the paper shape (N = 16,384) 32 chunks x 8 (head, half) x 2
    sub-key tiles = 512 programs and 16 MB of fp32 partials (in L2); at N = 4,096, 16 chunks."""
    return {"NK_TILE": min(64, max(16, next_pow2(n_keys))), "BLOCK_T": 32,
            "BLOCK_D": min(128, max(16, next_pow2(half))), "num_warps": 8, "maxnreg": {"bf16x3": 80, "tf32x3": 128},
            "max_chunks": 32, "min_chunk_tokens": 256}


def _check_n_keys(n_keys: int) -> None:
    if n_keys * n_keys >= 2 ** 31:
        raise ValueError(f"the triton top-k backward needs n_keys**2 < 2**31, got n_keys = {n_keys}")


def key_grad_dot(dtype: torch.dtype, device: torch.device) -> tuple[str, bool]:
    """(DOT, EMULATE) of the key-gradient kernel for queries of ``dtype`` (see the module docstring)."""
    if dtype == torch.bfloat16:
        return "bf16x3", device.type == "cpu"
    return "tf32x3", False


def plan_topk_query_grad(grad_scores, keys, indices, err) -> tuple[LaunchPlan, torch.Tensor]:
    """(plan, grad_query fp32 (N, H, 2 * half)). grad_scores (N, H, k) fp32, keys (H, 2, n_keys, half),
    indices (N, H, k) int64, err a (1,) int32 error flag (:func:`guards.new_error_flag`)."""
    keys = keys.contiguous()
    num_tokens, heads, topk = indices.shape
    n_keys, half = keys.shape[2], keys.shape[3]
    _check_n_keys(n_keys)
    grad_query = torch.empty(num_tokens, heads, 2 * half, dtype=torch.float32, device=keys.device)
    config = query_grad_config(half)
    plan = LaunchPlan(
        topk_query_grad_kernel, (cdiv(num_tokens, config["BLOCK_T"]), heads * 2, cdiv(half, config["BLOCK_D"])),
        (grad_scores, indices, keys, grad_query, err, num_tokens, half,
         grad_scores.stride(0), grad_scores.stride(1), indices.stride(0), indices.stride(1),
         keys.stride(0), keys.stride(1), keys.stride(2), grad_query.stride(0), grad_query.stride(1)),
        dict(N_KEYS=n_keys, TOPK=topk, **config),
    )
    return plan, grad_query


def plan_topk_key_grad(grad_scores, query, indices, n_keys, err) -> tuple[LaunchPlan, torch.Tensor]:
    """(plan, partials fp32 (chunks, H, 2, n_keys, half)): each chunk of tokens' share of grad_keys.
    query (N, H, 2 * half); the other arguments as :func:`plan_topk_query_grad`'s."""
    query = query.contiguous()
    num_tokens, heads, topk = indices.shape
    half = query.shape[2] // 2
    _check_n_keys(n_keys)
    config = key_grad_config(n_keys, half)
    block_t, block_d = config["BLOCK_T"], config["BLOCK_D"]
    tokens = max(num_tokens, 1)
    chunk_tokens = cdiv(max(config["min_chunk_tokens"], cdiv(tokens, config["max_chunks"])), block_t) * block_t
    chunks = cdiv(tokens, chunk_tokens)
    partials = torch.empty(chunks, heads, 2, n_keys, half, dtype=torch.float32, device=query.device)
    d_tiles = cdiv(half, block_d)
    dot, emulate = key_grad_dot(query.dtype, query.device)
    plan = LaunchPlan(
        topk_key_grad_kernel, (chunks, heads * 2, cdiv(n_keys, config["NK_TILE"]) * d_tiles),
        (grad_scores, indices, query, partials, err, num_tokens, half, chunk_tokens, d_tiles,
         grad_scores.stride(0), grad_scores.stride(1), indices.stride(0), indices.stride(1), query.stride(0),
         query.stride(1)),
        dict(N_KEYS=n_keys, TOPK=topk, NK_TILE=config["NK_TILE"], BLOCK_T=block_t, BLOCK_D=block_d, DOT=dot,
             EMULATE=emulate, num_warps=config["num_warps"], maxnreg=config["maxnreg"][dot]),
    )
    return plan, partials


def plan_sum_partials(partials: torch.Tensor, block: int = 1024) -> tuple[LaunchPlan, torch.Tensor]:
    """(plan, fp32 sum over dim 0 of partials): the chunks added in order, 4 elements a thread."""
    out = torch.empty(partials.shape[1:], dtype=torch.float32, device=partials.device)
    numel = out.numel()
    plan = LaunchPlan(sum_partials_kernel, (cdiv(numel, block),), (partials, out, numel, partials.shape[0]),
                      dict(BLOCK=block, num_warps=8))
    return plan, out


def topk_backward(grad_scores, query, keys, indices, need_query: bool, need_keys: bool):
    """(grad_query fp32 (N, H, key_dim) or (0,), grad_keys fp32 (H, 2, n_keys, key_dim // 2) or (0,)).

    grad_scores: (N, H, k) fp32; query (N, H, key_dim) and keys (H, 2, n_keys, key_dim // 2) of one
    float dtype; indices (N, H, k) int64 slots. A slot outside [0, n_keys**2) raises RuntimeError: at
    once on CPU, at the next synchronising call on CUDA (no access is made through it either way).
    """
    grad_scores, indices = grad_scores.contiguous(), indices.contiguous()
    num_tokens, n_keys = indices.shape[0], keys.shape[2]
    device = query.device
    err = new_error_flag(device)
    grad_query = grad_keys = torch.empty(0, dtype=torch.float32, device=device)
    if need_query:
        plan, grad_query = plan_topk_query_grad(grad_scores, keys, indices, err)
        if num_tokens > 0:
            plan.launch()
    if need_keys and num_tokens == 0:
        grad_keys = torch.zeros(keys.shape, dtype=torch.float32, device=device)
    elif need_keys:
        plan, partials = plan_topk_key_grad(grad_scores, query, indices, n_keys, err)
        plan.launch()
        if partials.shape[0] == 1:
            grad_keys = partials[0]
        else:
            plan, grad_keys = plan_sum_partials(partials)
            plan.launch()
    if num_tokens > 0 and (need_query or need_keys):
        raise_if_flagged(err, f"indices must lie in [0, n_keys**2 = {n_keys * n_keys})")
    return grad_query, grad_keys
