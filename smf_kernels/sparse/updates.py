"""The update kinds a :class:`~smf_kernels.sparse.MemoryStep` composes (docs/method.md#what-sparse-means,
#the-sparse-update-exact-default-and-the-authors-ablation): what its backwards write and what its end makes of it.

- :class:`ExactRows` (the default; ``smf train --update exact``): selects the step's top-T value rows of every
  memory from the read counts of the whole step, summed over ranks, and updates only them from their compact
  (T, D) gradient (both fills, :mod:`smf_kernels.sparse.fill_plan`), averaged over ranks (the DDP convention).
- :class:`DenseMasked` (``--update dense_masked``): the same selection at the step's end; every unselected
  row of the (rank-averaged) dense gradient zeroed; a dense ``torch.optim.AdamW`` steps the whole table.
- :class:`AuthorsMasked` (``--update authors``, one process, as the authors' single-GPU runs) reproduces
  github.com/prakharg55/SMF-ICML (``smf_rebuild/sparse_memory.py``, ``trainer_utils.py``). Per micro-batch: read
  counts are zeroed (trainer_utils.py:15) and counted over its forward, padding included (a forward hook bincounts
  every index, sparse_memory.py:29-33); right after that forward the top-T rows are chosen from those counts alone
  (trainer_utils.py:18, sparse_memory.py:119-147); its backward's dense value gradient is multiplied by that row
  mask (a tensor hook, sparse_memory.py:107-117) and gradients accumulate. Then global-norm clipping and a dense
  AdamW step, so a step can touch up to (micro-batches x T) rows.

Both ablations step a dense AdamW on the whole table, so AdamW's momentum (and weight decay) still moves rows
outside the selection: they measure that leak (#pitfalls-of-earlier-implementations, :func:`rows_moved_outside`).
Their backwards write the dense value gradient into a
:class:`~smf_kernels.sparse.dense_grad_sink.DenseGradSink`, not ``.grad``.

A kind is a small object the step calls at five points, each given the step (what it may read of it:
:class:`StepView`)::

    sink(step, name, values, fill)  # at begin_step: where layer ``name``'s backwards write this step
    begin(step)                     # after the sinks are set (default: nothing)
    after_forward(step)             # between a micro-batch's forward and its backward (default: nothing)
    end(step, sinks)                # the step's end: (tables for RowGradients, selected rows per layer)
    close(step)                     # the step is over, ended or aborted (default: nothing)

``fills`` are the fills it can run; ``rows`` says whether it updates rows through the optimizer's ``step_rows``
(else the values' ``.grad`` and ``optimizer.step()``).
"""
from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from smf_kernels.memory import ProductKeyMemory
from smf_kernels.ops.weighted_gather import GradientSink
from smf_kernels.sharded.placement import placement_of
from smf_kernels.sparse.dense_grad_sink import DenseGradSink
from smf_kernels.sparse.fill_plan import FillPlan
from smf_kernels.sparse.row_grad_sink import FILLS, READS_KEPT, ROWS_FIRST, RowGradSink

# layer -> (values (M, D) parameter, rows (T,) int64, grad (T, D), valid (T,) bool): what RowGradients steps
Tables = dict[str, tuple[nn.Parameter, torch.Tensor, torch.Tensor, torch.Tensor]]


class StepView(Protocol):
    """What a kind reads of the :class:`~smf_kernels.sparse.MemoryStep` it is composed into."""

    memories: dict[str, ProductKeyMemory]  # layer name -> memory
    layer_rows: dict[str, int]  # layer name -> T
    fill_plan: FillPlan  # the step's
    sinks: dict[str, GradientSink]  # layer name -> this step's sink (the kind's)

    def padded_selection(self, name: str, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows (T,) ascending, valid (T,) bool) of layer ``name`` for (M,) ``counts``."""

    def step_counts(self) -> dict[str, torch.Tensor]:
        """Layer -> (M,) int64 read counts of the step so far, summed over ranks."""

    def reached(self) -> dict[str, torch.Tensor]:
        """Layer -> 0-d bool: a backward of the step reached the table on some rank."""

    def world_size(self) -> int:
        """The step's processes."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """``tensor`` summed over the step's processes, in place."""


class UpdateKind:
    """What every kind shares: reads kept only, the values' ``.grad`` (no rows), and nothing done at ``begin``,
    ``after_forward`` or ``close`` (see the module docstring)."""

    fills: tuple[str, ...] = (READS_KEPT,)
    rows = False
    default_rule = "tfidf"

    def sink(self, step: StepView, name: str, values: nn.Parameter, fill: str) -> GradientSink:
        raise NotImplementedError

    def begin(self, step: StepView) -> None:
        pass

    def after_forward(self, step: StepView) -> None:
        pass

    def end(self, step: StepView, sinks: dict[str, GradientSink]) -> tuple[Tables, dict[str, torch.Tensor]]:
        raise NotImplementedError

    def close(self, step: StepView) -> None:
        pass


class ExactRows(UpdateKind):
    """The exact update (see the module docstring). Fills: both; rows through ``step_rows``."""

    fills = FILLS
    rows = True

    def __init__(self) -> None:
        self.selected = False  # this step's rows were selected before its backward (select_rows)

    def sink(self, step: StepView, name: str, values: nn.Parameter, fill: str) -> RowGradSink:
        num_rows = min(step.layer_rows[name], values.shape[0])
        if fill != ROWS_FIRST:
            return RowGradSink(values, num_rows, fill=fill)

        def choose() -> tuple[torch.Tensor, torch.Tensor]:
            if step.world_size() > 1:
                raise RuntimeError("under torch.distributed every rank must select the same rows: call "
                                   "controller.select_rows() between the step's forwards and its backward")
            return step.padded_selection(name, step.memories[name].read_counts)
        return RowGradSink(values, num_rows, fill=fill, chooser=choose)

    def begin(self, step: StepView) -> None:
        self.selected = False

    def after_forward(self, step: StepView) -> None:
        """Selects the rows (:meth:`select_rows`) when the step's :class:`FillPlan` says so (one eager
        micro-batch, rows first)."""
        if step.fill_plan.select_after_forward:
            self.select_rows(step)

    def select_rows(self, step: StepView) -> dict[str, torch.Tensor]:
        """:meth:`MemoryStep.select_rows`: the rows chosen now from the counts so far, summed over ranks, set in
        every layer's sink."""
        if step.fill_plan.fill != ROWS_FIRST:
            raise RuntimeError("select_rows() needs begin_step(fill='rows_first') first")
        if self.selected:
            raise RuntimeError("select_rows() was already called in this step")
        counts = step.step_counts()
        selected = {}
        for name, sink in step.sinks.items():
            rows, valid = step.padded_selection(name, counts[name])
            sink.set_rows(rows, valid)
            selected[name] = rows[valid]
            step.memories[name].set_read_counting(False)  # the step's selection is made
        self.selected = True
        return selected

    def end(self, step: StepView, sinks: dict[str, RowGradSink]) -> tuple[Tables, dict[str, torch.Tensor]]:
        """Select the rows from the step's counts (unless selected before the backward), compute their gradient
        (reads kept: summed now) and average it over ranks (as the table's placement averages it)."""
        counts = step.step_counts() if step.fill_plan.fill == READS_KEPT else None
        reached = step.reached()
        tables = {}
        for name, memory in step.memories.items():
            values, sink = memory.values, sinks[name]
            if sink.fill == READS_KEPT:
                rows, valid = step.padded_selection(name, counts[name])
                sink.sum_reads(values, rows, valid)
            else:  # the rows the backwards used (set by select_rows, or chosen by the backward from the counts)
                rows, valid = sink.selection()
            valid = valid & reached[name]  # no backward reached the table: none of its rows moves
            grad = placement_of(values).average_rows(sink.grad, step.world_size(), step.all_reduce_sum)
            tables[name] = (values, rows, grad, valid)
        return tables, {name: rows[valid] for name, (_, rows, _, valid) in tables.items()}


class DenseMasked(UpdateKind):
    """The exact update's selection with a masked dense gradient and a dense optimizer (see the module docstring);
    finish it with ``torch.optim.AdamW`` over the values. Fill: reads kept (it selects at the step's end). Under
    DDP the values are reduced here (``ddp_ignored_names``)."""

    def sink(self, step: StepView, name: str, values: nn.Parameter, fill: str) -> DenseGradSink:
        return DenseGradSink(values.device)

    def end(self, step: StepView, sinks: dict[str, DenseGradSink]) -> tuple[Tables, dict[str, torch.Tensor]]:
        """Select from the step's counts; each value table's ``.grad`` := its (rank-averaged) dense gradient with
        every unselected row zeroed. Selected rows: none for a layer no backward of the step reached (it gets no
        gradient, so nothing of it moves)."""
        counts = step.step_counts()
        reached = step.reached()  # on any rank: every rank reduces the same tables
        selected = {}
        for name, memory in step.memories.items():
            rows, valid = step.padded_selection(name, counts[name])
            values, grad = memory.values, sinks[name].grad
            if not bool(reached[name]):
                selected[name] = rows[:0]
                continue
            selected[name] = rows[valid]
            values.grad = torch.zeros_like(values) if grad is None else grad
            placement_of(values).average_copies(values.grad, step.world_size(), step.all_reduce_sum)
            keep = torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)
            keep[selected[name]] = True
            values.grad.mul_(keep.unsqueeze(1).to(values.grad.dtype))
        return {}, selected


def _count_padding_too(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: drop the caller's ``valid_mask`` so padding positions are counted as well."""
    return args, {**kwargs, "valid_mask": None}


class AuthorsMasked(UpdateKind):
    """Per-micro-batch row selection with a masked dense gradient (see the module docstring), in one process; its
    rule is "kl" by default and its T rows are per layer per micro-batch. Finish it with a dense optimizer. Fill:
    reads kept. One kind serves one step (it holds that step's masks)."""

    default_rule = "kl"

    def __init__(self) -> None:
        self.masks: dict[str, torch.Tensor] = {}  # layer -> (M,) bool: the micro-batch being backwarded selected
        self.used_rows: dict[str, torch.Tensor] = {}  # layer -> (M,) bool: selected by a micro-batch of the step
        self.handles: list[Any] = []

    def sink(self, step: StepView, name: str, values: nn.Parameter, fill: str) -> DenseGradSink:
        if name not in self.masks:
            self.masks[name] = torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)
        return DenseGradSink(values.device, mask=self.masks[name])  # the mask of the micro-batch being backwarded

    def begin(self, step: StepView) -> None:
        """Dense value gradients, masked by each micro-batch's selection, and reads counted with padding (as the
        authors count them)."""
        self.used_rows = {name: torch.zeros_like(mask) for name, mask in self.masks.items()}
        for memory in step.memories.values():
            self.handles.append(memory.register_forward_pre_hook(_count_padding_too, with_kwargs=True))

    def after_forward(self, step: StepView) -> None:
        """Select each layer's rows from the counts of the micro-batch forward just run (before its backward),
        then zero the counts for the next micro-batch."""
        for name, memory in step.memories.items():
            rows, valid = step.padded_selection(name, memory.read_counts)
            self.masks[name].zero_()
            self.masks[name][rows[valid]] = True
            self.used_rows[name][rows[valid]] = True
            memory.reset_read_counts()

    def end(self, step: StepView, sinks: dict[str, DenseGradSink]) -> tuple[Tables, dict[str, torch.Tensor]]:
        """Each value table's ``.grad`` := its masked dense gradient summed over the step's micro-batches.
        Selected rows: those any micro-batch of the step selected ((R,) int64, ascending); none for a layer no
        backward reached (it gets no gradient, so nothing of it moves)."""
        rows = {}
        for name, memory in step.memories.items():
            memory.values.grad = sinks[name].grad
            used = self.used_rows[name] if memory.values.grad is not None else torch.zeros_like(self.masks[name])
            rows[name] = used.nonzero().squeeze(1)
        return {}, rows

    def close(self, step: StepView) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def rows_moved_outside(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
                       selected: dict[str, torch.Tensor]) -> int:
    """Value rows, summed over layers, that changed in a step although not in its selected set.

    before/after: layer -> (M, D) values before and after the step; selected: layer -> (T,) rows.
    """
    moved = 0
    for name, old in before.items():
        changed = (after[name] != old).any(dim=1)
        changed[selected[name]] = False
        moved += int(changed.sum())
    return moved
