"""The ``ext`` backend: the optional compiled extension built from ``csrc/``.

Importing this module raises ImportError (recorded by :mod:`smf_kernels.backends`
as the reason the backend is unavailable) when the extension is not built; see
:mod:`smf_kernels.build_ext`. The CPU kernels are deterministic whatever
``deterministic`` says; so are the CUDA ones (sorted reads, no float atomics).
float16 runs through a float32 copy.
"""
from __future__ import annotations

import torch

from smf_kernels._precision import accumulation_dtype
from smf_kernels.backends.torch_impl import Backend
from smf_kernels.build_ext import load_extension

_ext = load_extension()


def release_idle_outputs() -> int:
    """Return the cached blocks of freed large CPU outputs (csrc/cpu_output_pool.h) to the system; the bytes
    released."""
    return _ext.release_idle_outputs()


class ExtBackend(Backend):
    """The compiled kernels: top-k and the gather (forward and backward) on CPU and, when built with them, CUDA;
    the top-k backward, the gated read and row-sparse AdamW on CPU only (the torch ones elsewhere)."""

    name = "ext"

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type == "cpu":
            return None
        if device.type == "cuda":
            if _ext.with_cuda:
                return None
            return ("the compiled extension was built without CUDA kernels; on a CUDA machine run "
                    "`SMF_KERNELS_BUILD_EXT=1 pip install --no-build-isolation -e .`")
        return f"the compiled extension has no {device.type} kernels"

    def prepare_topk_keys(self, keys):
        """The layout the kernels read (csrc/bindings.cpp key_layout): on CPU in float32 the sub-keys padded to a
        multiple of 16 and transposed in panels of 16."""
        return _ext.prepare_topk_keys(keys)

    def topk_forward(self, query, keys, topk, key_layout=None):
        return _ext.topk_forward(query, keys, topk, key_layout)

    def topk_backward(self, grad_scores, query, keys, indices, need_query, need_keys):
        """CPU: the gradients from the k chosen sub-keys only (no dense (N, H, n_keys) buffers)."""
        if query.device.type != "cpu":
            return super().topk_backward(grad_scores, query, keys, indices, need_query, need_keys)
        return _ext.topk_backward(grad_scores, query, keys, indices, need_query, need_keys)

    def gather_forward(self, values, indices, weights, counts, valid):
        return _ext.gather_forward(values, indices, weights, counts, valid)

    def gather_backward(self, grad_out, values, indices, weights, update_rows, deterministic, need_values,
                        need_weights):
        """CPU: both gradients in one pass over the reads grouped by row. CUDA: the value and the weight gradient
        by a kernel each."""
        if values.device.type == "cpu":
            return _ext.gather_backward(grad_out, values, indices, weights, update_rows, need_values, need_weights)
        dtype = accumulation_dtype(values.dtype)
        grad_values = (_ext.gather_backward_values(grad_out, indices, weights, values.shape[0], update_rows)
                       if need_values else grad_out.new_empty(0, values.shape[1], dtype=dtype))
        grad_weights = (_ext.gather_backward_weights(grad_out, values, indices)
                        if need_weights else grad_out.new_empty(0, indices.shape[1], dtype=dtype))
        return grad_values, grad_weights

    def silu_mul_forward(self, gate, read):
        """CPU: silu(gate) * read in one pass."""
        if gate.device.type != "cpu":
            return super().silu_mul_forward(gate, read)
        return _ext.silu_mul_forward(gate, read)

    def silu_mul_backward(self, grad, gate, read):
        """CPU: (grad of gate, grad of read) in one pass."""
        if gate.device.type != "cpu":
            return super().silu_mul_backward(grad, gate, read)
        return _ext.silu_mul_backward(grad, gate, read)

    def row_adamw(self, param, exp_avg, exp_avg_sq, row_step, rows, grad, valid, lr, grad_scale, beta1, beta2,
                  eps, weight_decay, state_slots=None):
        """CPU: each selected row's parameter and moments (at its slot of ``state_slots`` when given) read and
        written once; the torch ops elsewhere, and for float16 or non-contiguous tables (updated in place, they
        cannot go through a float32 copy)."""
        if param.device.type != "cpu" or param.dtype == torch.float16 or not all(
                t.is_contiguous() for t in (param, exp_avg, exp_avg_sq, row_step)):
            return super().row_adamw(param, exp_avg, exp_avg_sq, row_step, rows, grad, valid, lr, grad_scale,
                                     beta1, beta2, eps, weight_decay, state_slots)
        # lr and grad_scale are 0-d tensors on the CPU: reading them is not a device sync
        _ext.row_adamw(param, exp_avg, exp_avg_sq, row_step, rows, grad, valid, float(lr),
                       1.0 if grad_scale is None else float(grad_scale), beta1, beta2, eps, weight_decay,
                       state_slots)


BACKEND = ExtBackend()
