"""The ``triton`` backend: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1."""
from __future__ import annotations

import torch

from smf_kernels._precision import accumulation_dtype
from smf_kernels._rows import row_to_slot_map
from smf_kernels.triton_kernels import gather as triton_gather
from smf_kernels.triton_kernels import interpreter_enabled
from smf_kernels.triton_kernels import topk as triton_topk
from smf_kernels.triton_kernels import topk_backward as triton_topk_backward

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unavailable_reason(device: torch.device) -> str | None:
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreter_enabled():
        return None
    return ("Triton kernels need CUDA tensors (or, on CPU, the Triton interpreter: set "
            "TRITON_INTERPRET=1 before importing smf_kernels)")


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the triton backend supports {name} in float32/bfloat16/float16, got {t.dtype}")


def topk_forward(query, keys, topk):
    _check_dtype("query", query)
    return triton_topk.product_key_topk(query, keys, topk)


def topk_backward(grad_scores, query, keys, indices, need_query, need_keys):
    """Both gradients from the k selected sub-keys (fp32; no dense (N, H, n_keys) buffers)."""
    _check_dtype("query", query)
    return triton_topk_backward.topk_backward(grad_scores, query, keys, indices, need_query, need_keys)


def gather_forward(values, indices, weights, counts, valid):
    _check_dtype("values", values)
    _check_dtype("weights", weights)
    # The kernel indexes counts and valid with unit stride: give it contiguous ones.
    dense_counts = None if counts is None else counts.contiguous()
    out = triton_gather.gather_forward(values, indices, weights, dense_counts,
                                       None if valid is None else valid.contiguous())
    if dense_counts is not None and dense_counts.data_ptr() != counts.data_ptr():
        counts.copy_(dense_counts)
    return out


def gather_backward(grad_out, values, indices, weights, update_rows, deterministic, need_values, need_weights):
    slots = None if update_rows is None else row_to_slot_map(update_rows, values.shape[0])
    out_rows = values.shape[0] if update_rows is None else update_rows.numel()
    grad_values, grad_weights = triton_gather.gather_backward(
        grad_out, values, indices, weights, slots, out_rows, deterministic, need_values, need_weights)
    dtype = accumulation_dtype(values.dtype)
    return grad_values.to(dtype), grad_weights.to(dtype)
