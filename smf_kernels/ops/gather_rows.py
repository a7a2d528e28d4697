"""What ``update_rows`` of :func:`smf_kernels.ops.weighted_gather` may be besides a tensor: rows chosen after the
forward (:class:`DeferredRows`), kept compact or applied by the backward (:class:`CompactRows`), or a value
gradient deferred past the backward (:class:`ReadLog`)."""
from __future__ import annotations

import torch

from smf_kernels._precision import accumulation_dtype
from smf_kernels.ops import _gather_ops as gather_ops


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

    def zero_grad(self, values: torch.Tensor, num_rows: int) -> None:
        """:attr:`grad` := a zero (num_rows, D) gradient of ``values``' rows, float32 (float64 for a float64
        table). Made before a compiled backward runs, so that the backward only adds into it."""
        self.grad = torch.zeros(num_rows, values.shape[1], dtype=accumulation_dtype(values.dtype),
                                device=values.device)

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
    (the gradient reaching the gather, indices, weights) here; :meth:`rows_gradient` then sums the reads of
    the rows finally chosen. So no backward writes a value gradient, and rows can be chosen from every
    micro-batch's reads without running the forwards twice. It keeps an (N, D) gradient per backward.
    """

    def __init__(self) -> None:
        self.reads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.backend: str | None = None

    def _keep(self, read_grad: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, backend: str) -> None:
        self.reads.append((read_grad, indices, weights))
        self.backend = backend

    def rows_gradient(self, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """(T, D) gradient of ``values`` rows ``rows`` ((T,) int64 ascending, distinct) over every kept read, in
        the accumulation dtype (float32; float64 for float64 values), summed in the order of the backwards."""
        total = torch.zeros(rows.numel(), values.shape[1], dtype=accumulation_dtype(values.dtype),
                            device=values.device)
        for read_grad, indices, weights in self.reads:
            compact, _, _, _ = gather_ops.backward(read_grad, values.detach(), indices, weights, rows, None, None,
                                                   self.backend, torch.are_deterministic_algorithms_enabled(), True,
                                                   False, False)
            total += compact
        return total

    def clear(self) -> None:
        """Drop the kept reads."""
        self.reads.clear()
