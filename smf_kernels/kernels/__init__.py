"""Backend implementations of the ops' forward and backward primitives.

Each module (``torch_impl``, ``triton_impl``, ``ext_impl``) exposes the same
functions; :mod:`smf_kernels.ops` validates arguments and dispatches to them.

    unavailable_reason(device) -> str | None
    topk_forward(query, keys, topk) -> (scores fp32 (N,H,k), indices int64 (N,H,k))
    gather_forward(values, indices, weights, counts, valid) -> out (N, D), values' dtype
    gather_backward(grad_out, values, indices, weights, update_rows, deterministic,
                    need_values, need_weights)
        -> (grad_values, grad_weights), both fp32 (fp64 for fp64):
           grad_values (M, D) if update_rows is None else (T, D), row t for update_rows[t];
           grad_weights (N, L); a gradient not needed has 0 rows.
"""
from __future__ import annotations

import torch


def backward_in_two_passes(backend, grad_out, values, indices, weights, update_rows, deterministic,
                           need_values, need_weights):
    """``gather_backward`` for a backend that computes the two gradients separately, with its
    ``gather_backward_values`` and ``gather_backward_weights``."""
    dtype = torch.promote_types(values.dtype, torch.float32)
    grad_values = (backend.gather_backward_values(grad_out, indices, weights, values.shape[0], update_rows,
                                                  deterministic)
                   if need_values else grad_out.new_empty(0, values.shape[1], dtype=dtype))
    grad_weights = (backend.gather_backward_weights(grad_out, values, indices)
                    if need_weights else grad_out.new_empty(0, indices.shape[1], dtype=dtype))
    return grad_values, grad_weights
