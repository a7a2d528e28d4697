"""The custom ops behind :func:`smf_kernels.ops.weighted_gather`: the gather (optionally gated, optionally counting
reads) and its backward (dense, T rows, or T rows added into a buffer), each one op call for the host.

A gate ``(N, D)`` folds the memory layer's ``silu(gate) * read`` (docs/method.md#the-memory-layer, step 6) into the
same calls: the forward returns ``(silu(gate) * read, read)`` (read kept for the backward) and the backward starts
from the gated output's gradient. So a memory layer makes two op calls each way (top-k and this), not three.
Counting has its own op because an op declaring a mutated argument that may be None is rejected by Inductor's
functionalization (the mutated ``counts`` is always a tensor there).
"""
from __future__ import annotations

import torch

from smf_kernels._checks import check_gather_values
from smf_kernels._precision import accumulation_dtype, no_autocast
from smf_kernels.backends import implementation
from smf_kernels.ops.silu_mul import silu_mul_backward, silu_mul_forward


def _kernels_guard(values: torch.Tensor, backend: str) -> bool:
    """Whether ``backend``'s kernels check ids and rows themselves on values' device (the triton backend on CUDA:
    a bad one raises at the next sync there, without the host check's min, max, compare and assertion kernels)."""
    return values.device.type == "cuda" and getattr(implementation(backend), "KERNELS_GUARD_INDICES", False)


def _check_ids(values: torch.Tensor, indices: torch.Tensor, backend: str) -> None:
    """The ids' range, unless the backend's kernels guard every access through them (:func:`_kernels_guard`)."""
    if not _kernels_guard(values, backend):
        check_gather_values(values.shape[0], indices)


def _gated(read: torch.Tensor, gate: torch.Tensor | None, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    if gate is None:
        return read, read.new_empty(0)  # an op's two outputs may not be one tensor
    return silu_mul_forward(gate, read.to(gate.dtype), backend), read


def _fake_outputs(values, indices, gate):
    out = values.new_empty(indices.shape[0], values.shape[1], dtype=values.dtype if gate is None else gate.dtype)
    return out, values.new_empty(0) if gate is None else values.new_empty(indices.shape[0], values.shape[1])


@torch.library.custom_op("smf_kernels::weighted_gather_forward", mutates_args=())
def forward(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor | None,
            backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, read): the gather without a read histogram (a pure op: Inductor can schedule it freely);
    out = silu(gate) * read in gate's dtype when a gate is given, else out = read and the second output is empty."""
    _check_ids(values, indices, backend)
    with no_autocast(values.device):
        return _gated(implementation(backend).gather_forward(values, indices, weights, None, None), gate, backend)


@forward.register_fake
def _(values, indices, weights, gate, backend):
    return _fake_outputs(values, indices, gate)


@torch.library.custom_op("smf_kernels::weighted_gather_forward_counted", mutates_args=("counts",))
def forward_counted(values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                    valid: torch.Tensor | None, gate: torch.Tensor | None,
                    backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward`, adding every read of a valid token to ``counts`` (M,) in place."""
    _check_ids(values, indices, backend)
    with no_autocast(values.device):
        read = implementation(backend).gather_forward(values, indices, weights, counts, valid)
        return _gated(read, gate, backend)


@forward_counted.register_fake
def _(values, indices, weights, counts, valid, gate, backend):
    return _fake_outputs(values, indices, gate)


def _ungated(grad_out, gate, read, values, backend):
    """(gradient reaching the gather (N, D) in values' dtype, grad of gate or an empty tensor)."""
    if gate is None:
        return grad_out, grad_out.new_empty(0)
    grad_gate, grad_read = silu_mul_backward(grad_out, gate, read.to(gate.dtype), backend)
    return grad_read.to(values.dtype), grad_gate


@torch.library.custom_op("smf_kernels::weighted_gather_backward", mutates_args=())
def backward(
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
    if not _kernels_guard(values, backend):  # the triton backward checks update_rows as it maps them to slots
        check_gather_values(values.shape[0], update_rows=update_rows)
    with no_autocast(grad_out.device):
        read_grad, grad_gate = _ungated(grad_out, gate, read, values, backend)
        grad_values, grad_weights = implementation(backend).gather_backward(
            read_grad, values, indices, weights, update_rows, deterministic, need_values, need_weights)
    return grad_values, grad_weights, grad_gate, read_grad if gate is not None and keep_read_grad \
        else grad_out.new_empty(0)


def _fake_grads(grad_out, values, indices, gate, need_weights):
    dtype = accumulation_dtype(values.dtype)
    grad_weights = grad_out.new_empty(indices.shape[0] if need_weights else 0, indices.shape[1], dtype=dtype)
    return grad_weights, grad_out.new_empty(0) if gate is None else torch.empty_like(gate)


@backward.register_fake
def _(grad_out, values, indices, weights, update_rows, gate, read, backend, deterministic, need_values, need_weights,
      keep_read_grad):
    dtype = accumulation_dtype(values.dtype)
    rows = (values.shape[0] if update_rows is None else update_rows.shape[0]) if need_values else 0
    grad_weights, grad_gate = _fake_grads(grad_out, values, indices, gate, need_weights)
    read_grad = grad_out.new_empty(indices.shape[0], values.shape[1], dtype=values.dtype) \
        if gate is not None and keep_read_grad else grad_out.new_empty(0)
    return grad_out.new_empty(rows, values.shape[1], dtype=dtype), grad_weights, grad_gate, read_grad


@torch.library.custom_op("smf_kernels::weighted_gather_backward_into", mutates_args=("sink",))
def backward_into(
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
    returns (grad_weights (N, L), 0 rows if not needed; grad_gate, empty without a gate). A backend with a
    ``gather_backward_into`` (triton) adds in its kernel's epilogue, the same fp32 adds as ``sink += compact``."""
    module = implementation(backend)
    if not (hasattr(module, "gather_backward_into") and sink.is_contiguous() and sink.dtype == torch.float32):
        compact, grad_weights, grad_gate, _ = backward(grad_out, values, indices, weights, update_rows, gate, read,
                                                       backend, deterministic, True, need_weights, False)
        sink += compact
        return grad_weights, grad_gate
    if not _kernels_guard(values, backend):
        check_gather_values(values.shape[0], update_rows=update_rows)
    with no_autocast(grad_out.device):
        read_grad, grad_gate = _ungated(grad_out, gate, read, values, backend)
        grad_weights = module.gather_backward_into(read_grad, values, indices, weights, update_rows, sink,
                                                   need_weights)
    return grad_weights, grad_gate


@backward_into.register_fake
def _(grad_out, values, indices, weights, update_rows, sink, gate, read, backend, deterministic, need_weights):
    return _fake_grads(grad_out, values, indices, gate, need_weights)
