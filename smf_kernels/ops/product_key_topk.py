"""Product-key top-k lookup (docs/method.md#the-memory-layer steps 2-3) as a differentiable custom op."""
from __future__ import annotations

import torch

from smf_kernels._checks import check_topk_args
from smf_kernels._precision import accumulation_dtype, no_autocast
from smf_kernels.backends import implementation, resolve_backend


@torch.library.custom_op("smf_kernels::product_key_topk", mutates_args=())
def _product_key_topk(query: torch.Tensor, keys: torch.Tensor, topk: int,
                      backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    with no_autocast(query.device):  # the kernels choose their own precision
        return implementation(backend).topk_forward(query, keys, topk)


@_product_key_topk.register_fake
def _(query, keys, topk, backend):
    shape = (query.shape[0], query.shape[1], topk)
    return query.new_empty(shape, dtype=accumulation_dtype(query.dtype)), query.new_empty(shape, dtype=torch.int64)


@torch.library.custom_op("smf_kernels::product_key_topk_backward", mutates_args=())
def _topk_backward(
    grad_scores: torch.Tensor,
    query: torch.Tensor,
    keys: torch.Tensor,
    indices: torch.Tensor,
    backend: str,
    need_query: bool,
    need_keys: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_query (N, H, key_dim), grad_keys (H, 2, n_keys, key_dim // 2)) in the scores' dtype;
    a gradient not needed comes back empty (0 elements)."""
    with no_autocast(query.device):
        grad_scores = grad_scores.to(accumulation_dtype(query.dtype)).contiguous()
        return implementation(backend).topk_backward(grad_scores, query, keys, indices, need_query, need_keys)


@_topk_backward.register_fake
def _(grad_scores, query, keys, indices, backend, need_query, need_keys):
    dtype = accumulation_dtype(query.dtype)
    return (query.new_empty(query.shape if need_query else (0,), dtype=dtype),
            keys.new_empty(keys.shape if need_keys else (0,), dtype=dtype))


def _setup_context(ctx, inputs, output):
    query, keys, _, backend = inputs
    _, indices = output
    ctx.save_for_backward(query, keys, indices)
    ctx.backend = backend


def _backward(ctx, grad_scores, _grad_indices):
    query, keys, indices = ctx.saved_tensors
    need_query, need_keys = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_query, grad_keys = _topk_backward(grad_scores, query, keys, indices, ctx.backend, need_query, need_keys)
    return (grad_query.to(query.dtype) if need_query else None, grad_keys.to(keys.dtype) if need_keys else None,
            None, None)


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
