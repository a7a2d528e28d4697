"""RowGradSink: where a step's backwards put the gradient of one value table's selected rows, instead of a ``.grad``.

Each memory's backward writes the gradient of the step's T selected rows into one compact (T, D) float32 tensor
(float64 for a float64 table) that :meth:`RowSparseAdamW.step_rows <smf_kernels.sparse.RowSparseAdamW.step_rows>`
reads (as FBGEMM's sparse optimizers read compact rows). Filled one of the step's two fills
(:data:`FILLS`; which one a step uses: :func:`smf_kernels.sparse.fill_plan.plan_fill`):

- **rows first** (``fill="rows_first"``): the rows are known before the first backward: set between the
  forwards and the first backward (:meth:`set_rows`), or chosen by the first backward from this process's counts
  (``chooser``; no host sync, what torch.compile traces); each backward adds its rows' gradient into :attr:`grad`.
  Costs the (T, D) buffer.
- **reads kept** (``fill="reads_kept"``): each backward computes only the weights' gradient and keeps its reads
  (the gradient reaching the gather (N, D), slot ids and weights (N, L)); :meth:`sum_reads` sums the reads of the
  rows finally selected at the step's end. No second forward, but about N x (D x itemsize + 12 L) bytes per layer
  for the step's N tokens (docs/method.md#what-sparse-means).

Pass a sink as ``grad_sink`` to :func:`smf_kernels.ops.weighted_gather` (or ``set_grad_sink`` on a memory);
:class:`~smf_kernels.sparse.SparseMemoryController` makes and reads them.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from smf_kernels._checks import check_gather_args
from smf_kernels._precision import accumulation_dtype
from smf_kernels.ops.weighted_gather import GradientSink, gather_backward, gather_backward_into
from smf_kernels.sparse.step_checks import StepMisuseError

Selection = tuple[torch.Tensor, torch.Tensor]  # rows (T,) int64 ascending, valid (T,) bool

# The two ways a step fills its rows' gradient (see the module docstring)
ROWS_FIRST, READS_KEPT = "rows_first", "reads_kept"
FILLS = (ROWS_FIRST, READS_KEPT)


def check_fill(fill: object) -> str:
    """``fill`` if it is one of :data:`FILLS`, else ValueError."""
    if fill not in FILLS:
        raise ValueError(f"fill must be one of {FILLS}, got {fill!r}")
    return fill


class RowGradSink(GradientSink):
    """The compact (T, D) gradient of T rows of one (M, D) value table over one step (see the module docstring).

    Args:
        values: the (M, D) table (a column shard's columns for a sharded memory).
        num_rows: T, the size of the selection (at most M).
        fill: "reads_kept": backwards keep their reads and :meth:`sum_reads` computes the gradient; "rows_first":
            the rows are known before the first backward, which adds into :attr:`grad`.
        chooser: "rows_first" only: returns (rows, valid) when a backward runs before :meth:`set_rows`.
    """

    def __init__(self, values: torch.Tensor, num_rows: int, *, fill: str,
                 chooser: Callable[[], Selection] | None = None) -> None:
        self.fill, self.chooser = check_fill(fill), chooser
        self.rows: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.reads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]] = []
        self.closed = False
        # eager forwards with grad so far, and how many of them the rows were chosen from (None: not chosen yet)
        self.grad_forwards, self.chosen_after = 0, None
        # True once a backward reached this table (a 0-d tensor: a compiled backward sets it with no host sync); a
        # step whose backwards never did moves none of its rows, as torch.optim leaves a parameter without .grad
        self.reached = torch.zeros((), dtype=torch.bool, device=values.device)
        # made now, before any backward, so that a compiled backward only adds into it
        self.grad = None if fill == READS_KEPT else torch.zeros(num_rows, values.shape[1],
                                                        dtype=accumulation_dtype(values.dtype), device=values.device)

    def set_rows(self, rows: torch.Tensor, valid: torch.Tensor) -> None:
        """The step's rows, before its first backward: rows (T,) int64 ascending distinct, valid (T,) bool (False
        for rows that pad the selection and must not move)."""
        if self.fill == READS_KEPT:
            raise RuntimeError("this sink keeps the reads: its rows are chosen at the step's end (sum_reads)")
        if rows.shape != (self.grad.shape[0],) or valid.shape != rows.shape:
            raise ValueError(f"rows and valid must have shape (T,) = ({self.grad.shape[0]},), got "
                             f"{tuple(rows.shape)} and {tuple(valid.shape)}")
        self.rows, self.valid = rows, valid
        self.chosen_after = self.grad_forwards

    def selection(self) -> Selection:
        """(rows, valid) of a sink whose rows are known before the backward: set, or chosen from the counts (by
        the first backward; eager, they are kept for the step's other backwards and its end)."""
        if self.rows is not None:
            return self.rows, self.valid
        if self.chooser is None:
            raise RuntimeError("the sink's rows were not set before the backward: call select_rows() between the "
                               "step's forwards and its first backward")
        if torch.compiler.is_compiling():  # one micro-batch (plan_fill): its backward chooses, the end again
            return self.chooser()
        self.set_rows(*self.chooser())
        return self.rows, self.valid

    def before_forward(self, with_grad: bool) -> None:
        """Refuses (:class:`~smf_kernels.sparse.step_checks.StepMisuseError`) a forward with grad of a rows-first
        step whose rows were already chosen from forwards with grad: its reads would count for nothing and its
        gradient would go to rows chosen without it (a counting forward of every micro-batch comes first)."""
        if self.fill != ROWS_FIRST or not with_grad:
            return
        if self.chosen_after:
            raise StepMisuseError(
                f"a forward after this rows_first step's rows were chosen from its first {self.chosen_after} "
                "micro-batch(es): its reads would not count; for several micro-batches plan the step "
                "(plan(micro_batches): a no-grad counting forward of each, then select_rows()) or use "
                "fill='reads_kept' (abort_step() drops this step)")
        self.grad_forwards += 1

    def backward(self, grad_out, values, indices, weights, gate, read, backend, deterministic, need_weights):
        if self.closed:
            raise RuntimeError("a backward of a memory forward run in a step that has ended (finish_step, end_step "
                               "or abort_step came before this backward): run every backward of a step before its "
                               "end, and drop graphs of aborted steps")
        self.reached.fill_(True)
        if self.fill == READS_KEPT:
            _, grad_weights, grad_gate, read_grad = gather_backward(
                grad_out, values, indices, weights, None, gate, read, backend, deterministic, False, need_weights,
                True)
            # kept without a graph (the saved weights require grad): their sum at the step's end builds none
            self.reads.append(((read_grad if gate is not None else grad_out).detach(), indices, weights.detach(),
                               backend))
            return grad_weights, grad_gate
        rows, _ = self.selection()
        check_gather_args(values, indices, weights, None, None, rows)  # its values: in the op
        return gather_backward_into(grad_out, values, indices, weights, rows, self.grad, gate, read, backend,
                                        deterministic, need_weights)

    @torch.no_grad()
    def sum_reads(self, values: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> None:
        """"reads_kept" only: :attr:`grad` := the (T, D) gradient of ``rows`` summed over the kept reads (in the
        order of the backwards), and the reads dropped."""
        grad = torch.zeros(rows.numel(), values.shape[1], dtype=accumulation_dtype(values.dtype),
                           device=values.device)
        for read_grad, indices, weights, backend in self.reads:
            compact, _, _, _ = gather_backward(read_grad, values.detach(), indices, weights, rows, None, None,
                                                   backend, torch.are_deterministic_algorithms_enabled(), True,
                                                   False, False)
            grad += compact
        self.reads.clear()
        self.rows, self.valid, self.grad = rows, valid, grad

    def close(self) -> None:
        """End the sink's step: its kept reads are dropped and later backwards through it raise."""
        self.reads.clear()
        self.closed = True
