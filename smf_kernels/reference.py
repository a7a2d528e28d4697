"""Plain-PyTorch reference of every op: the oracle the fast paths are tested against.

Written for clarity, not speed; fully differentiable through autograd (so
``torch.autograd.gradcheck`` runs on it in float64). Semantics: docs/method.md#the-memory-layer.
"""
from __future__ import annotations

import torch

from smf_kernels._precision import accumulation_dtype


def ranked_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best entries of each row of ``scores`` (..., C) under the ranking every backend follows.

    Ranking (torch.topk's order, made total): NaN above +inf above every finite
    value above -inf; among equal scores (NaNs included) the lower column first.
    Returns values and int64 column ids (..., k), best first.
    """
    values, columns = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k].contiguous(), columns[..., :k].contiguous()


def product_key_topk_reference(
    query: torch.Tensor, keys: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Product-key top-k lookup.

    query: (N, H, key_dim); keys: (H, 2, n_keys, key_dim // 2).
    Returns scores (N, H, topk), sorted descending, in fp32 (fp64 for fp64
    inputs), and slot indices (N, H, topk) int64 in [0, n_keys**2), where
    slot = i * n_keys + j for first-half sub-key i and second-half sub-key j.
    Every top-k (each half's, then the candidates') follows :func:`ranked_topk`,
    so NaN and infinite scores rank as torch.topk ranks them and ties resolve
    to the lower sub-key / candidate id (candidate id = ia * topk + ib).
    """
    dtype = accumulation_dtype(query.dtype)
    n_keys = keys.shape[2]
    half = keys.shape[3]
    q = query.to(dtype)
    k = keys.to(dtype)
    s1 = torch.einsum("nhd,hkd->nhk", q[..., :half], k[:, 0])
    s2 = torch.einsum("nhd,hkd->nhk", q[..., half:], k[:, 1])
    a, i = ranked_topk(s1, topk)  # (N, H, topk) each
    b, j = ranked_topk(s2, topk)
    candidates = (a.unsqueeze(-1) + b.unsqueeze(-2)).flatten(-2)  # (N, H, topk*topk), c = ia * topk + ib
    scores, flat = ranked_topk(candidates, topk)
    first = i.gather(-1, torch.div(flat, topk, rounding_mode="floor"))
    second = j.gather(-1, flat % topk)
    return scores, first * n_keys + second


def weighted_gather_reference(
    values: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    counts: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted sum of gathered rows (an embedding bag in sum mode).

    values: (M, D); indices: (N, L) int64; weights: (N, L).
    Returns (N, D) in values' dtype, accumulated in fp32 (fp64 for fp64).
    counts: optional (M,) int64, incremented in place by one per (token, slot)
    read of every token whose valid[n] is True (all tokens when valid is None).
    """
    dtype = accumulation_dtype(values.dtype)
    rows = values[indices].to(dtype)  # (N, L, D)
    out = (weights.to(dtype).unsqueeze(-1) * rows).sum(dim=1)
    if counts is not None:
        read = indices if valid is None else indices[valid]
        counts += torch.bincount(read.flatten(), minlength=counts.numel()).to(counts.dtype)
    return out.to(values.dtype)


def silu_mul_reference(gate: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * read`` (docs/method.md#the-memory-layer, step 6), ``silu(x) = x * sigmoid(x)``."""
    return torch.nn.functional.silu(gate) * read


def row_adamw_reference(param, exp_avg, exp_avg_sq, row_step, rows, grad, *, lr, betas, eps, weight_decay,
                        grad_scale=None, valid=None):
    """Row-sparse AdamW (smf_kernels.ops.row_adamw_) in float64, without touching its inputs.

    param, exp_avg, exp_avg_sq: (M, D); row_step: (M,) int64; rows: (T,) distinct ids; grad: (T, D).
    Returns the new (param, exp_avg, exp_avg_sq) in float64 and row_step (M,) int64: row rows[t] moves
    by AdamW with gradient grad[t] * grad_scale unless valid[t] is False; other rows are copied.
    """
    beta1, beta2 = betas
    p, m, v = (t.detach().to(torch.float64).clone() for t in (param, exp_avg, exp_avg_sq))
    steps = row_step.clone()
    scale = 1.0 if grad_scale is None else float(grad_scale)
    for t, r in enumerate(rows.tolist()):
        if valid is not None and not bool(valid[t]):
            continue
        g = grad[t].to(torch.float64) * scale
        steps[r] += 1
        s = int(steps[r])
        m[r] = beta1 * m[r] + (1 - beta1) * g
        v[r] = beta2 * v[r] + (1 - beta2) * g * g
        denom = v[r].sqrt() / (1 - beta2 ** s) ** 0.5 + eps
        p[r] = p[r] * (1 - lr * weight_decay) - lr / (1 - beta1 ** s) * m[r] / denom
    return p, m, v, steps
