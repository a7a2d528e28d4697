"""The ``torch`` backend: plain PyTorch on any device, memory-bounded by chunking.

Same semantics as :mod:`smf_kernels.reference`, but without autograd and with
the (N, L, D) gathered-row tensors built a chunk of tokens at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from smf_kernels.reference import product_key_topk_reference

# Upper bound on elements of a temporary (chunk, L, D) tensor: 16M fp32 = 64 MiB.
_CHUNK_ELEMENTS = 1 << 24


def unavailable_reason(device: torch.device) -> str | None:
    return None


def _token_chunks(num_tokens: int, per_token: int):
    step = max(1, _CHUNK_ELEMENTS // max(1, per_token))
    for start in range(0, num_tokens, step):
        yield slice(start, min(num_tokens, start + step))


def topk_forward(query: torch.Tensor, keys: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return product_key_topk_reference(query, keys, topk)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def gather_forward(values, indices, weights, counts, valid):
    num_tokens, per_token = indices.shape
    if values.dtype in (torch.float32, torch.float64):
        out = F.embedding_bag(indices, values, per_sample_weights=weights.to(values.dtype), mode="sum")
    else:  # low precision: gather rows and accumulate in fp32, a chunk at a time
        out = values.new_empty(num_tokens, values.shape[1])
        for part in _token_chunks(num_tokens, per_token * values.shape[1]):
            rows = values[indices[part]].float()  # (chunk, L, D)
            out[part] = torch.bmm(weights[part].float().unsqueeze(1), rows).squeeze(1).to(values.dtype)
    if counts is not None:
        ones = torch.ones_like(indices) if valid is None else valid.to(torch.int64).unsqueeze(1).expand_as(indices)
        counts.index_put_((indices.flatten(),), ones.flatten(), accumulate=True)
    return out


def gather_backward_weights(grad_out, values, indices):
    num_tokens, per_token = indices.shape
    dtype = _accumulation_dtype(values.dtype)
    grad_weights = torch.empty(indices.shape, dtype=dtype, device=values.device)
    for part in _token_chunks(num_tokens, per_token * values.shape[1]):
        rows = values[indices[part]].to(dtype)  # (chunk, L, D)
        grad_weights[part] = torch.bmm(rows, grad_out[part].to(dtype).unsqueeze(-1)).squeeze(-1)
    return grad_weights


def row_to_slot_map(update_rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(num_rows,) int64 map: slot t for row update_rows[t], -1 for every other row."""
    slots = torch.full((num_rows,), -1, dtype=torch.int64, device=update_rows.device)
    slots[update_rows] = torch.arange(update_rows.numel(), device=update_rows.device)
    return slots


def gather_backward_values(grad_out, indices, weights, num_rows, update_rows, deterministic):
    # index_put_(accumulate=True) is deterministic on every device when
    # torch.use_deterministic_algorithms(True) is set, so one path serves both.
    num_tokens, per_token = indices.shape
    dim = grad_out.shape[1]
    dtype = _accumulation_dtype(grad_out.dtype)
    slots = None if update_rows is None else row_to_slot_map(update_rows, num_rows)
    out_rows = num_rows if slots is None else update_rows.numel()
    # Sparse: reads of unselected rows land in one scratch row past the end,
    # dropped on return (a mask would need a host sync).
    grad = torch.zeros(out_rows + (slots is not None), dim, dtype=dtype, device=grad_out.device)
    for part in _token_chunks(num_tokens, per_token * dim):
        contrib = weights[part].to(dtype).unsqueeze(-1) * grad_out[part].to(dtype).unsqueeze(1)  # (chunk, L, D)
        targets = indices[part].flatten()
        if slots is not None:
            targets = slots[targets]
            targets = torch.where(targets >= 0, targets, out_rows)
        grad.index_put_((targets,), contrib.reshape(-1, dim), accumulate=True)
    return grad[:out_rows]
