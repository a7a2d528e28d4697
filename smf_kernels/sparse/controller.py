"""The sparse step, whole: how it fills the selected rows' gradient, how it ends and how it finishes
(docs/method.md#what-sparse-means; use: :mod:`smf_kernels.sparse`). Every update over the value rows of a model's
ProductKeyMemory layers is a :class:`MemoryStep`: the exact one, :class:`SparseMemoryController`, here; its two
ablations beside it (:mod:`smf_kernels.sparse.ablations`). All follow one protocol::

    plan = step.plan(micro_batches, compiled=..., world=...)  # the step's fill (plan_fill), decided once
    step.begin_step(plan)                 # zero and count reads; each memory's backward writes into a sink
    for micro_batch in step_batches:
        loss = forward(micro_batch)
        step.after_forward()              # the exact update selects here when the plan says so
        loss.backward()
    gradients = step.end_step()           # select (unless done), the rows' gradients: RowGradients
    gradients.apply(optimizer, max_grad_norm=..., nonfinite=...)  # the finishing sequence
    # or, for the last two lines: step.finish_step(optimizer, max_grad_norm=...)

**The two fills** (:data:`~smf_kernels.sparse.row_grad_sink.FILLS`, ``begin_step(fill)``):

- ``"rows_first"``: the rows are known before the step's first backward, which adds only their (T, D) gradient:
  :meth:`SparseMemoryController.select_rows` between the forwards and the first backward (one eager micro-batch:
  ``after_forward()`` does it; under accumulation after a no-grad forward of every micro-batch that only counts),
  or, in one process without the call, the first backward chooses the rows from the counts itself (no host sync:
  what a torch.compile'd step runs).
- ``"reads_kept"`` (the default): every backward keeps its reads and the step's end sums the selected rows'
  gradient from them: no second forward, about N x (D x itemsize + 12 L) bytes per layer for the step's N tokens.

:func:`plan_fill` is the one place that chooses (``smf train``, its sharded memories and
:class:`smf_kernels.hf.SparseMemoryTrainer` all call it, through :meth:`MemoryStep.plan`).

**The finishing sequence**, :meth:`RowGradients.apply`, the one every caller goes through (``finish_step``,
``smf train`` sharded or not, under FSDP or not, and the Trainer): check every gradient of the step for inf / NaN
(:mod:`~smf_kernels.sparse.step_checks`: raise, or skip the step), clip all of them with the rows' gradients in
the norm (a sharded table's shard counting as the whole table), step the optimizer's parameters, update the
selected rows (:meth:`RowSparseAdamW.step_rows`, the clipping coefficient applied as they step), zero the
gradients.

:meth:`SparseMemoryController.end_step` sums the step's counts over ranks (one all_reduce), scores them with the
rule and background statistics, takes the top ``min(T, #read)`` rows per layer (the same on every rank) and
averages their gradient over ranks (the DDP convention).

Data parallelism: DDP must synchronise neither the values (the controller reduces the rows' gradient) nor the
``read_counts`` buffers (its buffer broadcast would replace every rank's counts with rank 0's): before wrapping,
call ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, controller.ddp_ignored_names())``.
The controller reduces over ``process_group`` (default: the world group when torch.distributed runs more than
one rank).

Limitation: activation checkpointing that re-runs a memory's forward during backward would count that
micro-batch's reads twice.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from smf_kernels.memory import memories_of
from smf_kernels.sharded.layout import gradient_copies, is_split, shard_of
from smf_kernels.sparse import step_checks
from smf_kernels.sparse.background import BackgroundStats
from smf_kernels.sparse.background_collection import collect_background
from smf_kernels.sparse.clipping import check_max_norm, norm_and_clip_coefficient
from smf_kernels.ops.weighted_gather import GradientSink
from smf_kernels.sparse.row_grad_sink import FILLS, READS_KEPT, ROWS_FIRST, RowGradSink, check_fill
from smf_kernels.sparse.selection import (RULES, default_rows_per_step, score_slots, select_rows_padded,
                                          warn_if_not_sparse)

logger = logging.getLogger(__name__)

# Reads are kept while a step can hold at most this many tokens per slot on a rank (more: rows first, counted).
KEPT_READS_PER_SLOT = 1


@dataclass(frozen=True)
class FillPlan:
    """One step's fill (``fill``: "rows_first" or "reads_kept", see the module docstring) and what the caller
    does for it: ``counting_forward``, a no-grad forward of every micro-batch that only counts, then
    ``select_rows()``, before the first forward with grad; ``select_after_forward``, the rows selected between
    the forward and the backward of the step's one micro-batch (``after_forward()`` does it)."""

    fill: str = READS_KEPT
    counting_forward: bool = False
    select_after_forward: bool = False


def plan_fill(micro_batches: int, *, compiled: bool, world: int, step_tokens: int | None = None,
              slots: int | None = None) -> FillPlan:
    """The fill of an exact step of ``micro_batches`` forwards and backwards per process.

    Args:
        micro_batches: forwards (each with its backward) in the step on this process.
        compiled: the model runs under torch.compile: no host sync in its backward, so rows come first
            (one micro-batch: the backward chooses them; under accumulation: a counting forward).
        world: data-parallel processes; a compiled step needs one (its backward chooses rows from this process's
            counts, which other processes would not share): ValueError otherwise.
        step_tokens, slots: the most tokens a step holds on a process and the smallest memory's slot count;
            when both are given and the tokens exceed ``KEPT_READS_PER_SLOT x slots``, kept reads would take
            more memory than a dense gradient, so rows come first (a counting forward). Every process must pass
            the same bound (processes that chose differently would deadlock).
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    if compiled and world > 1:
        raise ValueError("a compiled sparse step runs in one process: under torch.distributed every process must "
                         "select the same rows before its backward, outside the compiled graph")
    if micro_batches == 1:
        return FillPlan(ROWS_FIRST, select_after_forward=not compiled)
    too_many = step_tokens is not None and slots is not None and step_tokens > KEPT_READS_PER_SLOT * slots
    if compiled or too_many:
        return FillPlan(ROWS_FIRST, counting_forward=True)
    return FillPlan(READS_KEPT)


def check_groups(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.check_groups()`` where it has one (RowSparseAdamW, RowSparseSGD: ValueError / TypeError naming
    the group and the hyper-parameter out of range), before a finishing sequence moves anything."""
    check = getattr(optimizer, "check_groups", None)
    if callable(check):
        check()


class _MeshShard(NamedTuple):
    """An FSDP-sharded parameter's process group: its gradient's squared norm is summed over it."""

    group: Any


def _local_grad(param: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """(this rank's part of ``param.grad``, what its norm is summed over: a sharded memory's
    :class:`~smf_kernels.sharded.ColumnShard`, an FSDP shard's mesh group, or None for a whole gradient)."""
    grad = param.grad
    if isinstance(grad, DTensor):
        sharded = any(placement.is_shard() for placement in grad.placements)
        return grad.to_local(), _MeshShard(grad.device_mesh.get_group()) if sharded else None
    return grad, shard_of(param) if is_split(param) else None


class StepResult(NamedTuple):
    """What :meth:`RowGradients.apply` did: ``selected``, layer name -> (T',) int64 rows that moved (ascending;
    empty when skipped); ``grad_norm``, the norm of every gradient of the step before clipping (a 0-d tensor;
    None without clipping or when skipped); ``skipped``, True when a non-finite gradient dropped the step."""

    selected: dict[str, torch.Tensor]
    grad_norm: torch.Tensor | None
    skipped: bool


@dataclass
class RowGradients:
    """One step's gradients after :meth:`MemoryStep.end_step`, ready for the finishing sequence (:meth:`apply`).

    ``tables``: layer name -> (values (M, D) parameter, rows (T,) int64 ascending, grad (T, D) float32 averaged
    over ranks, valid (T,) bool: rows marked False pad the selection, were not read and do not move); empty for
    the ablations, whose masked dense value gradients are the values' ``.grad``, and for a dense step
    (``smf train``'s retrofit, lora and full recipes: every gradient is a ``.grad``).
    ``names``: parameter -> its name in the model (for errors). ``selected``: layer name -> (T',) int64 rows the
    step updates (ascending).
    """

    tables: dict[str, tuple[nn.Parameter, torch.Tensor, torch.Tensor, torch.Tensor]]
    names: dict[int, str]
    selected: dict[str, torch.Tensor]
    process_group: Any = None
    world: int = 1
    applied: bool = field(default=False, init=False)  # set by apply once it finished the step: it does so once
    discarded: bool = field(default=False, init=False)  # set by discard (abort_step): apply is refused

    def nonfinite(self, parameters: Iterable[torch.Tensor]) -> list[str]:
        """Names of the parameters whose gradient (a value table's: its rows') holds inf or NaN on any rank."""
        named = [(self.names.get(id(p), "a parameter"), _local_grad(p)[0]) for p in parameters if p.grad is not None]
        named += [(f"{name}.values" if name else "values", grad) for name, (_, _, grad, _) in self.tables.items()]
        return step_checks.nonfinite_names(named, self.process_group, self.world)

    def clip_(self, parameters: Iterable[torch.Tensor], max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(total norm, clipping coefficient) of the gradients of ``parameters`` together with the rows' (a
        sharded table's column shard and an FSDP shard counting as the whole parameter); the parameters' gradients
        are scaled in place, the rows' are not: the coefficient scales them as they step. ``max_norm``: a number
        > 0 (inf: no clipping); NaN, a negative or a non-number is refused before anything is scaled."""
        max_norm = check_max_norm(max_norm)
        with_grad = [p for p in parameters if p.grad is not None]
        if any(p.grad.is_sparse for p in with_grad):
            raise RuntimeError("a sparse .grad in a sparse step: the exact update keeps the rows' gradient compact")
        parts = [_local_grad(p) for p in with_grad]
        parts += [(grad, shard_of(values) if is_split(values) else None)
                  for values, _, grad, _ in self.tables.values()]
        total, coef = norm_and_clip_coefficient([grad for grad, _ in parts], max_norm,
                                                shards=[shard for _, shard in parts])
        for grad, _ in parts[:len(with_grad)]:
            grad.mul_(coef.to(grad.dtype))
        return total, coef

    def apply(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None,
              nonfinite: str = "raise") -> StepResult:
        """The finishing sequence (see the module docstring): check every gradient of the step for inf / NaN,
        clip all of them to ``max_grad_norm`` (None: no clipping) with the rows' in the norm, step ``optimizer``
        (the parameters with a ``.grad``, then each layer's selected rows: a :class:`RowSparseAdamW` or
        :class:`RowSparseSGD` when there are rows) and zero its gradients.

        A non-finite gradient drops every gradient of ``optimizer``'s parameters (nothing moves), then raises
        :class:`~smf_kernels.sparse.step_checks.NonFiniteGradientError` (``nonfinite="raise"``) or returns a
        skipped :class:`StepResult` (``"skip"``); either way the step is over. Refused before anything changes (the
        step can then be finished by a call that is right): a bad ``max_grad_norm``, an optimizer without
        ``step_rows`` when there are rows, one that does not hold a value table, a group's hyper-parameter out of
        range (the optimizer's ``check_groups()``), a second call (the rows would step twice), and gradients
        :meth:`discard`-ed.
        """
        max_grad_norm = None if max_grad_norm is None else check_max_norm(max_grad_norm)
        nonfinite = step_checks.check_nonfinite_option(nonfinite)
        if self.discarded:
            raise step_checks.StepMisuseError("these RowGradients were discarded by abort_step(): their step is "
                                              "over; begin_step() starts the next one")
        if self.applied:
            raise step_checks.StepMisuseError("these RowGradients were applied already: each step's gradients "
                                              "finish it once (end_step() returns a step's)")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._check_optimizer(optimizer, params)
        bad = self.nonfinite(params)
        if bad:  # the step is over either way: its gradients are dropped
            self.applied = True
            for param in params:
                param.grad = None
            step_checks.handle_nonfinite(bad, nonfinite)
            return StepResult({name: rows[:0] for name, rows in self.selected.items()}, None, True)
        total, coef = (None, None) if max_grad_norm is None else self.clip_(params, max_grad_norm)
        optimizer.step()  # the parameters with a .grad (e.g. alpha; an ablation's values); the rows have none
        for values, rows, grad, valid in self.tables.values():
            optimizer.step_rows(values, rows, grad, grad_scale=coef, valid=valid)
        optimizer.zero_grad(set_to_none=True)
        self.applied = True
        return StepResult(self.selected, total, False)

    def _check_optimizer(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        """Everything :meth:`apply` needs of ``optimizer`` (``params``: its parameters), checked before anything
        moves: a ``step_rows`` when there are rows (TypeError), every value table among its parameters and its
        groups' hyper-parameters in range (``check_groups()``, where the optimizer has one) (ValueError)."""
        if self.tables and not hasattr(optimizer, "step_rows"):
            raise TypeError("the sparse update needs an optimizer with step_rows (RowSparseAdamW or RowSparseSGD), "
                            f"got {type(optimizer).__name__}; nothing was changed: apply these gradients with one")
        held = {id(p) for p in params}
        missing = [f"{name}.values" if name else "values" for name, (values, _, _, _) in self.tables.items()
                   if id(values) not in held]
        if missing:
            raise ValueError(f"the optimizer does not hold {', '.join(missing)}; nothing was changed: apply these "
                             "gradients with an optimizer over the value tables")
        check_groups(optimizer)

    def discard(self) -> None:
        """Drop these gradients unapplied (what :meth:`MemoryStep.abort_step` does with an ended step's): a later
        :meth:`apply` is refused. The gradients of parameters outside the value tables (``.grad``) are the
        caller's: ``optimizer.zero_grad()``."""
        if not self.applied:
            self.discarded = True


class MemoryStep:
    """What every sparse step over the value rows of ``model``'s ProductKeyMemory layers shares: read counting,
    the background statistics and the top-T selection, the step's gradient sinks (each update makes its own,
    :meth:`_make_sink`), the misuse checks, :meth:`abort_step`, and the protocol of the module docstring
    (:meth:`plan`, :meth:`begin_step`, :meth:`after_forward`, :meth:`end_step`, :meth:`finish_step`). The exact
    update (:class:`SparseMemoryController`) and the ablations (:mod:`smf_kernels.sparse.ablations`) are its
    kinds; each makes its sink, its ``end_step`` and, if it needs one, its ``after_forward``.

    Args:
        model: any nn.Module; its ProductKeyMemory submodules are found with ``named_modules()`` and named by
            module path.
        rule: "tfidf" or "kl" (docs/method.md#slot-selection).
        rows_per_step: T, rows selected per layer per optimizer step; None (the default): the paper's share of
            each memory's slots, 512 of 16,384 (:func:`~smf_kernels.sparse.selection.default_rows_per_step`).
        background: statistics for these memories (or collect them later with :meth:`collect_background`, or
            assign with :meth:`set_background`).
        nonfinite: "raise" (the default: :class:`~smf_kernels.sparse.step_checks.NonFiniteGradientError` naming
            the parameters, nothing stepped) or "skip" (the step is dropped and counted in
            :attr:`skipped_steps`) when a gradient of a step holds inf or NaN.
        process_group: group to reduce counts and gradients over; None = the default group when
            torch.distributed is initialised with world size > 1.
    """

    FILLS: tuple[str, ...] = (READS_KEPT,)  # the fills this kind of step can run

    def __init__(self, model: nn.Module, *, rule: str = "tfidf", rows_per_step: int | None = None,
                 background: BackgroundStats | None = None, nonfinite: str = "raise",
                 process_group: Any = None) -> None:
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        if rows_per_step is not None and (isinstance(rows_per_step, bool) or not isinstance(rows_per_step, int)
                                          or rows_per_step < 1):
            raise ValueError(f"rows_per_step must be a positive int or None, got {rows_per_step!r}")
        self.model = model
        self.memories = memories_of(model)
        self.rule, self.rows_per_step = rule, rows_per_step
        self.nonfinite = step_checks.check_nonfinite_option(nonfinite)
        if rows_per_step is None:
            self.layer_rows = {name: default_rows_per_step(m.num_slots) for name, m in self.memories.items()}
            shares = {f"{rows} of {m.num_slots}" for rows, m in zip(self.layer_rows.values(), self.memories.values())}
            logger.info("rows_per_step: T = %s slots per layer (the default: the paper's share, 512 of 16,384)",
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
        self._background_on: dict[tuple[str, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
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
        self._background_on = {}

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
        raise NotImplementedError

    def finish_step(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None
                    ) -> dict[str, torch.Tensor]:
        """:meth:`end_step`, then the finishing sequence (:meth:`RowGradients.apply` with this step's
        ``nonfinite``; a skipped step is counted in :attr:`skipped_steps`). A refused call (misuse, a bad norm,
        an optimizer that does not hold the values or cannot step rows) changes nothing.

        Returns:
            layer name -> (T',) int64 rows the step updated (ascending); empty rows for every layer when the step
            was skipped (``nonfinite="skip"``).
        """
        max_grad_norm = None if max_grad_norm is None else check_max_norm(max_grad_norm)
        self._check_can_end("finish_step")
        self._check_optimizer(optimizer)
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [f"{name}.values" for name, m in self.memories.items() if id(m.values) not in held]
        if missing:
            raise ValueError(f"the optimizer does not hold {', '.join(missing)}")
        check_groups(optimizer)
        result = self.end_step().apply(optimizer, max_grad_norm=max_grad_norm, nonfinite=self.nonfinite)
        self.skipped_steps += result.skipped
        return result.selected

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """TypeError when ``optimizer`` cannot run this kind's update (the ablations step any optimizer)."""

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

    def _background_tensors(self, name: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``name``'s background (doc_freq, reads) on ``device``: the statistics live on the CPU, copied
        once per device (begin_step makes the copies, so a backward that selects mutates nothing)."""
        key = (name, device)
        if key not in self._background_on:
            self._background_on[key] = (self.background.doc_freq[name].to(device),
                                        self.background.reads[name].to(device))
        return self._background_on[key]

    def _padded_selection(self, name: str, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows (T,) ascending, valid (T,) bool): the step's selection at a fixed size, no host sync."""
        doc_freq, reads = self._background_tensors(name, counts.device)
        scores = score_slots(self.rule, counts, doc_freq, reads, self.background.num_batches[name])
        return select_rows_padded(scores, counts, self.layer_rows[name])

    def _step_counts(self) -> dict[str, torch.Tensor]:
        """Each layer's (M,) int64 read counts of the whole step, summed over ranks (one all_reduce)."""
        names = list(self.memories)
        packed = torch.cat([self.memories[name].read_counts for name in names])
        self._all_reduce_sum(packed)
        return dict(zip(names, packed.split([self.memories[name].num_slots for name in names])))


class SparseMemoryController(MemoryStep):
    """The exact update: selects and updates the value rows of every ProductKeyMemory in ``model`` (see the
    module docstring); its arguments are :class:`MemoryStep`'s. Fills: both."""

    FILLS = FILLS

    def begin_step(self, fill: str | FillPlan = READS_KEPT) -> None:
        """:meth:`MemoryStep.begin_step` (both fills)."""
        super().begin_step(fill)
        self._selected = False

    def _make_sink(self, name: str, values: nn.Parameter, fill: str) -> RowGradSink:
        chooser = None
        if fill == ROWS_FIRST:
            self._background_tensors(name, values.device)  # made now: a backward that selects mutates nothing
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

    def end_step(self) -> RowGradients:
        """:meth:`MemoryStep.end_step`: select the rows from the step's counts (unless selected before the
        backward), compute their gradient (reads kept: summed now) and average it over ranks."""
        self._check_can_end("end_step")
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

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if not hasattr(optimizer, "step_rows"):
            raise TypeError("the sparse update needs an optimizer with step_rows (RowSparseAdamW or RowSparseSGD), "
                            f"got {type(optimizer).__name__}")

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
