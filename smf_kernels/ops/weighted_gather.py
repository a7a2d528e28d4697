"""Weighted gather with read histogram (docs/method.md#the-memory-layer steps 5-6 and read counts) and its
dense or sink backward: the custom ops of :mod:`smf_kernels.ops._gather_ops` tied together by an
autograd.Function (torch.library attaches no autograd to the mutating counting op; torch.compile traces the
Function without graph breaks).
"""
from __future__ import annotations

import torch

from smf_kernels._checks import FLOAT_DTYPES, check_gather_args, check_same_device, check_tensor
from smf_kernels.backends import resolve_backend
from smf_kernels.ops import _gather_ops as gather_ops


class GradientSink:
    """Where a backward puts the value gradient instead of a ``.grad``: pass an instance as ``grad_sink`` and
    the gather's backward calls :meth:`backward` for the value gradient and the others
    (:class:`smf_kernels.sparse.RowGradSink` is the one the sparse update uses)."""

    def backward(self, grad_out: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                 gate: torch.Tensor | None, read: torch.Tensor | None, backend: str, deterministic: bool,
                 need_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the value gradient of this backward (grad_out: the gather's output gradient (N, D); read: the
        ungated read, with a gate) and return (grad_weights (N, L), 0 rows if not needed; grad_gate, empty
        without a gate), as :func:`smf_kernels.ops._gather_ops.backward` does."""
        raise NotImplementedError

    def before_forward(self, with_grad: bool) -> None:
        """Called by :func:`weighted_gather` (eager, not under torch.compile) before a forward through this sink;
        ``with_grad``: its backward will reach the sink. A sink refuses here a forward its step cannot take
        (:class:`smf_kernels.sparse.RowGradSink`); this one takes every forward."""


class _WeightedGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, indices, weights, counts, valid, grad_sink, gate, backend):
        ctx.sink = grad_sink
        ctx.backend = backend
        if counts is None:
            out, read = gather_ops.forward(values, indices, weights, gate, backend)
        else:
            out, read = gather_ops.forward_counted(values, indices, weights, counts, valid, gate, backend)
        ctx.save_for_backward(values, indices, weights, gate, read if gate is not None else None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        values, indices, weights, gate, read = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        need_values, need_weights = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        deterministic = torch.are_deterministic_algorithms_enabled()
        grad_values = None
        if ctx.sink is not None and need_values:  # no .grad: the sink takes the value gradient
            grad_weights, grad_gate = ctx.sink.backward(grad_out, values, indices, weights, gate, read, ctx.backend,
                                                        deterministic, need_weights)
        else:
            dense, grad_weights, grad_gate, _ = gather_ops.backward(
                grad_out, values, indices, weights, None, gate, read, ctx.backend, deterministic, need_values,
                need_weights, False)
            grad_values = dense.to(values.dtype) if need_values else None
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
    grad_sink: GradientSink | None = None,
    gate: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``out[n] = sum_l weights[n, l] * values[indices[n, l]]``, with a read histogram.

    Args:
        values: (M, D) float tensor (any D; accumulation is fp32).
        indices: (N, L) int64 rows in [0, M).
        weights: (N, L) float tensor.
        counts: optional (M,) int64; every (token, slot) read of a valid token adds 1 to ``counts[slot]`` in
            place, in the same pass as the gather.
        valid: optional (N,) bool; tokens with ``valid[n] == False`` (padding) are computed but not counted
            (needs ``counts``).
        grad_sink: optional :class:`GradientSink` (:class:`smf_kernels.sparse.RowGradSink`: the (T, D) gradient
            of a step's selected rows) that takes the value gradient; ``values`` then gets none through autograd.
            Default: a dense gradient.
        gate: optional (N, D) float tensor, the memory layer's gate: the result is then ``silu(gate) * out`` in
            gate's dtype, in the same op calls (:func:`smf_kernels.ops.silu_mul`); differentiable w.r.t. gate.
        backend: "torch", "triton", "ext" or None (see :mod:`smf_kernels.backends`).

    Returns:
        (N, D) tensor in values' dtype (gate's with a gate); differentiable w.r.t. values and weights.
    """
    if grad_sink is not None and not isinstance(grad_sink, GradientSink):
        raise TypeError(f"grad_sink must be a GradientSink or None, got {type(grad_sink).__name__}")
    check_gather_args(values, indices, weights, counts, valid, None)
    if gate is not None:
        check_tensor("gate", gate, ndim=2, dtypes=FLOAT_DTYPES, shape_doc="(N, D)")
        if gate.shape != (indices.shape[0], values.shape[1]):
            raise ValueError(f"gate must have shape (N, D) = {(indices.shape[0], values.shape[1])}, "
                             f"got {tuple(gate.shape)}")
        check_same_device("values", values, gate=gate)
        gate = gate.contiguous()
    name = resolve_backend(backend, values.device, torch.promote_types(values.dtype, weights.dtype))
    # The backends get the (N, L) and (N,) inputs contiguous whatever the caller's layout (a strided view such as
    # indices[:, ::2], an expanded one): these are small, and ATen's embedding_bag backward, among others, refuses
    # strided indices. values (M, D) and counts (M,), written in place, keep their layout.
    indices, weights = indices.contiguous(), weights.contiguous()
    valid = None if valid is None else valid.contiguous()
    if grad_sink is not None and not torch.compiler.is_compiling():  # a compiled step is planned whole (plan_fill)
        grad_sink.before_forward(torch.is_grad_enabled() and values.requires_grad)
    return _WeightedGather.apply(values, indices, weights, counts, valid, grad_sink, gate, name)
