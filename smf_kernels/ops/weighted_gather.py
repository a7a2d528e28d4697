"""Weighted gather with read histogram (docs/method.md#the-memory-layer steps 5 and read counts) and its
dense / row-sparse backward, as custom ops tied together by an autograd.Function.

The forward op mutates ``counts``; torch.library does not attach autograd to
mutating ops, so the autograd.Function below wraps the custom ops (torch.compile
traces it without graph breaks).
"""
from __future__ import annotations

import torch

from smf_kernels._checks import check_gather_args, check_gather_values, check_tensor
from smf_kernels._precision import accumulation_dtype, no_autocast
from smf_kernels.backends import implementation, resolve_backend


@torch.library.custom_op("smf_kernels::weighted_gather_forward", mutates_args=())
def _forward(
    values: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, backend: str
) -> torch.Tensor:
    """The gather without a read histogram (a pure op: Inductor can schedule it freely)."""
    check_gather_values(values.shape[0], indices)
    with no_autocast(values.device):
        return implementation(backend).gather_forward(values, indices, weights, None, None)


@_forward.register_fake
def _(values, indices, weights, backend):
    return values.new_empty(indices.shape[0], values.shape[1])


# A separate op for counting: an op declaring a mutated argument that may be None is
# rejected by Inductor's functionalization, so the mutated ``counts`` is always a tensor here.
@torch.library.custom_op("smf_kernels::weighted_gather_forward_counted", mutates_args=("counts",))
def _forward_counted(
    values: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    counts: torch.Tensor,
    valid: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """The gather adding every read of a valid token to ``counts`` (M,) in place."""
    check_gather_values(values.shape[0], indices)
    with no_autocast(values.device):
        return implementation(backend).gather_forward(values, indices, weights, counts, valid)


@_forward_counted.register_fake
def _(values, indices, weights, counts, valid, backend):
    return values.new_empty(indices.shape[0], values.shape[1])


@torch.library.custom_op("smf_kernels::weighted_gather_backward", mutates_args=())
def _backward(
    grad_out: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    update_rows: torch.Tensor | None,
    backend: str,
    deterministic: bool,
    need_values: bool,
    need_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both gradients from one call, so a backend can produce them in one pass over grad_out.

    Returns (grad_values, grad_weights) in the accumulation dtype:
    grad_values (M, D) dense or (T, D) for update_rows (row t for update_rows[t]),
    grad_weights (N, L); a gradient not needed comes back with 0 rows.
    """
    check_gather_values(values.shape[0], update_rows=update_rows)
    with no_autocast(grad_out.device):
        return implementation(backend).gather_backward(
            grad_out, values, indices, weights, update_rows, deterministic, need_values, need_weights
        )


@_backward.register_fake
def _(grad_out, values, indices, weights, update_rows, backend, deterministic, need_values, need_weights):
    dtype = accumulation_dtype(values.dtype)
    rows = (values.shape[0] if update_rows is None else update_rows.shape[0]) if need_values else 0
    grad_values = grad_out.new_empty(rows, values.shape[1], dtype=dtype)
    grad_weights = grad_out.new_empty(indices.shape[0] if need_weights else 0, indices.shape[1], dtype=dtype)
    return grad_values, grad_weights


@torch.library.custom_op("smf_kernels::weighted_gather_backward_into", mutates_args=("sink",))
def _backward_into(
    grad_out: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    update_rows: torch.Tensor,
    sink: torch.Tensor,
    backend: str,
    deterministic: bool,
    need_weights: bool,
) -> torch.Tensor:
    """The backward with the (T, D) value gradient of rows ``update_rows`` added into ``sink`` in place;
    returns grad_weights (N, L) (0 rows if not needed)."""
    compact, grad_weights = _backward(grad_out, values, indices, weights, update_rows, backend, deterministic, True,
                                      need_weights)
    sink += compact
    return grad_weights


@_backward_into.register_fake
def _(grad_out, values, indices, weights, update_rows, sink, backend, deterministic, need_weights):
    return grad_out.new_empty(indices.shape[0] if need_weights else 0, indices.shape[1],
                              dtype=accumulation_dtype(values.dtype))


class DeferredRows:
    """The rows of a sparse value gradient, chosen after the forward and before the backward.

    Pass an instance as ``update_rows`` to :func:`weighted_gather`, then call
    :meth:`set` once the rows are known (e.g. selected from the read counts the
    forward produced). The backward reads them then, so it writes only the
    chosen rows. Backward before :meth:`set` raises RuntimeError.
    """

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None

    def set(self, rows: torch.Tensor) -> None:
        """rows: (T,) int64 distinct row ids."""
        if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype != torch.int64:
            raise ValueError("rows must be a 1-D int64 tensor of distinct row ids")
        self.rows = rows.sort().values


class CompactRows(DeferredRows):
    """:class:`DeferredRows` whose gradient stays compact: each backward adds the (T, D) gradient of the rows
    (float32; float64 for a float64 table) into :attr:`grad` in place, and the values get no ``.grad`` (no
    sparse COO tensor, nothing that torch.compile cannot trace). :meth:`set` may also mark rows ``valid``:
    a fixed-size selection padded with rows that must not move. After :meth:`apply_with` the backward instead
    hands the gradient straight to a :class:`~smf_kernels.sparse.RowSparseAdamW` (``step_rows``): the rows
    are updated inside the backward.
    """

    def __init__(self) -> None:
        super().__init__()
        self.grad: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self._optimizer = None
        self._applied = False

    def set(self, rows: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """rows: (T,) int64 distinct row ids; valid: optional (T,) bool, False for rows that must not move."""
        if valid is not None and (not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool
                                  or valid.shape != getattr(rows, "shape", None)):
            raise ValueError("valid must be a bool tensor of the shape of rows")
        super().set(rows)
        self.valid = None if valid is None else valid[torch.argsort(rows)]

    def rows_for_backward(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows (T,) ascending, valid (T,) bool or None) for the backward; RuntimeError if not chosen yet."""
        if self.rows is None:
            raise RuntimeError("update_rows is a CompactRows whose rows were not set before the backward")
        return self.rows, self.valid

    def apply_with(self, optimizer) -> None:
        """Let the backward update the rows with ``optimizer`` (a RowSparseAdamW holding the values) at once,
        instead of adding their gradient to :attr:`grad`. Only for a step of one backward: a second one
        raises (the rows moved already, and a later forward would have read the moved rows)."""
        self._optimizer = optimizer

    def _apply(self, values: torch.Tensor, rows: torch.Tensor, valid, compact: torch.Tensor) -> None:
        if self._applied:
            raise RuntimeError("the rows were updated by an earlier backward of this step (apply_with): a step "
                               "that updates in its backward has one micro-batch")
        self._optimizer.step_rows(values, rows, compact, valid=valid)
        self._applied = True


class ReadLog:
    """The value gradient deferred to the end of the step: pass an instance as ``update_rows`` to
    :func:`weighted_gather` and every backward computes only the weights' gradient, keeping its reads
    (grad_out, indices, weights) here; :meth:`rows_gradient` then sums the reads of the rows finally chosen.
    So no backward writes a value gradient, and rows can be chosen from every micro-batch's reads without
    running the forwards twice. The kept grad_out tensors are (N, D) per backward.
    """

    def __init__(self) -> None:
        self.reads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.backend: str | None = None

    def _keep(self, grad_out: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, backend: str) -> None:
        self.reads.append((grad_out, indices, weights))
        self.backend = backend

    def rows_gradient(self, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """(T, D) gradient of ``values`` rows ``rows`` ((T,) int64 ascending, distinct) over every kept read, in
        the accumulation dtype (float32; float64 for float64 values), summed in the order of the backwards."""
        total = torch.zeros(rows.numel(), values.shape[1], dtype=accumulation_dtype(values.dtype),
                            device=values.device)
        for grad_out, indices, weights in self.reads:
            compact, _ = _backward(grad_out, values.detach(), indices, weights, rows, self.backend,
                                   torch.are_deterministic_algorithms_enabled(), True, False)
            total += compact
        return total

    def clear(self) -> None:
        """Drop the kept reads."""
        self.reads.clear()


class _WeightedGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, indices, weights, counts, valid, update_rows, backend):
        ctx.deferred = update_rows if isinstance(update_rows, DeferredRows) else None
        ctx.log = update_rows if isinstance(update_rows, ReadLog) else None
        by_ctx = ctx.deferred is not None or ctx.log is not None
        ctx.save_for_backward(values, indices, weights, None if by_ctx else update_rows)
        ctx.backend = backend
        if counts is None:
            return _forward(values, indices, weights, backend)
        return _forward_counted(values, indices, weights, counts, valid, backend)

    @staticmethod
    def backward(ctx, grad_out):
        values, indices, weights, update_rows = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        need_values, need_weights = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        deterministic = torch.are_deterministic_algorithms_enabled()
        grad_values = grad_weights = None
        if isinstance(ctx.deferred, CompactRows) and need_values:  # no .grad: the rows' gradient is kept or applied
            rows, valid = ctx.deferred.rows_for_backward()
            check_gather_args(values, indices, weights, None, None, rows)  # its values: in the op
            if ctx.deferred._optimizer is not None:
                compact, grad_weights = _backward(grad_out, values, indices, weights, rows, ctx.backend,
                                                  deterministic, True, need_weights)
                ctx.deferred._apply(values, rows, valid, compact)
            else:
                if ctx.deferred.grad is None:
                    ctx.deferred.grad = grad_out.new_zeros(rows.shape[0], values.shape[1],
                                                           dtype=accumulation_dtype(values.dtype))
                grad_weights = _backward_into(grad_out, values, indices, weights, rows, ctx.deferred.grad,
                                              ctx.backend, deterministic, need_weights)
        else:
            if ctx.deferred is not None:
                update_rows = ctx.deferred.rows
                if update_rows is None:
                    raise RuntimeError("update_rows is a DeferredRows whose rows were not set before the backward")
                check_gather_args(values, indices, weights, None, None, update_rows)  # its values: in the op
            logged = ctx.log is not None
            compact, grad_weights = _backward(grad_out, values, indices, weights, update_rows, ctx.backend,
                                              deterministic, need_values and not logged, need_weights)
            if logged and need_values:
                ctx.log._keep(grad_out, indices, weights, ctx.backend)
            elif need_values:
                compact = compact.to(values.dtype)
                if update_rows is None:
                    grad_values = compact
                else:  # the nn.Embedding(sparse=True) convention: a COO tensor with T rows
                    grad_values = torch.sparse_coo_tensor(
                        update_rows.unsqueeze(0), compact, values.shape, is_coalesced=True, check_invariants=False
                    )
        grad_weights = grad_weights.to(weights.dtype) if need_weights else None
        return grad_values, None, grad_weights, None, None, None, None


def weighted_gather(
    values: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    *,
    counts: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    update_rows: torch.Tensor | DeferredRows | ReadLog | None = None,
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
        backend: "torch", "triton", "ext" or None (see :mod:`smf_kernels.backends`).

    Returns:
        (N, D) tensor in values' dtype; differentiable w.r.t. values and weights.
    """
    deferred = isinstance(update_rows, (DeferredRows, ReadLog))
    if update_rows is not None and not deferred:
        check_tensor("update_rows", update_rows, ndim=1, dtypes=(torch.int64,), shape_doc="(T,)")
        update_rows = update_rows.sort().values  # sorted once: checked for repeats, and the COO gradient is coalesced
    check_gather_args(values, indices, weights, counts, valid, None if deferred else update_rows)
    if update_rows is not None and not deferred and not torch.compiler.is_compiling():
        check_gather_values(values.shape[0], update_rows=update_rows)  # at the call, not only in the backward
    name = resolve_backend(backend, values.device, torch.promote_types(values.dtype, weights.dtype))
    return _WeightedGather.apply(values, indices, weights, counts, valid, update_rows, name)
