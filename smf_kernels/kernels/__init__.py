"""Backend implementations of the ops' forward and backward primitives.

Each module (``torch_impl``, ``triton_impl``, ``ext_impl``) exposes the same
functions; :mod:`smf_kernels.ops` validates arguments and dispatches to them.

    unavailable_reason(device) -> str | None
    topk_forward(query, keys, topk) -> (scores fp32 (N,H,k), indices int64 (N,H,k))
    gather_forward(values, indices, weights, counts, valid) -> out (N, D), values' dtype
    gather_backward_weights(grad_out, values, indices) -> (N, L) fp32
    gather_backward_values(grad_out, indices, weights, num_rows, update_rows, deterministic)
        -> fp32 (num_rows, D) if update_rows is None else fp32 (T, D), row t for update_rows[t]
"""
