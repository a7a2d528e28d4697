"""Weighted gather with read histogram (docs/method.md#the-memory-layer steps 5-6 and read counts) and its
dense / row-sparse backward: the custom ops of :mod:`smf_kernels.ops._gather_ops` tied together by an
autograd.Function.

The counting forward op mutates ``counts``; torch.library does not attach autograd to mutating ops, so the
autograd.Function below wraps the custom ops (torch.compile traces it without graph breaks).
"""
from __future__ import annotations

import torch

from smf_kernels._checks import FLOAT_DTYPES, check_gather_args, check_gather_values, check_same_device, check_tensor
from smf_kernels.backends import resolve_backend
from smf_kernels.ops import _gather_ops as gather_ops
from smf_kernels.ops.gather_rows import CompactRows, DeferredRows, ReadLog


class _WeightedGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, indices, weights, counts, valid, update_rows, gate, backend):
        ctx.deferred = update_rows if isinstance(update_rows, DeferredRows) else None
        ctx.log = update_rows if isinstance(update_rows, ReadLog) else None
        by_ctx = ctx.deferred is not None or ctx.log is not None
        ctx.backend = backend
        if counts is None:
            out, read = gather_ops.forward(values, indices, weights, gate, backend)
        else:
            out, read = gather_ops.forward_counted(values, indices, weights, counts, valid, gate, backend)
        ctx.save_for_backward(values, indices, weights, None if by_ctx else update_rows, gate,
                              read if gate is not None else None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        values, indices, weights, update_rows, gate, read = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        need_values, need_weights = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        deterministic = torch.are_deterministic_algorithms_enabled()
        grad_values = None
        if isinstance(ctx.deferred, CompactRows) and need_values:  # no .grad: the rows' gradient is kept or applied
            rows, valid = ctx.deferred.rows_for_backward()
            check_gather_args(values, indices, weights, None, None, rows)  # its values: in the op
            if ctx.deferred._optimizer is not None:
                compact, grad_weights, grad_gate, _ = gather_ops.backward(
                    grad_out, values, indices, weights, rows, gate, read, ctx.backend, deterministic, True,
                    need_weights, False)
                ctx.deferred._apply(values, rows, valid, compact)
            else:
                if ctx.deferred.grad is None:
                    ctx.deferred.zero_grad(values, rows.shape[0])
                grad_weights, grad_gate = gather_ops.backward_into(
                    grad_out, values, indices, weights, rows, ctx.deferred.grad, gate, read, ctx.backend,
                    deterministic, need_weights)
        else:
            if ctx.deferred is not None:
                update_rows = ctx.deferred.rows
                if update_rows is None:
                    raise RuntimeError("update_rows is a DeferredRows whose rows were not set before the backward")
                check_gather_args(values, indices, weights, None, None, update_rows)  # its values: in the op
            logged = ctx.log is not None and need_values
            compact, grad_weights, grad_gate, read_grad = gather_ops.backward(
                grad_out, values, indices, weights, update_rows, gate, read, ctx.backend, deterministic,
                need_values and not logged, need_weights, logged)
            if logged:
                ctx.log._keep(read_grad if gate is not None else grad_out, indices, weights, ctx.backend)
            elif need_values:
                compact = compact.to(values.dtype)
                if update_rows is None:
                    grad_values = compact
                else:  # the nn.Embedding(sparse=True) convention: a COO tensor with T rows
                    grad_values = torch.sparse_coo_tensor(
                        update_rows.unsqueeze(0), compact, values.shape, is_coalesced=True, check_invariants=False
                    )
        grad_weights = grad_weights.to(weights.dtype) if need_weights else None
        grad_gate = grad_gate if gate is not None and ctx.needs_input_grad[6] else None
        return grad_values, None, grad_weights, None, None, None, grad_gate, None


def weighted_gather(
    values: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    *,
    counts: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    update_rows: torch.Tensor | DeferredRows | ReadLog | None = None,
    gate: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``out[n] = sum_l weights[n, l] * values[indices[n, l]]``, with a read histogram.

    Args:
        values: (M, D) float tensor (any D; accumulation is fp32).
        indices: (N, L) int64 rows in [0, M).
        weights: (N, L) float tensor.
        counts: optional (M,) int64; every (token, slot) read of a valid token
            adds 1 to ``counts[slot]`` in place, in the same pass as the gather.
        valid: optional (N,) bool; tokens with ``valid[n] == False`` (padding)
            are computed but not counted. Requires ``counts``.
        update_rows: optional (T,) int64 distinct rows. When given, the gradient
            w.r.t. ``values`` is a sparse COO tensor holding only these rows
            (sorted ascending; reads of other rows get no gradient), and no dense
            (M, D) buffer is allocated. Without it the gradient is dense. A
            :class:`DeferredRows` instead lets the rows be chosen after the forward
            (a :class:`CompactRows` keeps their gradient compact, or applies it), and
            a :class:`ReadLog` defers the value gradient past the backward.
        gate: optional (N, D) float tensor: the memory layer's gate. The result is then
            ``silu(gate) * out`` in gate's dtype, in the same op calls (the gated read,
            :func:`smf_kernels.ops.silu_mul`); differentiable w.r.t. gate too.
        backend: "torch", "triton", "ext" or None (see :mod:`smf_kernels.backends`).

    Returns:
        (N, D) tensor in values' dtype (gate's with a gate); differentiable w.r.t. values and weights.
    """
    deferred = isinstance(update_rows, (DeferredRows, ReadLog))
    if update_rows is not None and not deferred:
        check_tensor("update_rows", update_rows, ndim=1, dtypes=(torch.int64,), shape_doc="(T,)")
        update_rows = update_rows.sort().values  # sorted once: checked for repeats, and the COO gradient is coalesced
    check_gather_args(values, indices, weights, counts, valid, None if deferred else update_rows)
    if gate is not None:
        check_tensor("gate", gate, ndim=2, dtypes=FLOAT_DTYPES, shape_doc="(N, D)")
        if gate.shape != (indices.shape[0], values.shape[1]):
            raise ValueError(f"gate must have shape (N, D) = {(indices.shape[0], values.shape[1])}, "
                             f"got {tuple(gate.shape)}")
        check_same_device("values", values, gate=gate)
        gate = gate.contiguous()
    if update_rows is not None and not deferred and not torch.compiler.is_compiling():
        check_gather_values(values.shape[0], update_rows=update_rows)  # at the call, not only in the backward
    name = resolve_backend(backend, values.device, torch.promote_types(values.dtype, weights.dtype))
    # The backends get the (N, L) and (N,) inputs contiguous whatever the caller's layout (a strided view such as
    # indices[:, ::2], an expanded one): these are small, and ATen's embedding_bag backward, among others, refuses
    # strided indices. values (M, D) and counts (M,), written in place, keep their layout.
    indices, weights = indices.contiguous(), weights.contiguous()
    valid = None if valid is None else valid.contiguous()
    return _WeightedGather.apply(values, indices, weights, counts, valid, update_rows, gate, name)
