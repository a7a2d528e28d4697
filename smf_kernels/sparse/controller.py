"""The exact sparse update (docs/method.md#what-sparse-means): :class:`SparseMemoryController`, the
:class:`~smf_kernels.sparse.memory_step.MemoryStep` that selects the value rows of every ProductKeyMemory of a
model each step and updates only them, from their compact (T, D) gradient (both fills,
:mod:`smf_kernels.sparse.fill_plan`; the finishing sequence, :mod:`smf_kernels.sparse.row_gradients`).

:meth:`SparseMemoryController.end_step` sums the step's counts over ranks (one all_reduce), scores them with the
rule and background statistics, takes the top ``min(T, #read)`` rows per layer (the same on every rank) and
averages their gradient over ranks (the DDP convention).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from smf_kernels.sharded.layout import gradient_copies, is_split, shard_of
from smf_kernels.sparse import step_checks
from smf_kernels.sparse.fill_plan import FillPlan
from smf_kernels.sparse.memory_step import MemoryStep
from smf_kernels.sparse.row_grad_sink import FILLS, READS_KEPT, ROWS_FIRST, RowGradSink
from smf_kernels.sparse.row_gradients import RowGradients


class SparseMemoryController(MemoryStep):
    """The exact update: selects and updates the value rows of every ProductKeyMemory in ``model`` (see the
    module docstring); its arguments are :class:`MemoryStep`'s. Fills: both."""

    FILLS = FILLS
    ROWS = True

    def begin_step(self, fill: str | FillPlan = READS_KEPT) -> None:
        """:meth:`MemoryStep.begin_step` (both fills)."""
        super().begin_step(fill)
        self._selected = False

    def _make_sink(self, name: str, values: nn.Parameter, fill: str) -> RowGradSink:
        chooser = None
        if fill == ROWS_FIRST:
            chooser = self._chooser(name)
        return RowGradSink(values, min(self.layer_rows[name], values.shape[0]), fill=fill, chooser=chooser)

    def _chooser(self, name: str) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        def choose() -> tuple[torch.Tensor, torch.Tensor]:
            if self._world() > 1:
                raise RuntimeError("under torch.distributed every rank must select the same rows: call "
                                   "controller.select_rows() between the step's forwards and its backward")
            return self._padded_selection(name, self.memories[name].read_counts)
        return choose

    def after_forward(self) -> None:
        """Selects the rows (:meth:`select_rows`) when the step's :class:`FillPlan` says so (one eager
        micro-batch, rows first); otherwise nothing."""
        super().after_forward()
        if self._plan.select_after_forward:
            self.select_rows()

    def select_rows(self) -> dict[str, torch.Tensor]:
        """Select this step's rows now, from the counts of the forwards run so far, summed over ranks
        (``begin_step(fill="rows_first")``, before the step's first backward).

        Returns:
            layer name -> (T',) int64 selected rows (ascending), T' = min(T, #read).
        """
        if not self._in_step:
            raise step_checks.not_begun("select_rows")
        if self._plan.fill != ROWS_FIRST:
            raise RuntimeError("select_rows() needs begin_step(fill='rows_first') first")
        if self._selected:
            raise RuntimeError("select_rows() was already called in this step")
        counts = self._step_counts()
        selected = {}
        for name, sink in self._sinks.items():
            rows, valid = self._padded_selection(name, counts[name])
            sink.set_rows(rows, valid)
            selected[name] = rows[valid]
            self.memories[name].set_read_counting(False)  # the step's selection is made
        self._selected = True
        return selected

    def _end(self) -> RowGradients:
        """:meth:`MemoryStep.end_step`: select the rows from the step's counts (unless selected before the
        backward), compute their gradient (reads kept: summed now) and average it over ranks."""
        counts = self._step_counts() if self._plan.fill == READS_KEPT else None
        reached = self._reached()
        tables = {}
        for name, memory in self.memories.items():
            values, sink = memory.values, self._sinks[name]
            if sink.fill == READS_KEPT:
                rows, valid = self._padded_selection(name, counts[name])
                sink.sum_reads(values, rows, valid)
            else:  # the rows the backwards used (set by select_rows, or chosen by the backward from the counts)
                rows, valid = sink.selection()
            valid = valid & reached[name]  # no backward reached the table: none of its rows moves
            tables[name] = (values, rows, self._average_over_ranks(values, sink.grad), valid)
        self._close()
        return self._gradients(tables, {name: rows[valid] for name, (_, rows, _, valid) in tables.items()})

    def _average_over_ranks(self, values: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` (this rank's gradient of rows of ``values``) averaged over the data-parallel ranks, in place.
        A column shard's read sums every rank's tokens, so its gradient is divided by its group's size (as
        smf_kernels.sharded averages the autograd gradient) and needs no reduction."""
        if is_split(values):
            grad.div_(shard_of(values).size)
        world = gradient_copies(values, self._world())
        if world > 1:
            self._all_reduce_sum(grad)
            grad.div_(world)
        return grad
