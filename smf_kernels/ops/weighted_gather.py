"""Weighted gather with read histogram (docs/method.md#the-memory-layer steps 5-6 and read counts) and its
dense or sink backward, in one file: the custom ops (the gather, optionally gated, optionally counting reads, and its
backward: dense, T rows, or T rows added into a buffer; each one op call for the host), the autograd.Function that
ties them together (torch.library attaches no autograd to the mutating counting op; torch.compile traces the
Function without graph breaks), and :func:`weighted_gather`. A gradient sink (:class:`GradientSink`) takes the value
gradient through :func:`gather_backward` / :func:`gather_backward_into`.

A gate ``(N, D)`` folds the memory layer's ``silu(gate) * read`` (docs/method.md#the-memory-layer, step 6) into the
same calls: the forward returns ``(silu(gate) * read, read)`` (read kept for the backward) and the backward starts
from the gated output's gradient. So a memory layer makes two op calls each way (top-k and this), not three.
Counting has its own op because an op declaring a mutated argument that may be None is rejected by Inductor's
functionalization (the mutated ``counts`` is always a tensor there).
"""
from __future__ import annotations

import torch

from smf_kernels._checks import FLOAT_DTYPES, check_gather_args, check_gather_values, check_same_device, check_tensor
from smf_kernels._precision import accumulation_dtype, no_autocast
from smf_kernels.backends import Backend, implementation, resolve_backend


def _check_ids(values: torch.Tensor, backend: Backend, indices: torch.Tensor | None = None,
               update_rows: torch.Tensor | None = None) -> None:
    """The range of the ids (and of update_rows, with their distinctness), unless ``backend``'s kernels check every
    access through them on values' device (the triton backend on CUDA: a bad one raises at the next sync there,
    without the host check's min, max, compare and assertion kernels)."""
    if not (values.device.type == "cuda" and backend.kernels_guard_indices):
        check_gather_values(values.shape[0], indices, update_rows=update_rows)


def _gated(read: torch.Tensor, gate: torch.Tensor | None, backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
    if gate is None:
        return read, read.new_empty(0)  # an op's two outputs may not be one tensor
    return backend.silu_mul_forward(gate, read.to(gate.dtype)), read


def _fake_outputs(values, indices, gate):
    out = values.new_empty(indices.shape[0], values.shape[1], dtype=values.dtype if gate is None else gate.dtype)
    return out, values.new_empty(0) if gate is None else values.new_empty(indices.shape[0], values.shape[1])


@torch.library.custom_op("smf_kernels::weighted_gather_forward", mutates_args=())
def gather_forward(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor | None,
            backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, read): the gather without a read histogram (a pure op: Inductor can schedule it freely);
    out = silu(gate) * read in gate's dtype when a gate is given, else out = read and the second output is empty."""
    impl = implementation(backend)
    _check_ids(values, impl, indices)
    with no_autocast(values.device):
        return _gated(impl.gather_forward(values, indices, weights, None, None), gate, impl)


@gather_forward.register_fake
def _(values, indices, weights, gate, backend):
    return _fake_outputs(values, indices, gate)


@torch.library.custom_op("smf_kernels::weighted_gather_forward_counted", mutates_args=("counts",))
def gather_forward_counted(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                    valid: torch.Tensor | None, gate: torch.Tensor | None,
                    backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward`, adding every read of a valid token to ``counts`` (M,) in place."""
    impl = implementation(backend)
    _check_ids(values, impl, indices)
    with no_autocast(values.device):
        return _gated(impl.gather_forward(values, indices, weights, counts, valid), gate, impl)


@gather_forward_counted.register_fake
def _(values, indices, weights, counts, valid, gate, backend):
    return _fake_outputs(values, indices, gate)


def _ungated(grad_out, gate, read, values, backend: Backend):
    """(gradient reaching the gather (N, D) in values' dtype, grad of gate or an empty tensor); under no_autocast."""
    if gate is None:
        return grad_out, grad_out.new_empty(0)
    grad_gate, grad_read = backend.silu_mul_backward(grad_out, gate, read.to(gate.dtype))
    return grad_read.to(values.dtype), grad_gate


@torch.library.custom_op("smf_kernels::weighted_gather_backward", mutates_args=())
def gather_backward(
    grad_out: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    update_rows: torch.Tensor | None,
    gate: torch.Tensor | None,
    read: torch.Tensor | None,
    backend: str,
    deterministic: bool,
    need_values: bool,
    need_weights: bool,
    keep_read_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every gradient from one call, so a backend can produce them in one pass over grad_out.

    grad_out is the gradient of the forward's ``out``. Returns (grad_values, grad_weights, grad_gate,
    read_grad): grad_values (M, D) dense or (T, D) for update_rows (row t for update_rows[t]) and grad_weights
    (N, L) in the accumulation dtype, a gradient not needed with 0 rows; grad_gate (N, D) in gate's dtype
    (empty without a gate); read_grad, the gradient reaching the gather (N, D) in values' dtype, when a gate
    is given and ``keep_read_grad`` (what a RowGradSink keeping reads keeps), else empty.
    """
    impl = implementation(backend)
    _check_ids(values, impl, update_rows=update_rows)  # the triton kernels: as they map rows to slots
    with no_autocast(grad_out.device):
        read_grad, grad_gate = _ungated(grad_out, gate, read, values, impl)
        grad_values, grad_weights = impl.gather_backward(
            read_grad, values, indices, weights, update_rows, deterministic, need_values, need_weights)
    return grad_values, grad_weights, grad_gate, read_grad if gate is not None and keep_read_grad \
        else grad_out.new_empty(0)


def _fake_grads(grad_out, values, indices, gate, need_weights):
    dtype = accumulation_dtype(values.dtype)
    grad_weights = grad_out.new_empty(indices.shape[0] if need_weights else 0, indices.shape[1], dtype=dtype)
    return grad_weights, grad_out.new_empty(0) if gate is None else torch.empty_like(gate)


@gather_backward.register_fake
def _(grad_out, values, indices, weights, update_rows, gate, read, backend, deterministic, need_values, need_weights,
      keep_read_grad):
    dtype = accumulation_dtype(values.dtype)
    rows = (values.shape[0] if update_rows is None else update_rows.shape[0]) if need_values else 0
    grad_weights, grad_gate = _fake_grads(grad_out, values, indices, gate, need_weights)
    read_grad = grad_out.new_empty(indices.shape[0], values.shape[1], dtype=values.dtype) \
        if gate is not None and keep_read_grad else grad_out.new_empty(0)
    return grad_out.new_empty(rows, values.shape[1], dtype=dtype), grad_weights, grad_gate, read_grad


@torch.library.custom_op("smf_kernels::weighted_gather_backward_into", mutates_args=("sink",))
def gather_backward_into(
    grad_out: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    update_rows: torch.Tensor,
    sink: torch.Tensor,
    gate: torch.Tensor | None,
    read: torch.Tensor | None,
    backend: str,
    deterministic: bool,
    need_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`backward` with the (T, D) value gradient of rows ``update_rows`` added into ``sink`` in place;
    returns (grad_weights (N, L), 0 rows if not needed; grad_gate, empty without a gate). The backend adds as
    ``sink += compact`` does (the triton one in its kernel's epilogue, without the (T, D) buffer)."""
    impl = implementation(backend)
    _check_ids(values, impl, update_rows=update_rows)
    with no_autocast(grad_out.device):
        read_grad, grad_gate = _ungated(grad_out, gate, read, values, impl)
        grad_weights = impl.gather_backward_into(read_grad, values, indices, weights, update_rows, sink,
                                                 deterministic, need_weights)
    return grad_weights, grad_gate


@gather_backward_into.register_fake
def _(grad_out, values, indices, weights, update_rows, sink, gate, read, backend, deterministic, need_weights):
    return _fake_grads(grad_out, values, indices, gate, need_weights)


class GradientSink:
    """Where a backward puts the value gradient instead of a ``.grad``: pass an instance as ``grad_sink`` and
    the gather's backward calls :meth:`backward` for the value gradient and the others
    (:class:`smf_kernels.sparse.RowGradSink` is the one the sparse update uses)."""

    def backward(self, grad_out: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                 gate: torch.Tensor | None, read: torch.Tensor | None, backend: str, deterministic: bool,
                 need_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the value gradient of this backward (grad_out: the gather's output gradient (N, D); read: the
        ungated read, with a gate) and return (grad_weights (N, L), 0 rows if not needed; grad_gate, empty
        without a gate), as :func:`gather_backward` does."""
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
            out, read = gather_forward(values, indices, weights, gate, backend)
        else:
            out, read = gather_forward_counted(values, indices, weights, counts, valid, gate, backend)
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
            dense, grad_weights, grad_gate, _ = gather_backward(
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
