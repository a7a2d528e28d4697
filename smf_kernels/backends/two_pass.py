"""The backward of a backend that computes the value and weight gradients in separate passes."""
from __future__ import annotations

from smf_kernels._precision import accumulation_dtype


def backward_in_two_passes(backend, grad_out, values, indices, weights, update_rows, deterministic,
                           need_values, need_weights):
    """``gather_backward`` for a backend that computes the two gradients separately, with its
    ``gather_backward_values`` and ``gather_backward_weights``."""
    dtype = accumulation_dtype(values.dtype)
    grad_values = (backend.gather_backward_values(grad_out, indices, weights, values.shape[0], update_rows,
                                                  deterministic)
                   if need_values else grad_out.new_empty(0, values.shape[1], dtype=dtype))
    grad_weights = (backend.gather_backward_weights(grad_out, values, indices)
                    if need_weights else grad_out.new_empty(0, indices.shape[1], dtype=dtype))
    return grad_values, grad_weights
