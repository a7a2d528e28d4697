"""The ``triton`` backend: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1."""
from __future__ import annotations

import torch

from smf_kernels._precision import accumulation_dtype
from smf_kernels.backends.torch_impl import Backend
from smf_kernels.triton_kernels import gather as triton_gather
from smf_kernels.triton_kernels import interpreter_enabled
from smf_kernels.triton_kernels import row_adamw as triton_row_adamw
from smf_kernels.triton_kernels import row_backward as triton_row_backward
from smf_kernels.triton_kernels import topk as triton_topk
from smf_kernels.triton_kernels import topk_backward as triton_topk_backward

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the triton backend supports {name} in float32/bfloat16/float16, got {t.dtype}")


class TritonBackend(Backend):
    """Triton kernels for top-k, the gather and row-sparse AdamW (forward and backward); the gated read
    (``silu_mul``) has no kernel here and runs as the torch composition."""

    name = "triton"
    supported_dtypes = SUPPORTED_DTYPES
    # Every Triton kernel masks each access through a loaded id and raises an error flag (triton_kernels.guards),
    # so on CUDA the ops skip their host-side range check of the gather's ids (smf_kernels.ops.weighted_gather), and
    # of the backward's update_rows (range and distinctness, checked where the row backward maps them to slots).
    kernels_guard_indices = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type == "cuda":
            return None
        if device.type == "cpu" and interpreter_enabled():
            return None
        return ("Triton kernels need CUDA tensors (or, on CPU, the Triton interpreter: set "
                "TRITON_INTERPRET=1 before importing smf_kernels)")

    def prepare_topk_keys(self, keys):
        """None: the kernel reads the keys as they are, in their own dtype."""
        return None

    def topk_forward(self, query, keys, topk, key_layout=None):
        _check_dtype("query", query)
        return triton_topk.product_key_topk(query, keys, topk)

    def topk_backward(self, grad_scores, query, keys, indices, need_query, need_keys):
        """Both gradients from the k selected sub-keys (fp32; no dense (N, H, n_keys) buffers)."""
        _check_dtype("query", query)
        return triton_topk_backward.topk_backward(grad_scores, query, keys, indices, need_query, need_keys)

    def gather_forward(self, values, indices, weights, counts, valid):
        _check_dtype("values", values)
        _check_dtype("weights", weights)
        # The kernel indexes counts and valid with unit stride: give it contiguous ones.
        dense_counts = None if counts is None else counts.contiguous()
        out = triton_gather.gather_forward(values, indices, weights, dense_counts,
                                           None if valid is None else valid.contiguous())
        if dense_counts is not None and dense_counts.data_ptr() != counts.data_ptr():
            counts.copy_(dense_counts)
        return out

    def gather_backward(self, grad_out, values, indices, weights, update_rows, deterministic, need_values,
                        need_weights):
        # One path whatever ``deterministic`` says: the row-owned backward sums in a fixed order, no atomics.
        return self._row_backward(grad_out, values, indices, weights, update_rows, need_values, need_weights, None)

    def gather_backward_into(self, grad_out, values, indices, weights, update_rows, sink, deterministic,
                             need_weights):
        """The (T, D) value gradient added into ``sink`` (contiguous float32) in the row pass's epilogue: no
        (T, D) buffer and no add launch (the same fp32 adds as ``sink += compact``); another sink through a
        (T, D) buffer."""
        if not (sink.is_contiguous() and sink.dtype == torch.float32):
            return super().gather_backward_into(grad_out, values, indices, weights, update_rows, sink, deterministic,
                                                need_weights)
        return self._row_backward(grad_out, values, indices, weights, update_rows, True, need_weights, sink)[1]

    @staticmethod
    def _row_backward(grad_out, values, indices, weights, update_rows, need_values, need_weights, into):
        """Both gradients of the gather from the row-owned kernels (the value one added into ``into`` when
        given), in the accumulation dtype."""
        grad_values, grad_weights = triton_row_backward.gather_backward(
            grad_out, values, indices, weights, update_rows, need_values, need_weights, into=into)
        dtype = accumulation_dtype(values.dtype)
        return grad_values.to(dtype), grad_weights.to(dtype)

    def row_adamw(self, param, exp_avg, exp_avg_sq, row_step, rows, grad, valid, lr, grad_scale, beta1, beta2,
                  eps, weight_decay, state_slots=None):
        """One program per row (its state at its slot of ``state_slots`` when given); float16 or non-contiguous
        tables (updated in place) take the torch ops."""
        if param.dtype not in SUPPORTED_DTYPES or not all(t.is_contiguous() for t in (param, exp_avg, exp_avg_sq,
                                                                                       row_step)):
            return super().row_adamw(param, exp_avg, exp_avg_sq, row_step, rows, grad, valid, lr, grad_scale,
                                     beta1, beta2, eps, weight_decay, state_slots)
        triton_row_adamw.row_adamw(param, exp_avg, exp_avg_sq, row_step, rows, grad, valid, lr, grad_scale, beta1,
                                   beta2, eps, weight_decay, state_slots)


BACKEND = TritonBackend()
