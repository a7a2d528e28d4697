"""Product-key top-k lookup (SPEC §1 steps 2-3) as a differentiable custom op."""
from __future__ import annotations

import torch

from smf_kernels._checks import check_topk_args, no_autocast
from smf_kernels.backends import implementation, resolve_backend


def _scores_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@torch.library.custom_op("smf_kernels::product_key_topk", mutates_args=())
def _product_key_topk(query: torch.Tensor, keys: torch.Tensor, topk: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    with no_autocast(query.device):  # the kernels choose their own precision
        return implementation(backend).topk_forward(query, keys, topk)


@_product_key_topk.register_fake
def _(query, keys, topk, backend):
    shape = (query.shape[0], query.shape[1], topk)
    return query.new_empty(shape, dtype=_scores_dtype(query.dtype)), query.new_empty(shape, dtype=torch.int64)


def _sub_key_grad(grad_scores: torch.Tensor, sub_index: torch.Tensor, n_keys: int) -> torch.Tensor:
    """Scatter grad_scores (N, H, k) onto the sub-keys they came from: (N, H, n_keys).

    A sub-key can be shared by several of the k pairs, so this accumulates;
    index_put_(accumulate=True) is deterministic under use_deterministic_algorithms.
    """
    num_tokens, heads, _ = grad_scores.shape
    rows = torch.arange(num_tokens * heads, device=grad_scores.device).view(num_tokens, heads, 1) * n_keys
    dense = grad_scores.new_zeros(num_tokens * heads * n_keys)
    dense.index_put_(((rows + sub_index).flatten(),), grad_scores.flatten(), accumulate=True)
    return dense.view(num_tokens, heads, n_keys)


def _setup_context(ctx, inputs, output):
    query, keys, _, _ = inputs
    _, indices = output
    ctx.save_for_backward(query, keys, indices)


def _backward(ctx, grad_scores, _grad_indices):
    query, keys, indices = ctx.saved_tensors
    n_keys, half = keys.shape[2], keys.shape[3]
    dtype = _scores_dtype(query.dtype)
    grad_query = grad_keys = None
    with no_autocast(query.device):
        grad_scores = grad_scores.to(dtype)
        g1 = _sub_key_grad(grad_scores, torch.div(indices, n_keys, rounding_mode="floor"), n_keys)
        g2 = _sub_key_grad(grad_scores, indices % n_keys, n_keys)
        if ctx.needs_input_grad[0]:
            k = keys.to(dtype)
            grad_query = torch.cat(
                [torch.einsum("nhk,hkd->nhd", g1, k[:, 0]), torch.einsum("nhk,hkd->nhd", g2, k[:, 1])], dim=-1
            ).to(query.dtype)
        if ctx.needs_input_grad[1]:
            q = query.to(dtype)
            grad_keys = torch.stack(
                [torch.einsum("nhk,nhd->hkd", g1, q[..., :half]), torch.einsum("nhk,nhd->hkd", g2, q[..., half:])],
                dim=1,
            ).to(keys.dtype)
    return grad_query, grad_keys, None, None


_product_key_topk.register_autograd(_backward, setup_context=_setup_context)


def product_key_topk(
    query: torch.Tensor, keys: torch.Tensor, topk: int, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``topk`` slots of a product-key memory for every (token, head).

    Args:
        query: (N, H, key_dim) float tensor; halves ``[:key_dim//2]`` and
            ``[key_dim//2:]`` are matched against the two sub-key tables.
        keys: (H, 2, n_keys, key_dim // 2), same dtype and device as query.
        topk: slots per (token, head), 1 <= topk <= n_keys.
        backend: "torch", "triton", "ext" or None (see :mod:`smf_kernels.backends`).

    Returns:
        scores: (N, H, topk) float32 (float64 for float64 inputs), descending;
            differentiable w.r.t. query and keys.
        indices: (N, H, topk) int64 slot ids ``i * n_keys + j`` in [0, n_keys**2).
    """
    check_topk_args(query, keys, topk)
    name = resolve_backend(backend, query.device, query.dtype)
    return _product_key_topk(query, keys, topk, name)
