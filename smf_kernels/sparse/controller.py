"""SparseMemoryController: per-step row selection and sparse updates for any model
holding :class:`ProductKeyMemory` layers.

How one optimizer step works (mode "row_sparse", the default):

1. ``begin_step()`` zeroes every memory's ``read_counts``, turns read counting
   on, and sets each memory's update rows to ``ROWS_READ``: every forward routes
   the value gradient to the distinct slots it reads (``torch.unique``, one host
   sync per micro-batch and layer). So every backward writes a compact sparse
   COO gradient holding just the rows the micro-batch read — never a dense
   (M, D) buffer — and autograd sums these sparse gradients across
   micro-batches ("compact accumulation"). A hook coalesces the summed gradient
   after each backward, so it never holds more than the R <= M distinct rows
   the step has read so far. R approaches M for large batches (every slot gets
   read), so this gradient can be nearly as large as a dense one; what stays
   sparse is the update (T rows) below.

   ``begin_step(select_before_backward=True)`` does better: forwards only record
   reads, ``select_rows()`` (after them, before any backward) picks the step's
   rows from its counts, and every backward writes only those T rows (via
   :class:`~smf_kernels.ops.DeferredRows`). For a step of one micro-batch this is
   free; under accumulation the caller first runs a no-grad forward over every
   micro-batch (counting only), then the usual forward + backward passes
   (read counting is off after ``select_rows()``).

   ``begin_step(defer_value_gradients=True)`` needs neither the extra forward nor a
   gradient of the rows read: backwards write no value gradient, they keep their
   reads (:class:`~smf_kernels.ops.ReadLog`), and the step's end sums the reads of
   the rows it selects (what ``smf train`` and ``SparseMemoryTrainer`` do).

   ``fused=True`` (the fused update) keeps the selected rows' gradient a compact
   (T, D) tensor instead of a COO ``.grad`` and steps it with
   ``RowSparseAdamW.step_rows`` (clipped in two phases: the norm over every
   gradient of the step first, then the update); with ``select_before_backward``
   and no ``select_rows()`` call the backward chooses the rows from the counts
   itself, which is what a torch.compile'd step runs.
2. The user runs forward/backward for each micro-batch as usual. Read counts
   exclude padding when the model passes ``valid_mask`` to the memories, so
   padding never steers selection; the hook's rows include every position read
   (padding too), so the gradients of the rows finally selected are exact.
3. ``finish_step(optimizer)`` sums the step's counts over all ranks (one
   all_reduce), scores them with the rule and background statistics and picks
   the top ``min(T, #read)`` rows per layer — the same rows on every rank, from
   the counts of the whole optimizer step. It then copies only those rows of the
   accumulated gradient into a (T, D) buffer that is all-reduced and averaged over
   ranks (the DDP convention), hands it to the optimizer as a coalesced sparse
   gradient, optionally clips, steps, zeroes gradients and resets counts.

Data parallelism: do not let DDP synchronise the memory values (sparse
gradients do not go through DDP's reducer) nor the ``read_counts`` buffers
(DDP broadcasts buffers from rank 0 before every forward, which would replace
each rank's counts with rank 0's): before wrapping the model, call
``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model,
controller.ddp_ignored_names())``. The controller reduces counts and the
selected rows' gradients itself over ``process_group`` (default: the world
group whenever torch.distributed is initialised with more than one rank).

Mode "dense_masked" reproduces the original SMF code for comparison (see
:mod:`smf_kernels.sparse.dense_masked`): dense value gradients, masked to the
selected rows at the step, to be used with torch.optim.AdamW.

Limitation: activation checkpointing that re-runs a memory's forward during
backward would count that micro-batch's reads twice.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from smf_kernels._precision import accumulation_dtype
from smf_kernels._rows import row_to_slot_map
from smf_kernels.memory import ROWS_READ, ProductKeyMemory
from smf_kernels.ops import CompactRows, DeferredRows, ReadLog
from smf_kernels.sharded.layout import gradient_copies, is_split, shard_of
from smf_kernels.sparse.background import BackgroundStats
from smf_kernels.sparse.clipping import clip_grad_norm_, norm_and_clip_coefficient
from smf_kernels.sparse.dense_masked import mask_grad_rows_
from smf_kernels.sparse.selection import RULES, score_slots, select_rows_padded, select_top_rows, warn_if_not_sparse

logger = logging.getLogger(__name__)

MODES = ("row_sparse", "dense_masked")


def _default_forward(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, Mapping) else model(batch)


def _dense_grad_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"{name} has a dense gradient, made by a backward outside a step (a forward of the memory run before "
        "begin_step() or after finish_step()); in row_sparse mode every forward whose backward reaches the values "
        "must run inside a step. Drop it (optimizer.zero_grad(set_to_none=True)) before begin_step()")


def _coalesce_grad_hook(name: str):
    """Post-accumulate-grad hook: keep the summed sparse gradient at <= M rows across micro-batches
    (sparse + sparse may concatenate entries instead of merging them)."""
    def coalesce(param: torch.Tensor) -> None:
        if not param.grad.is_sparse:  # a dense gradient was there before the step's first backward
            raise _dense_grad_error(name)
        param.grad = param.grad.coalesce()
    return coalesce


class _RowsFromCounts(CompactRows):
    """A fused step's rows, chosen before its backward: by :meth:`SparseMemoryController.select_rows` (from the
    counts summed over ranks), or else by the backward itself, from this process's counts of the step: a
    fixed-size selection with no host sync, which torch.compile traces into the backward graph."""

    def __init__(self, controller: "SparseMemoryController", name: str) -> None:
        super().__init__()
        self._controller, self._name = controller, name

    def rows_for_backward(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.rows is not None:
            return self.rows, self.valid
        if self._controller._world() > 1:
            raise RuntimeError("under torch.distributed every rank must select the same rows: call "
                               "controller.select_rows() between the step's forwards and its backward")
        memory = self._controller.memories[self._name]
        return self._controller._padded_selection(self._name, memory.read_counts)


class SparseMemoryController:
    """Selects and updates the value rows of every ProductKeyMemory in ``model`` (see module docstring).

    Args:
        model: any nn.Module; its ProductKeyMemory submodules are found with
            ``named_modules()`` and named by module path.
        rule: "tfidf" or "kl" (docs/method.md#slot-selection).
        rows_per_step: T, rows selected per layer per optimizer step.
        background: statistics for these memories (or collect them later with
            :meth:`collect_background`, or assign with :meth:`set_background`).
        mode: "row_sparse" (sparse gradients; use :class:`RowSparseAdamW`) or
            "dense_masked" (dense masked gradients; torch.optim.AdamW).
        fused: mode "row_sparse" only: the fused update. The values never get a ``.grad`` (no sparse COO
            tensor): each step's (T, D) row gradients stay compact and :meth:`finish_step` hands them to the
            :class:`RowSparseAdamW` directly (``step_rows``: one pass per row on the ext and triton backends),
            clipped with the global norm of every gradient of the step (a two-phase update: the rows'
            gradients are complete when the step ends, then the norm, then the update). With
            ``begin_step(select_before_backward=True, optimizer=...)`` and no clipping, the backward
            updates the rows itself.
        process_group: group to reduce counts and gradients over; None = the
            default group when torch.distributed is initialised with world size > 1.
    """

    def __init__(self, model: nn.Module, *, rule: str = "tfidf", rows_per_step: int = 512,
                 background: BackgroundStats | None = None, mode: str = "row_sparse",
                 process_group: Any = None, fused: bool = False) -> None:
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(rows_per_step, bool) or not isinstance(rows_per_step, int) or rows_per_step < 1:
            raise ValueError(f"rows_per_step must be a positive int, got {rows_per_step!r}")
        self.model = model
        self.memories = {name: module for name, module in model.named_modules()
                         if isinstance(module, ProductKeyMemory)}
        if not self.memories:
            raise ValueError("model holds no ProductKeyMemory module")
        if fused and mode != "row_sparse":
            raise ValueError(f"fused=True is the fused row-sparse update: it needs mode 'row_sparse', got {mode!r}")
        self.rule, self.rows_per_step, self.mode, self.fused = rule, rows_per_step, mode, bool(fused)
        warn_if_not_sparse({name: m.num_slots for name, m in self.memories.items()}, rows_per_step)
        self.process_group = process_group
        self.background: BackgroundStats | None = None
        self._hooks: list = []
        self._in_step = False
        self._deferred: dict[str, DeferredRows] | None = None
        self._logs: dict[str, ReadLog] | None = None
        self._selected: dict[str, torch.Tensor] | None = None
        # fused: layer -> (rows (T,), their gradient (T, D), valid (T,) bool or None)
        self._row_grads: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self._background_on: dict[tuple[str, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self._updated_in_backward = False
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
    @torch.no_grad()
    def collect_background(self, batches: Iterable, *, forward: Callable[[nn.Module, Any], Any] | None = None,
                           max_batches: int | None = None) -> BackgroundStats:
        """Count reads over ``batches`` (model in eval mode, one batch = one document) and use the result.

        Each batch should hold a single example (the paper's batch size 1), so
        that ``df`` counts documents. ``forward(model, batch)`` runs the model
        (default ``model(**batch)`` for mappings, else ``model(batch)``). Under
        torch.distributed, every rank counts its own batches and the totals are
        summed across ranks.
        """
        if self._in_step:
            raise RuntimeError("collect_background cannot run between begin_step() and finish_step()")
        forward = forward or _default_forward
        stats = BackgroundStats.for_memories(self.memories)
        was_training = self.model.training
        self.model.eval()
        for memory in self.memories.values():
            memory.set_update_rows(None)
            memory.set_read_counting(True)
        try:
            total = max_batches if max_batches is not None else (len(batches) if hasattr(batches, "__len__") else None)
            for index, batch in enumerate(tqdm(batches, total=total, desc="background statistics")):
                if max_batches is not None and index >= max_batches:
                    break
                for memory in self.memories.values():
                    memory.reset_read_counts()
                forward(self.model, batch)
                for name, memory in self.memories.items():
                    stats.add_batch(name, memory.read_counts)
        finally:
            for memory in self.memories.values():
                memory.set_read_counting(False)
                memory.reset_read_counts()
            self.model.train(was_training)
        if self._world() > 1:
            for name, memory in self.memories.items():
                device = memory.read_counts.device
                packed = torch.cat([stats.doc_freq[name], stats.reads[name],
                                    torch.tensor([stats.num_batches[name]])]).to(device)
                self._all_reduce_sum(packed)
                packed = packed.cpu()
                num_slots = memory.num_slots
                stats.doc_freq[name] = packed[:num_slots].clone()
                stats.reads[name] = packed[num_slots:2 * num_slots].clone()
                stats.num_batches[name] = int(packed[-1])
        logger.info("background statistics from %d batches", next(iter(stats.num_batches.values())))
        self.set_background(stats)
        return stats

    # ------------------------------------------------------------ train steps
    def begin_step(self, *, select_before_backward: bool = False, defer_value_gradients: bool = False,
                   optimizer: torch.optim.Optimizer | None = None) -> None:
        """Start an optimizer step: zero counts, count reads, route value gradients.

        select_before_backward: call :meth:`select_rows` between the step's forwards and its first
            backward, so every backward writes only the selected rows (a step of one micro-batch, or
            micro-batches whose reads a no-grad forward has counted first). With ``fused=True`` in one
            process, the backward may select them itself instead (no call, no host sync: what a compiled
            model does); it takes T rows, those not read marked invalid.
        defer_value_gradients: backwards write no value gradient; they keep their reads
            (:class:`~smf_kernels.ops.ReadLog`) and the step's end computes the selected rows' gradient
            from them. Rows come from every micro-batch's reads without a second forward.
        optimizer: with ``fused=True`` and ``select_before_backward``: the :class:`RowSparseAdamW`
            that the backward updates the selected rows with, directly (the step cannot clip then).
        Without either option, every backward writes the rows its micro-batch read (``ROWS_READ``)
        and the step keeps the selected ones.
        """
        if self.background is None:
            raise RuntimeError("no background statistics: pass background=, call set_background() "
                               "or collect_background() first")
        if self._in_step:
            raise RuntimeError("begin_step() called twice without finish_step(); if a forward or backward of the "
                               "step raised, call abort_step() to discard it first")
        if select_before_backward and defer_value_gradients:
            raise ValueError("choose one of select_before_backward and defer_value_gradients")
        if optimizer is not None and not (self.fused and select_before_backward):
            raise ValueError("optimizer= updates the rows inside the backward: it needs fused=True and "
                             "select_before_backward=True")
        if optimizer is not None and any(is_split(m.values) for m in self.memories.values()):
            raise ValueError("optimizer= (the update inside the backward) does not take sharded memories yet: the "
                             "step's rows are updated by finish_step instead (do not pass optimizer=)")
        if (select_before_backward or defer_value_gradients) and self.mode != "row_sparse":
            raise ValueError(f"select_before_backward and defer_value_gradients need mode 'row_sparse', "
                             f"got {self.mode!r}")
        for name, memory in self.memories.items():
            if not memory.values.requires_grad:
                raise RuntimeError(f"{name}.values does not require grad; nothing to train")
            grad = memory.values.grad
            if self.mode == "row_sparse" and grad is not None and not grad.is_sparse:
                raise _dense_grad_error(f"{name}.values")
        self._deferred = None
        if select_before_backward:
            self._deferred = {name: _RowsFromCounts(self, name) if self.fused else DeferredRows()
                              for name in self.memories}
            if self.fused:  # what the backward writes into or reads, made now: it then mutates no Python state
                for name, handle in self._deferred.items():
                    values = self.memories[name].values
                    handle.zero_grad(values, min(self.rows_per_step, values.shape[0]))
                    self._background_tensors(name, values.device)
            if optimizer is not None:
                for handle in self._deferred.values():
                    handle.apply_with(optimizer)
        self._logs = {name: ReadLog() for name in self.memories} if defer_value_gradients else None
        self._updated_in_backward = optimizer is not None
        self._selected = None
        self._row_grads = {}
        for name, memory in self.memories.items():
            memory.reset_read_counts()
            memory.set_read_counting(True)
            if self.mode == "dense_masked":
                memory.set_update_rows(None)
            elif self._logs is not None:
                memory.set_update_rows(self._logs[name])
            else:
                memory.set_update_rows(self._deferred[name] if self._deferred is not None else ROWS_READ)
                if not self.fused:  # sparse .grad tensors, summed over micro-batches
                    self._hooks.append(memory.values.register_post_accumulate_grad_hook(
                        _coalesce_grad_hook(f"{name}.values")))
        self._in_step = True

    def abort_step(self) -> None:
        """Discard the step in progress, e.g. after one of its forwards or backwards raised: its read counts,
        its gradient routing, the memories' value gradients and the rows' gradients held for the fused update
        (partial sums that belong to this step alone) are dropped, and the next :meth:`begin_step` starts afresh.
        Gradients of other parameters are the caller's (``optimizer.zero_grad()``); rows a backward already
        updated (``begin_step(optimizer=...)``) stay updated. A no-op when no step is in progress::

            controller.begin_step()
            try:
                ...  # the step's forwards and backwards
            except BaseException:
                controller.abort_step()
                raise
            controller.finish_step(optimizer)
        """
        if not self._in_step:
            return
        self._end_step()
        if self._logs is not None:
            for log in self._logs.values():
                log.clear()
        self._deferred = self._selected = self._logs = None
        self._row_grads, self._updated_in_backward = {}, False
        for memory in self.memories.values():
            memory.reset_read_counts()
            memory.values.grad = None

    def select_rows(self) -> dict[str, torch.Tensor]:
        """Select this step's rows now, from the counts of the forward just run (see begin_step).

        Returns:
            layer name -> (T',) int64 selected rows (ascending), T' = min(T, #read).
        """
        if not self._in_step or self._deferred is None:
            raise RuntimeError("select_rows() needs begin_step(select_before_backward=True) first")
        if self._selected is not None:
            raise RuntimeError("select_rows() was already called in this step")
        counts = self._step_counts()
        self._selected = {}
        for name, handle in self._deferred.items():
            if self.fused:
                rows, valid = self._padded_selection(name, counts[name])
                handle.set(rows, valid)
                self._selected[name] = rows[valid]
            else:
                self._selected[name] = select_top_rows(self._scores(name, counts[name]), counts[name],
                                                       self.rows_per_step)
                handle.set(self._selected[name])
            self.memories[name].set_read_counting(False)  # the step's selection is made
        return self._selected

    def _background_tensors(self, name: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``name``'s background (doc_freq, reads) on ``device``: the statistics live on the CPU, copied
        once per device (begin_step makes the copies, so a backward that selects mutates nothing)."""
        key = (name, device)
        if key not in self._background_on:
            self._background_on[key] = (self.background.doc_freq[name].to(device),
                                        self.background.reads[name].to(device))
        return self._background_on[key]

    def _scores(self, name: str, counts: torch.Tensor) -> torch.Tensor:
        """(M,) float64 scores of layer ``name``'s slots for the step's ``counts`` (M,) int64, by the rule."""
        doc_freq, reads = self._background_tensors(name, counts.device)
        return score_slots(self.rule, counts, doc_freq, reads, self.background.num_batches[name])

    def _padded_selection(self, name: str, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows (T,) ascending, valid (T,) bool): the step's selection at a fixed size, no host sync."""
        return select_rows_padded(self._scores(name, counts), counts, self.rows_per_step)

    def _select(self, counts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: select_top_rows(self._scores(name, counts[name]), counts[name], self.rows_per_step)
                for name in self.memories}

    @property
    def in_step(self) -> bool:
        """True between :meth:`begin_step` and the end of the step (:meth:`restrict_gradients` or
        :meth:`finish_step`)."""
        return self._in_step

    def restrict_gradients(self) -> dict[str, torch.Tensor]:
        """End the step's forwards and backwards: select rows from the step's counts and restrict
        every memory's value gradient to them, without touching the optimizer.

        After this, ``values.grad`` holds exactly the selected rows (a coalesced sparse COO
        tensor in mode "row_sparse", a masked dense tensor in "dense_masked"), averaged over
        ranks; read counting and update rows are off and the counts are zeroed. The caller then
        clips (:func:`~smf_kernels.sparse.clip_grad_norm_`), steps and zeroes the gradients itself,
        e.g. inside another training loop (:class:`smf_kernels.hf.SparseMemoryTrainer`). With
        ``fused=True`` the values get no ``.grad``: :attr:`row_gradients` holds each layer's rows and
        their (T, D) gradient, for :meth:`apply_row_gradients`.

        Returns:
            layer name -> (T',) int64 selected rows (ascending), T' = min(T, #read).
        """
        if not self._in_step:
            raise RuntimeError("the step was not begun: call begin_step() before its forwards")
        fused_handles = self._deferred is not None and self.fused
        if self._deferred is not None and self._selected is None and not fused_handles:
            raise RuntimeError("begin_step(select_before_backward=True) needs select_rows() before the backward")
        self._end_step()
        if fused_handles:  # the rows the backwards used (chosen by select_rows, or by the backward itself)
            chosen = {name: handle.rows_for_backward() for name, handle in self._deferred.items()}
        else:
            picked = self._selected if self._selected is not None else self._select(self._step_counts())
            chosen = {name: (rows, None) for name, rows in picked.items()}
        selected = {name: rows if valid is None else rows[valid] for name, (rows, valid) in chosen.items()}
        for name, memory in self.memories.items():
            rows, valid = chosen[name]
            if self.mode == "dense_masked":
                self._restrict_dense_grad(memory.values, rows)
            elif not self._updated_in_backward:
                compact = self._average_over_ranks(memory.values,
                                                   self._rows_gradient(name, memory.values, rows))
                if self.fused:
                    self._row_grads[name] = (rows, compact, valid)
                else:  # the nn.Embedding(sparse=True) convention: a coalesced COO gradient of T rows
                    memory.values.grad = torch.sparse_coo_tensor(
                        rows.unsqueeze(0), compact.to(memory.values.dtype), memory.values.shape,
                        is_coalesced=True, check_invariants=False)
        for memory in self.memories.values():
            memory.reset_read_counts()
        if self._logs is not None:
            for log in self._logs.values():
                log.clear()
        return selected

    @property
    def row_gradients(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """``fused=True``, after :meth:`restrict_gradients`: layer name -> (rows (T,) int64 ascending, their
        gradient (T, D) float32 averaged over ranks, valid (T,) bool or None: rows marked False were not read
        and do not move). Empty until then, and after the update."""
        return dict(self._row_grads)

    def clip_with_row_gradients_(self, parameters: Iterable[torch.Tensor],
                                 max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``fused=True``, after :meth:`restrict_gradients`: (total norm, clipping coefficient) of the gradients
        of ``parameters`` together with :attr:`row_gradients` (a sharded table's shard counting as the whole
        table), the parameters' gradients scaled by the coefficient in place. The rows' gradients are not
        scaled here: pass the coefficient to :meth:`apply_row_gradients` (the second phase of the update)."""
        with_grad = [p for p in parameters if p.grad is not None]
        if any(p.grad.is_sparse for p in with_grad):
            raise RuntimeError("a sparse .grad in a fused step: the fused update keeps row gradients compact")
        tables = [self.memories[name].values for name in self._row_grads]
        grads = [p.grad for p in with_grad] + [grad for _, grad, _ in self._row_grads.values()]
        total, coef = norm_and_clip_coefficient(
            grads, max_norm, shards=[shard_of(p) if is_split(p) else None for p in with_grad + tables])
        for param in with_grad:
            param.grad.mul_(coef.to(param.grad.dtype))
        return total, coef

    def apply_row_gradients(self, optimizer: torch.optim.Optimizer,
                            grad_scale: torch.Tensor | None = None) -> None:
        """``fused=True``: update each layer's selected rows from :attr:`row_gradients` (times ``grad_scale``,
        e.g. a clipping coefficient) with ``optimizer``, a :class:`RowSparseAdamW` holding the values."""
        if not hasattr(optimizer, "step_rows"):
            raise TypeError(f"the fused update needs a RowSparseAdamW (step_rows), got {type(optimizer).__name__}")
        for name, (rows, compact, valid) in self._row_grads.items():
            optimizer.step_rows(self.memories[name].values, rows, compact, grad_scale=grad_scale, valid=valid)
        self._row_grads = {}

    def finish_step(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None
                    ) -> dict[str, torch.Tensor]:
        """:meth:`restrict_gradients`, then clip, step and zero the gradients.

        Clips all gradients of ``optimizer``'s parameters to ``max_grad_norm``
        (sparse-aware) when given, calls ``optimizer.step()`` and
        ``optimizer.zero_grad(set_to_none=True)``.

        Returns:
            layer name -> (T',) int64 selected rows (ascending), T' = min(T, #read).
        """
        if not self._in_step:
            raise RuntimeError("finish_step() called without begin_step()")
        if self._updated_in_backward and max_grad_norm is not None:
            raise RuntimeError("the backward already updated the rows (begin_step(optimizer=...)): the step cannot "
                               "clip; pass max_grad_norm=None, or do not pass optimizer= to begin_step")
        selected = self.restrict_gradients()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not self.fused:
            if max_grad_norm is not None:
                clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
        else:
            coef = None if max_grad_norm is None else self.clip_with_row_gradients_(params, max_grad_norm)[1]
            optimizer.step()  # the parameters with a .grad (e.g. alpha); the values have none
            self.apply_row_gradients(optimizer, grad_scale=coef)
        optimizer.zero_grad(set_to_none=True)
        return selected

    def _end_step(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for memory in self.memories.values():
            memory.set_read_counting(False)
            memory.set_update_rows(None)
        self._in_step = False

    def _step_counts(self) -> dict[str, torch.Tensor]:
        """Each layer's (M,) int64 read counts of the whole step, summed over ranks (one all_reduce)."""
        names = list(self.memories)
        packed = torch.cat([self.memories[name].read_counts for name in names])
        self._all_reduce_sum(packed)
        return dict(zip(names, packed.split([self.memories[name].num_slots for name in names])))

    def _rows_gradient(self, name: str, values: nn.Parameter, rows: torch.Tensor) -> torch.Tensor:
        """(T, D) gradient of this rank's step for rows ``rows`` ((T,) sorted), in the accumulation dtype:
        from the kept reads (deferred), the backwards' compact sums (selected before the backward) or the
        sparse ``.grad`` of the rows read (ROWS_READ)."""
        dtype = accumulation_dtype(values.dtype)
        # A column shard's read sums every rank's tokens; its gradient through the autograd is averaged over the
        # group (smf_kernels.sharded), the kept or compact ones here are averaged the same way.
        group = shard_of(values).size if is_split(values) else 1
        if self._logs is not None:
            return self._logs[name].rows_gradient(values, rows).div_(group)
        if self._deferred is not None and isinstance(self._deferred[name], CompactRows):
            return self._deferred[name].grad.div_(group)  # zeroed by begin_step, added into by the backwards
        grad = values.grad
        if grad is not None and not grad.is_sparse:
            raise RuntimeError("values.grad is dense in row_sparse mode; was a forward run outside "
                               "begin_step()/finish_step()?")
        values.grad = None
        compact = torch.zeros(rows.numel(), values.shape[1], dtype=dtype, device=values.device)
        if grad is not None:
            slots = row_to_slot_map(rows, values.shape[0])[grad._indices()[0]]  # also valid when uncoalesced
            hits = (slots >= 0).nonzero().squeeze(1)  # host sync; only selected rows' entries are added
            compact.index_add_(0, slots[hits], grad._values().index_select(0, hits).to(dtype))
        return compact

    def _average_over_ranks(self, values: nn.Parameter, compact: torch.Tensor) -> torch.Tensor:
        """``compact`` (a gradient of rows of ``values``) averaged over the data-parallel ranks, in place. A column
        shard's gradient (smf_kernels.sharded) is averaged over its group by the sharded read already."""
        world = gradient_copies(values, self._world())
        if world > 1:
            self._all_reduce_sum(compact)
            compact.div_(world)
        return compact

    def _restrict_dense_grad(self, values: nn.Parameter, rows: torch.Tensor) -> None:
        if values.grad is None:
            values.grad = torch.zeros_like(values)
        world = gradient_copies(values, self._world())
        if world > 1:
            self._all_reduce_sum(values.grad)
            values.grad.div_(world)
        mask_grad_rows_(values, rows)
