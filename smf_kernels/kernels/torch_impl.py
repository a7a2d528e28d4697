"""The ``torch`` backend: plain PyTorch on any device, memory-bounded by chunking.

Same semantics as :mod:`smf_kernels.reference`, but without autograd and with
the (N, L, D) gathered-row tensors built a chunk of tokens at a time.
"""
from __future__ import annotations

import sys

import warnings

import torch

from smf_kernels.kernels import backward_in_two_passes
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


def _reads_a_row_twice(indices: torch.Tensor) -> bool:
    """Whether some token (row of indices (N, L)) holds one row id more than once."""
    if indices.shape[1] < 2:
        return False
    ordered = indices.sort(dim=1).values
    return bool((ordered[:, 1:] == ordered[:, :-1]).any())


def gather_backward_weights(grad_out, values, indices):
    """grad_w[n, l] = values[indices[n, l]] . grad_out[n].

    CPU: one sampled dense-dense product (SDDMM) over the (N, M) read pattern:
    each entry is its own dot product (deterministic), and the (N, L, D) gathered
    rows are never materialised. The CSR pattern cannot hold one (token, row) pair
    twice, so where a token reads a row more than once (heads share the value table),
    and elsewhere than on CPU: gathered rows times grad_out, a chunk of tokens at a time.
    """
    num_tokens, per_token = indices.shape
    dtype = _accumulation_dtype(values.dtype)
    if values.device.type == "cpu" and not _reads_a_row_twice(indices):
        crow = torch.arange(0, num_tokens * per_token + 1, per_token)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            pattern = torch.sparse_csr_tensor(crow, indices.reshape(-1), torch.zeros(indices.numel(), dtype=dtype),
                                              (num_tokens, values.shape[0]), check_invariants=False)
            sampled = torch.sparse.sampled_addmm(pattern, grad_out.to(dtype), values.to(dtype).t())
        return sampled.values().view(num_tokens, per_token)
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


def _sum_reads_by_target(grad_out, weights, targets, out_rows):
    """fp32 (out_rows, D): row t = sum of w[n, l] * grad_out[n] over reads with targets[n * L + l] == t.

    CPU: one CSR (out_rows, N) x (N, D) product, computed row by row, hence
    deterministic. Elsewhere: index_put_(accumulate=True), deterministic under
    torch.use_deterministic_algorithms(True).
    """
    num_tokens, per_token = weights.shape
    dim = grad_out.shape[1]
    grad_out = grad_out.to(_accumulation_dtype(grad_out.dtype))
    flat_weights = weights.reshape(-1).to(grad_out.dtype)
    if grad_out.device.type == "cpu":
        order = targets.argsort(stable=True)
        crow = torch.zeros(out_rows + 1, dtype=torch.int64)
        crow[1:] = torch.bincount(targets, minlength=out_rows).cumsum(0)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            reads = torch.sparse_csr_tensor(crow, torch.div(order, per_token, rounding_mode="floor"),
                                            flat_weights[order], (out_rows, num_tokens), check_invariants=False)
        return reads @ grad_out
    grad = torch.zeros(out_rows, dim, dtype=grad_out.dtype, device=grad_out.device)
    targets = targets.view(num_tokens, per_token)
    for part in _token_chunks(num_tokens, per_token * dim):
        contrib = flat_weights.view(num_tokens, per_token)[part].unsqueeze(-1) * grad_out[part].unsqueeze(1)
        grad.index_put_((targets[part].flatten(),), contrib.reshape(-1, dim), accumulate=True)
    return grad


def gather_backward_values(grad_out, indices, weights, num_rows, update_rows, deterministic):
    targets = indices.reshape(-1)
    if update_rows is None:
        return _sum_reads_by_target(grad_out, weights, targets, num_rows)
    # Sparse: reads of unselected rows land in one scratch row past the end,
    # dropped on return (a mask would need a host sync on accelerators).
    selected = update_rows.numel()
    slots = row_to_slot_map(update_rows, num_rows)[targets]
    targets = torch.where(slots >= 0, slots, selected)
    return _sum_reads_by_target(grad_out, weights, targets, selected + 1)[:selected]


def gather_backward(grad_out, values, indices, weights, update_rows, deterministic, need_values, need_weights):
    return backward_in_two_passes(sys.modules[__name__], grad_out, values, indices, weights, update_rows,
                                  deterministic, need_values, need_weights)
