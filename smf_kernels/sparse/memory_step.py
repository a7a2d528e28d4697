"""The sparse step over the value rows of a model's ProductKeyMemory layers (docs/method.md#what-sparse-means;
use: :mod:`smf_kernels.sparse`): one object, :class:`MemoryStep`, whose update kind plugs in
(:mod:`smf_kernels.sparse.updates`: the exact update, the default, and its two ablations). A training loop drives
it so (``smf train`` and the Hugging Face Trainer alike)::

    step = SparseMemoryController(model, rule="kl", background=...)  # MemoryStep(model, update=ExactRows(), ...)
    step.begin(len(micro_batches), counting_forward)  # plans the fill, begins, counts and selects if the plan asks
    for micro_batch in micro_batches:
        loss = forward(micro_batch)
        step.after_forward()               # the exact update selects here when the plan says so
        loss.backward()
    result = step.finish(optimizer, max_grad_norm=...)  # StepResult; a finish that raises drops the step

or by its parts, where a refused call changes nothing::

    step.begin_step(step.plan(micro_batches, compiled=..., world=...))  # the fill (fill_plan.plan_fill)
    ...                                    # forwards, after_forward(), backwards; select_rows() after counting
    gradients = step.end_step()            # select (unless done), the rows' gradients: RowGradients
    gradients.apply(optimizer, max_grad_norm=..., nonfinite=...)  # the finishing sequence (row_gradients)
    # or, for the last two lines: step.finish_step(optimizer, max_grad_norm=...)

Observers (:class:`StepObserver`, :meth:`MemoryStep.observe`) see each step begin and each table's rows right before
they step (e.g. to keep the rows' values before their update). The fills: :mod:`smf_kernels.sparse.fill_plan`; the
gradients and the finishing sequence: :mod:`smf_kernels.sparse.row_gradients`.

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
from smf_kernels.sparse.row_gradients import RowGradients, StepResult, check_finish
from smf_kernels.sparse.selection import (RULES, background_weights, check_rows_per_step, default_rows_per_step,
                                          select_read_rows_padded, select_rows_padded, warn_if_not_sparse,
                                          weighted_scores)
from smf_kernels.sparse.updates import AuthorsMasked, DenseMasked, ExactRows, UpdateKind

logger = logging.getLogger(__name__)


def step_reduced_names(memories: dict[str, nn.Module]) -> list[str]:
    """Names (in the model whose memories, layer name -> memory, these are) that DDP must not synchronise under a
    sparse step: each memory's ``values`` (reduced by the step) and ``read_counts`` (DDP's default buffer
    broadcast would overwrite every rank's counts with rank 0's)."""
    prefixes = [f"{name}." if name else "" for name in memories]
    return [prefix + field for prefix in prefixes for field in ("values", "read_counts")]


class StepObserver:
    """Watches a :class:`MemoryStep` (:meth:`MemoryStep.observe`); each method does nothing unless overridden."""

    def began(self, step: MemoryStep) -> None:
        """A step began (its sinks set, before any counting forward)."""

    def before_rows(self, values: nn.Parameter, rows: torch.Tensor) -> None:
        """The (T,) int64 ``rows`` of table ``values`` are about to step (called once per table, by
        :meth:`MemoryStep.finish` and :meth:`MemoryStep.finish_step`)."""


class MemoryStep:
    """The sparse step over the value rows of ``model``'s ProductKeyMemory layers (see the module docstring): read
    counting, the background statistics and the top-T selection, the step's gradient sinks, the misuse checks and
    the finishing sequence; what the backwards write and what the end makes of it is ``update``'s.

    Args:
        model: any nn.Module; its ProductKeyMemory submodules are found with ``named_modules()`` and named by
            module path.
        update: the update kind (:mod:`smf_kernels.sparse.updates`; one per step object): None, the exact update
            (:class:`~smf_kernels.sparse.updates.ExactRows`).
        rule: "tfidf" or "kl" (docs/method.md#slot-selection); None: the kind's (the authors' "kl", else "tfidf").
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

    ``last`` holds the latest :meth:`finish`-ed step's :class:`~smf_kernels.sparse.StepResult` (None before).
    """

    def __init__(self, model: nn.Module, *, update: UpdateKind | None = None, rule: str | None = None,
                 rows_per_step: int | None = None, background: BackgroundStats | None = None,
                 nonfinite: str = "raise", process_group: Any = None) -> None:
        self.update = ExactRows() if update is None else update
        rule = self.update.default_rule if rule is None else rule
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
        self.last: StepResult | None = None
        self.observers: list[StepObserver] = []
        self._in_step = False
        self.fill_plan = FillPlan()  # the step's (begin_step's)
        self.sinks: dict[str, GradientSink] = {}  # layer -> where its backwards write this step
        self._ended: RowGradients | None = None  # the last end_step()'s: begin_step waits until it is applied
        # layer -> (what the weights were made from, the rule's background_weights on the table's device)
        self._weights: dict[str, tuple[tuple, torch.Tensor]] = {}
        if background is not None:
            self.set_background(background)

    def observe(self, observer: StepObserver) -> StepObserver:
        """Add ``observer`` (see :class:`StepObserver`); returns it."""
        self.observers.append(observer)
        return observer

    # ----------------------------------------------------------------- setup
    def value_parameters(self) -> list[nn.Parameter]:
        """The memories' ``values`` parameters, in layer order."""
        return [memory.values for memory in self.memories.values()]

    def ddp_ignored_names(self) -> list[str]:
        """Names (in ``model``) that DDP must not synchronise: :func:`step_reduced_names` of its memories."""
        return step_reduced_names(self.memories)

    def set_background(self, background: BackgroundStats) -> None:
        """Use ``background`` for scoring; raises ValueError if it was built for other memories."""
        background.check_matches(self.memories)
        self.background = background
        self._weights = {}

    def world_size(self) -> int:
        """The processes of the step's ``process_group`` (1 without torch.distributed)."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.process_group)
        return 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """``tensor`` summed over the step's processes, in place (nothing in one process)."""
        if self.world_size() > 1:
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
        """True between :meth:`begin_step` (or :meth:`begin`) and the end of the step (:meth:`end_step`,
        :meth:`finish`, :meth:`finish_step` or :meth:`abort_step`)."""
        return self._in_step

    def plan(self, micro_batches: int, *, compiled: bool = False, world: int = 1,
             step_tokens: int | None = None) -> FillPlan:
        """The fill of a step of ``micro_batches`` forwards and backwards on this process: :func:`plan_fill`
        (the smallest memory's slot count as ``slots``) for a kind that can fill rows first, else reads kept
        (the ablations select at the step's end, or after each forward)."""
        if ROWS_FIRST not in self.update.fills:
            return FillPlan(READS_KEPT)
        return plan_fill(micro_batches, compiled=compiled, world=world, step_tokens=step_tokens,
                         slots=min(memory.num_slots for memory in self.memories.values()))

    def begin(self, micro_batches: int, counting_forward: Callable[[], None] | None = None, *,
              compiled: bool = False, step_tokens: int | None = None) -> FillPlan:
        """Plan the step of ``micro_batches`` forwards and backwards on this process (:meth:`plan`, over the
        step's processes; ``compiled``: the model runs under torch.compile; ``step_tokens``: the most tokens a step
        holds on a process, a bound every process shares, or None), begin it, and when the plan asks for it run
        ``counting_forward`` (a forward of every micro-batch; here without grad) and select the rows. ValueError,
        before anything begins, when the plan needs a counting forward and none was given. Returns the plan."""
        plan = self.plan(micro_batches, compiled=compiled, world=self.world_size(), step_tokens=step_tokens)
        if plan.counting_forward and counting_forward is None:
            raise ValueError(f"this step of {micro_batches} micro-batches fills rows first, after a forward of "
                             "every micro-batch that only counts: pass counting_forward")
        self.begin_step(plan)
        if plan.counting_forward:
            with torch.no_grad():
                counting_forward()
            self.select_rows()
        return plan

    def begin_step(self, fill: str | FillPlan = READS_KEPT) -> None:
        """Start an optimizer step: refuse misuse, zero and count reads, give every memory the update kind's
        gradient sink. ``fill``: "reads_kept" (the default), "rows_first" (the exact update only), or a
        :class:`FillPlan` (:meth:`plan`) that ``after_forward()`` follows too (see the module docstring)."""
        plan = fill if isinstance(fill, FillPlan) else FillPlan(fill)
        check_fill(plan.fill)
        if plan.fill not in self.update.fills:
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
        self.fill_plan = plan
        self.sinks = {}
        for name, memory in self.memories.items():
            self._make_weights(name, memory.values.device)  # now: a backward that selects mutates nothing
            self.sinks[name] = self.update.sink(self, name, memory.values, plan.fill)
            memory.reset_read_counts()
            memory.set_read_counting(True)
            memory.set_grad_sink(self.sinks[name])
        self.update.begin(self)
        self._in_step = True
        for observer in self.observers:
            observer.began(self)

    def after_forward(self) -> None:
        """Between a micro-batch's forward and its backward: what the update kind's selection needs (the exact
        update selects here when the step's :class:`FillPlan` says so; the authors' after every forward)."""
        if not self._in_step:
            raise step_checks.not_begun("after_forward")
        self.update.after_forward(self)

    def select_rows(self) -> dict[str, torch.Tensor]:
        """Select this step's rows now, from the counts of the forwards run so far, summed over ranks
        (``begin_step(fill="rows_first")``, before the step's first backward; the exact update only).

        Returns:
            layer name -> (T',) int64 selected rows (ascending), T' = min(T, #read).
        """
        if not self._in_step:
            raise step_checks.not_begun("select_rows")
        select = getattr(self.update, "select_rows", None)
        if select is None:
            raise RuntimeError(f"select_rows() is the exact update's; {type(self).__name__} selects at the "
                               "step's end")
        return select(self)

    def end_step(self) -> RowGradients:
        """End the step's forwards and backwards without touching the optimizer: the step's rows and gradients,
        for :meth:`RowGradients.apply`. Read counting and the sinks are off and the counts zeroed after.
        Refuses (:class:`~smf_kernels.sparse.step_checks.StepMisuseError`, nothing changed) a step not begun and
        a value gradient made outside the step."""
        self._check_can_end("end_step")
        return self._end()

    def _end(self) -> RowGradients:
        """:meth:`end_step` of a step checked to be endable: the kind's end, the step closed."""
        tables, selected = self.update.end(self, self.sinks)
        self._close()
        self._ended = RowGradients(tables, {id(p): n for n, p in self.model.named_parameters()}, selected,
                                   self.process_group, self.world_size())
        return self._ended

    def finish(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None) -> StepResult:
        """:meth:`finish_step`'s sequence for a training loop: the step's end and its finishing sequence, the
        result kept in :attr:`last`; a call that raises (a refused optimizer or norm, a non-finite gradient)
        drops the step (:meth:`abort_step`), so that the loop's next :meth:`begin` starts afresh."""
        try:
            self.last = self._finish(optimizer, max_grad_norm, "finish")
        except BaseException:
            self.abort_step()
            raise
        return self.last

    def finish_step(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None
                    ) -> dict[str, torch.Tensor]:
        """:meth:`end_step`, then the finishing sequence (:meth:`RowGradients.finish` with this step's
        ``nonfinite``; a skipped step is counted in :attr:`skipped_steps`); each observer's ``before_rows`` is
        called right before each table's rows step. Everything is checked once, before the step ends: a refused
        call (misuse, a bad norm, an optimizer that does not hold the values or cannot step rows) changes
        nothing. Returns layer name -> (T',) int64 rows the step updated (ascending); empty rows for every layer
        when the step was skipped (``nonfinite="skip"``)."""
        return self._finish(optimizer, max_grad_norm, "finish_step").selected

    def _finish(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None, method: str) -> StepResult:
        self._check_can_end(method)
        checked = check_finish(optimizer, {name: m.values for name, m in self.memories.items()},
                               rows=self.update.rows, max_grad_norm=max_grad_norm, nonfinite=self.nonfinite)
        result = self._end().finish(checked, self._before_rows if self.observers else None)
        self.skipped_steps += result.skipped
        return result

    def _before_rows(self, values: nn.Parameter, rows: torch.Tensor) -> None:
        for observer in self.observers:
            observer.before_rows(values, rows)

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

    def reached(self) -> dict[str, torch.Tensor]:
        """Layer -> 0-d bool: whether a backward of the step reached its table on any rank (one all_reduce when
        there are several ranks, so that every rank keeps or drops the same rows; no host sync)."""
        names = list(self.sinks)
        flags = torch.stack([self.sinks[name].reached for name in names]).to(torch.int32)
        self.all_reduce_sum(flags)
        return dict(zip(names, (flags > 0).unbind()))

    def _check_can_end(self, method: str) -> None:
        if not self._in_step:
            raise step_checks.not_begun(method)
        for name, memory in self.memories.items():
            if memory.values.grad is not None:
                raise step_checks.gradient_from_outside(f"{name}.values")

    def _close(self) -> None:
        self.update.close(self)
        for sink in self.sinks.values():
            sink.close()
        for memory in self.memories.values():
            memory.set_read_counting(False)
            memory.set_grad_sink(None)
            memory.reset_read_counts()
        self.sinks = {}
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

    def padded_selection(self, name: str, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows (T,) ascending, valid (T,) bool): the step's selection at a fixed size. Eager: only the read
        slots are scored (one host sync); compiled: every slot, with no host sync (the same rows)."""
        weights = self._weights[name][1]
        if torch.compiler.is_compiling():
            return select_rows_padded(weighted_scores(self.rule, counts, weights), counts, self.layer_rows[name])
        return select_read_rows_padded(self.rule, counts, weights, self.layer_rows[name])

    def step_counts(self) -> dict[str, torch.Tensor]:
        """Each layer's (M,) int64 read counts of the whole step, summed over ranks (one all_reduce of them packed
        into one tensor); in one process, the ``read_counts`` buffers themselves (no copy)."""
        names = list(self.memories)
        if self.world_size() == 1:
            return {name: self.memories[name].read_counts for name in names}
        packed = torch.cat([self.memories[name].read_counts for name in names])
        self.all_reduce_sum(packed)
        return dict(zip(names, packed.split([self.memories[name].num_slots for name in names])))


class SparseMemoryController(MemoryStep):
    """The exact update (:class:`~smf_kernels.sparse.updates.ExactRows`): selects and updates the value rows of
    every ProductKeyMemory in ``model``; arguments as :class:`MemoryStep`'s (rule "tfidf" by default)."""

    def __init__(self, model: nn.Module, **kwargs: Any) -> None:
        super().__init__(model, update=ExactRows(), **kwargs)


class DenseMaskedUpdate(MemoryStep):
    """The exact update's selection with a masked dense gradient and a dense optimizer
    (:class:`~smf_kernels.sparse.updates.DenseMasked`); arguments as :class:`MemoryStep`'s; finish it with
    ``torch.optim.AdamW`` over the values."""

    def __init__(self, model: nn.Module, **kwargs: Any) -> None:
        super().__init__(model, update=DenseMasked(), **kwargs)


class AuthorsSparseUpdate(MemoryStep):
    """The authors' per-micro-batch selection (:class:`~smf_kernels.sparse.updates.AuthorsMasked`), one process:
    ``model``, ``rule`` ("kl" by default), ``rows_per_step`` (T rows per layer per micro-batch), ``background`` and
    ``nonfinite`` as :class:`MemoryStep`'s; finish it with a dense optimizer."""

    def __init__(self, model: nn.Module, *, rule: str = "kl", rows_per_step: int | None = None,
                 background: BackgroundStats | None = None, nonfinite: str = "raise") -> None:
        super().__init__(model, update=AuthorsMasked(), rule=rule, rows_per_step=rows_per_step,
                         background=background, nonfinite=nonfinite)
