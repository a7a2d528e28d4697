"""The protocol of a sparse step over the value rows of a model's ProductKeyMemory layers
(docs/method.md#what-sparse-means; use: :mod:`smf_kernels.sparse`). Every update is a :class:`MemoryStep`: the
exact one, :class:`~smf_kernels.sparse.SparseMemoryController` (:mod:`smf_kernels.sparse.controller`), and its two
ablations (:mod:`smf_kernels.sparse.ablations`). All follow one protocol::

    plan = step.plan(micro_batches, compiled=..., world=...)  # the step's fill (fill_plan.plan_fill), decided once
    step.begin_step(plan)                 # zero and count reads; each memory's backward writes into a sink
    for micro_batch in step_batches:
        loss = forward(micro_batch)
        step.after_forward()              # the exact update selects here when the plan says so
        loss.backward()
    gradients = step.end_step()           # select (unless done), the rows' gradients: RowGradients
    gradients.apply(optimizer, max_grad_norm=..., nonfinite=...)  # the finishing sequence (row_gradients)
    # or, for the last two lines: step.finish(optimizer, max_grad_norm=...)

A training loop drives it through :class:`~smf_kernels.sparse.driver.StepDriver` (``smf train`` and the Hugging
Face Trainer alike). The fills: :mod:`smf_kernels.sparse.fill_plan`; the gradients and the finishing sequence:
:mod:`smf_kernels.sparse.row_gradients`.

Data parallelism: DDP must synchronise neither the values (the step reduces the rows' gradient) nor the
``read_counts`` buffers (its buffer broadcast would replace every rank's counts with rank 0's): before wrapping,
call ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, step.ddp_ignored_names())``.
The step reduces over ``process_group`` (default: the world group when torch.distributed runs more than one rank).

Limitation: activation checkpointing that re-runs a memory's forward during backward would count that
micro-batch's reads twice.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smf_kernels.memory import memories_of
from smf_kernels.ops.weighted_gather import GradientSink
from smf_kernels.sparse import step_checks
from smf_kernels.sparse.background import BackgroundStats
from smf_kernels.sparse.background_collection import collect_background
from smf_kernels.sparse.fill_plan import FillPlan, plan_fill
from smf_kernels.sparse.row_grad_sink import READS_KEPT, ROWS_FIRST, check_fill
from smf_kernels.sparse.row_gradients import BeforeRows, RowGradients, StepResult, check_finish
from smf_kernels.sparse.selection import (RULES, background_weights, check_rows_per_step, default_rows_per_step,
                                          select_read_rows_padded, select_rows_padded, warn_if_not_sparse,
                                          weighted_scores)

logger = logging.getLogger(__name__)


class MemoryStep:
    """What every sparse step over the value rows of ``model``'s ProductKeyMemory layers shares: read counting,
    the background statistics and the top-T selection, the step's gradient sinks (each update makes its own,
    :meth:`_make_sink`), the misuse checks, :meth:`abort_step`, and the protocol of the module docstring
    (:meth:`plan`, :meth:`begin_step`, :meth:`after_forward`, :meth:`end_step`, :meth:`finish`). The exact
    update (:class:`SparseMemoryController`) and the ablations (:mod:`smf_kernels.sparse.ablations`) are its
    kinds; each makes its sink, its end (``_end``, the step checked to be endable) and, if it needs one, its
    ``after_forward``.

    Args:
        model: any nn.Module; its ProductKeyMemory submodules are found with ``named_modules()`` and named by
            module path.
        rule: "tfidf" or "kl" (docs/method.md#slot-selection).
        rows_per_step: T, rows selected per layer per optimizer step; None (the default): the paper's share of
            each memory's slots, 512 of 16,384, at most the paper's 512 however many slots a memory has
            (:func:`~smf_kernels.sparse.selection.default_rows_per_step`); a number given is used as is.
        background: statistics for these memories (or collect them later with :meth:`collect_background`, or
            assign with :meth:`set_background`).
        nonfinite: "raise" (the default: :class:`~smf_kernels.sparse.step_checks.NonFiniteGradientError` naming
            the parameters, nothing stepped) or "skip" (the step is dropped and counted in
            :attr:`skipped_steps`) when a gradient of a step holds inf or NaN.
        process_group: group to reduce counts and gradients over; None = the default group when
            torch.distributed is initialised with world size > 1.
    """

    FILLS: tuple[str, ...] = (READS_KEPT,)  # the fills this kind of step can run
    ROWS = False  # whether it updates rows through the optimizer's step_rows (else .grad and optimizer.step())

    def __init__(self, model: nn.Module, *, rule: str = "tfidf", rows_per_step: int | None = None,
                 background: BackgroundStats | None = None, nonfinite: str = "raise",
                 process_group: Any = None) -> None:
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        check_rows_per_step(rows_per_step)
        self.model = model
        self.memories = memories_of(model)
        self.rule, self.rows_per_step = rule, rows_per_step
        self.nonfinite = step_checks.check_nonfinite_option(nonfinite)
        if rows_per_step is None:
            self.layer_rows = {name: default_rows_per_step(m.num_slots) for name, m in self.memories.items()}
            shares = {f"{rows} of {m.num_slots}" for rows, m in zip(self.layer_rows.values(), self.memories.values())}
            logger.info("rows_per_step: T = %s slots per layer (the default: the paper's share, 512 of 16,384, "
                        "at most 512)",
                        ", ".join(sorted(shares)))
        else:
            self.layer_rows = dict.fromkeys(self.memories, rows_per_step)
            warn_if_not_sparse({name: m.num_slots for name, m in self.memories.items()}, rows_per_step)
        self.process_group = process_group
        self.background: BackgroundStats | None = None
        self.skipped_steps = 0
        self._in_step = False
        self._plan = FillPlan()
        self._sinks: dict[str, GradientSink] = {}
        self._ended: RowGradients | None = None  # the last end_step()'s: begin_step waits until it is applied
        # layer -> (what the weights were made from, the rule's background_weights on the table's device)
        self._weights: dict[str, tuple[tuple, torch.Tensor]] = {}
        if background is not None:
            self.set_background(background)

    # ----------------------------------------------------------------- setup
    def value_parameters(self) -> list[nn.Parameter]:
        """The memories' ``values`` parameters, in layer order."""
        return [memory.values for memory in self.memories.values()]

    def ddp_ignored_names(self) -> list[str]:
        """Names (in ``model``) that DDP must not synchronise: each memory's ``values`` (reduced by
        the controller) and ``read_counts`` (DDP's default buffer broadcast would overwrite every
        rank's counts with rank 0's)."""
        prefixes = [f"{name}." if name else "" for name in self.memories]
        return [prefix + field for prefix in prefixes for field in ("values", "read_counts")]

    def set_background(self, background: BackgroundStats) -> None:
        """Use ``background`` for scoring; raises ValueError if it was built for other memories."""
        background.check_matches(self.memories)
        self.background = background
        self._weights = {}

    def _world(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.process_group)
        return 1

    def _all_reduce_sum(self, tensor: torch.Tensor) -> None:
        if self._world() > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)

    # ------------------------------------------------------- background stats
    def collect_background(self, batches: Iterable, *, forward: Callable[[nn.Module, Any], Any] | None = None,
                           max_batches: int | None = None, progress: bool = True) -> BackgroundStats:
        """Count reads over ``batches`` (one batch = one document, the paper's batch size 1) and use the result:
        :func:`smf_kernels.sparse.background_collection.collect_background` over this controller's process group."""
        if self._in_step:
            raise RuntimeError("collect_background cannot run between begin_step() and finish_step()")
        stats = collect_background(self.model, batches, forward=forward, max_batches=max_batches,
                                   process_group=self.process_group, progress=progress)
        self.set_background(stats)
        return stats

    # ------------------------------------------------------------ train steps
    @property
    def in_step(self) -> bool:
        """True between :meth:`begin_step` and the end of the step (:meth:`end_step`, :meth:`finish_step` or
        :meth:`abort_step`)."""
        return self._in_step

    def plan(self, micro_batches: int, *, compiled: bool = False, world: int = 1,
             step_tokens: int | None = None) -> FillPlan:
        """The fill of a step of ``micro_batches`` forwards and backwards on this process: :func:`plan_fill`
        (the smallest memory's slot count as ``slots``) for a kind that can fill rows first, else reads kept
        (the ablations select at the step's end, or after each forward)."""
        if ROWS_FIRST not in self.FILLS:
            return FillPlan(READS_KEPT)
        return plan_fill(micro_batches, compiled=compiled, world=world, step_tokens=step_tokens,
                         slots=min(memory.num_slots for memory in self.memories.values()))

    def begin_step(self, fill: str | FillPlan = READS_KEPT) -> None:
        """Start an optimizer step: refuse misuse, zero and count reads, give every memory this update's gradient
        sink (:meth:`_make_sink`). ``fill``: "reads_kept" (the default), "rows_first" (the exact update only), or
        a :class:`FillPlan` (:meth:`plan`) that ``after_forward()`` follows too (see the module docstring)."""
        plan = fill if isinstance(fill, FillPlan) else FillPlan(fill)
        check_fill(plan.fill)
        if plan.fill not in self.FILLS:
            raise ValueError(f"fill {plan.fill!r} is the exact update's; {type(self).__name__} selects at the "
                             "step's end (fill='reads_kept')")
        if self.background is None:
            raise RuntimeError("no background statistics: pass background=, call set_background() "
                               "or collect_background() first")
        if self._in_step:
            raise step_checks.begun_twice()
        if self._ended is not None and not (self._ended.applied or self._ended.discarded):
            raise step_checks.StepMisuseError(
                "begin_step() before the last step's gradients were applied: call apply(optimizer) on what "
                "end_step() returned (the rows' gradients and alpha's .grad would otherwise be lost or carried "
                "into this step), or abort_step() to drop them")
        for name, memory in self.memories.items():
            if not memory.values.requires_grad:
                raise RuntimeError(f"{name}.values does not require grad; nothing to train")
            if memory.values.grad is not None:
                raise step_checks.gradient_from_outside(f"{name}.values")
        self._plan = plan
        self._sinks = {}
        for name, memory in self.memories.items():
            self._make_weights(name, memory.values.device)  # now: a backward that selects mutates nothing
            self._sinks[name] = self._make_sink(name, memory.values, plan.fill)
            memory.reset_read_counts()
            memory.set_read_counting(True)
            memory.set_grad_sink(self._sinks[name])
        self._in_step = True

    def _make_sink(self, name: str, values: nn.Parameter, fill: str) -> GradientSink:
        """Where layer ``name``'s backwards put their value gradient this step (each update its own): a
        GradientSink with ``reached`` (a 0-d bool tensor: a backward reached the table) and ``close()``."""
        raise NotImplementedError

    def after_forward(self) -> None:
        """Between a micro-batch's forward and its backward: each kind does what its selection needs (here:
        refuse a step not begun)."""
        if not self._in_step:
            raise step_checks.not_begun("after_forward")

    def end_step(self) -> RowGradients:
        """End the step's forwards and backwards without touching the optimizer: the step's rows and gradients,
        for :meth:`RowGradients.apply`. Read counting and the sinks are off and the counts zeroed after.
        Refuses (:class:`~smf_kernels.sparse.step_checks.StepMisuseError`, nothing changed) a step not begun and
        a value gradient made outside the step."""
        self._check_can_end("end_step")
        return self._end()

    def _end(self) -> RowGradients:
        """:meth:`end_step` of a step checked to be endable: each kind's own."""
        raise NotImplementedError

    def finish(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None,
               before_rows: BeforeRows | None = None) -> StepResult:
        """:meth:`end_step`, then the finishing sequence (:meth:`RowGradients.finish` with this step's
        ``nonfinite``; a skipped step is counted in :attr:`skipped_steps`); ``before_rows(values, rows)``, when
        given, is called right before each table's rows step. Everything is checked once, before the step ends:
        a refused call (misuse, a bad norm, an optimizer that does not hold the values or cannot step rows)
        changes nothing."""
        self._check_can_end("finish_step")
        checked = check_finish(optimizer, {name: m.values for name, m in self.memories.items()}, rows=self.ROWS,
                               max_grad_norm=max_grad_norm, nonfinite=self.nonfinite)
        result = self._end().finish(checked, before_rows)
        self.skipped_steps += result.skipped
        return result

    def finish_step(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None
                    ) -> dict[str, torch.Tensor]:
        """:meth:`finish`'s rows: layer name -> (T',) int64 rows the step updated (ascending); empty rows for
        every layer when the step was skipped (``nonfinite="skip"``)."""
        return self.finish(optimizer, max_grad_norm=max_grad_norm).selected

    def _gradients(self, tables: dict, selected: dict[str, torch.Tensor]) -> RowGradients:
        self._ended = RowGradients(tables, {id(p): n for n, p in self.model.named_parameters()}, selected,
                                   self.process_group, self._world())
        return self._ended

    def abort_step(self) -> None:
        """Discard the step in progress, e.g. after one of its forwards or backwards raised: its read counts,
        its sinks (a later backward of its graph raises) and the memories' value gradients are dropped, and the
        next :meth:`begin_step` starts afresh. Between :meth:`end_step` and the ``apply`` of what it returned, it
        discards those gradients instead (:meth:`RowGradients.discard`; an ablation's value ``.grad`` dropped).
        Gradients of other parameters are the caller's (``optimizer.zero_grad()``). Otherwise a no-op::

            controller.begin_step()
            try:
                ...  # the step's forwards and backwards
            except BaseException:
                controller.abort_step()
                raise
            controller.finish_step(optimizer)
        """
        if not self._in_step:
            if self._ended is None or self._ended.applied or self._ended.discarded:
                return
            self._ended.discard()
        else:
            self._close()
        for memory in self.memories.values():
            memory.values.grad = None

    def _reached(self) -> dict[str, torch.Tensor]:
        """Layer -> 0-d bool: whether a backward of the step reached its table on any rank (one all_reduce when
        there are several ranks, so that every rank keeps or drops the same rows; no host sync)."""
        names = list(self._sinks)
        flags = torch.stack([self._sinks[name].reached for name in names]).to(torch.int32)
        self._all_reduce_sum(flags)
        return dict(zip(names, (flags > 0).unbind()))

    def _check_can_end(self, method: str) -> None:
        if not self._in_step:
            raise step_checks.not_begun(method)
        for name, memory in self.memories.items():
            if memory.values.grad is not None:
                raise step_checks.gradient_from_outside(f"{name}.values")

    def _close(self) -> None:
        for sink in self._sinks.values():
            sink.close()
        for memory in self.memories.values():
            memory.set_read_counting(False)
            memory.set_grad_sink(None)
            memory.reset_read_counts()
        self._sinks = {}
        self._in_step = False

    def _make_weights(self, name: str, device: torch.device) -> None:
        """Layer ``name``'s :func:`~smf_kernels.sparse.selection.background_weights` of the rule on ``device``
        ((M,) float64: the IDF, or the smoothed background distribution + eps), made once per background: again
        only when its statistics changed (other tensors, an in-place update such as ``add_batch``, another N) or
        the table moved (a write through ``.data`` or a NumPy view bumps no version: :meth:`set_background` again).
        The statistics live on the CPU; their copies on ``device`` are dropped once used."""
        doc_freq, reads = self.background.doc_freq[name], self.background.reads[name]
        source = (doc_freq, doc_freq._version, reads, reads._version, self.background.num_batches[name], device)
        made = self._weights.get(name)
        if made is not None and all(a is b or (not isinstance(a, torch.Tensor) and a == b)
                                    for a, b in zip(made[0], source)):
            return
        self._weights[name] = (source, background_weights(self.rule, doc_freq.to(device), reads.to(device),
                                                          self.background.num_batches[name]))

    def _padded_selection(self, name: str, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows (T,) ascending, valid (T,) bool): the step's selection at a fixed size. Eager: only the read
        slots are scored (one host sync); compiled: every slot, with no host sync (the same rows)."""
        weights = self._weights[name][1]
        if torch.compiler.is_compiling():
            return select_rows_padded(weighted_scores(self.rule, counts, weights), counts, self.layer_rows[name])
        return select_read_rows_padded(self.rule, counts, weights, self.layer_rows[name])

    def _step_counts(self) -> dict[str, torch.Tensor]:
        """Each layer's (M,) int64 read counts of the whole step, summed over ranks (one all_reduce of them packed
        into one tensor); in one process, the ``read_counts`` buffers themselves (no copy)."""
        names = list(self.memories)
        if self._world() == 1:
            return {name: self.memories[name].read_counts for name in names}
        packed = torch.cat([self.memories[name].read_counts for name in names])
        self._all_reduce_sum(packed)
        return dict(zip(names, packed.split([self.memories[name].num_slots for name in names])))
