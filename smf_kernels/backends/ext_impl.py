"""The ``ext`` backend: the optional compiled extension built from ``csrc/``.

Importing this module raises ImportError (recorded by :mod:`smf_kernels.backends`
as the reason the backend is unavailable) when the extension is not built; see
:mod:`smf_kernels.build_ext`. The CPU kernels are deterministic whatever
``deterministic`` says; so are the CUDA ones (sorted reads, no float atomics).
float16 runs through a float32 copy.
"""
from __future__ import annotations

import sys

import torch

from smf_kernels.build_ext import load_extension
from smf_kernels.backends import torch_impl
from smf_kernels.backends.two_pass import backward_in_two_passes

_ext = load_extension()


def unavailable_reason(device: torch.device) -> str | None:
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        if _ext.with_cuda:
            return None
        return ("the compiled extension was built without CUDA kernels; on a CUDA machine run "
                "`SMF_KERNELS_BUILD_EXT=1 pip install --no-build-isolation -e .`")
    return f"the compiled extension has no {device.type} kernels"


def release_idle_outputs() -> int:
    """Return the cached blocks of freed large CPU outputs (csrc/cpu_output_pool.h) to the system; the bytes
    released."""
    return _ext.release_idle_outputs()


def topk_forward(query, keys, topk):
    scores, indices = _ext.topk_forward(query, keys, topk)
    return scores, indices


def topk_backward(grad_scores, query, keys, indices, need_query, need_keys):
    """CPU: the gradients from the k chosen sub-keys only (no dense (N, H, n_keys) buffers); None elsewhere."""
    if query.device.type != "cpu":
        return None
    return _ext.topk_backward(grad_scores, query, keys, indices, need_query, need_keys)


def gather_forward(values, indices, weights, counts, valid):
    return _ext.gather_forward(values, indices, weights, counts, valid)


def gather_backward_weights(grad_out, values, indices):
    return _ext.gather_backward_weights(grad_out, values, indices)


def gather_backward_values(grad_out, indices, weights, num_rows, update_rows, deterministic):
    return _ext.gather_backward_values(grad_out, indices, weights, num_rows, update_rows)


def gather_backward(grad_out, values, indices, weights, update_rows, deterministic, need_values, need_weights):
    """CPU: both gradients in one pass over the reads grouped by row. CUDA: the two kernels."""
    if values.device.type == "cpu":
        return _ext.gather_backward(grad_out, values, indices, weights, update_rows, need_values, need_weights)
    return backward_in_two_passes(sys.modules[__name__], grad_out, values, indices, weights, update_rows,
                                  deterministic, need_values, need_weights)


def silu_mul_forward(gate, read):
    """CPU: silu(gate) * read in one pass; None elsewhere (the plain composition runs)."""
    return _ext.silu_mul_forward(gate, read) if gate.device.type == "cpu" else None


def silu_mul_backward(grad, gate, read):
    """CPU: (grad of gate, grad of read) in one pass; None elsewhere."""
    return _ext.silu_mul_backward(grad, gate, read) if gate.device.type == "cpu" else None


def row_adamw(param, exp_avg, exp_avg_sq, row_step, rows, grad, valid, lr, grad_scale, beta1, beta2, eps,
              weight_decay):
    """CPU: each selected row's parameter and moments read and written once; the torch ops elsewhere, and for
    float16 or non-contiguous tables (updated in place, they cannot go through a float32 copy)."""
    if param.device.type != "cpu" or param.dtype == torch.float16 or not all(
            t.is_contiguous() for t in (param, exp_avg, exp_avg_sq, row_step)):
        return torch_impl.row_adamw(param, exp_avg, exp_avg_sq, row_step, rows, grad, valid, lr, grad_scale, beta1,
                                    beta2, eps, weight_decay)
    # lr and grad_scale are 0-d tensors on the CPU: reading them is not a device sync
    _ext.row_adamw(param, exp_avg, exp_avg_sq, row_step, rows, grad, valid, float(lr),
                   1.0 if grad_scale is None else float(grad_scale), beta1, beta2, eps, weight_decay)
