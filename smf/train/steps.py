"""What a recipe does around the trainer's forwards, backwards and optimizer step.

The trainer's step (:func:`smf.train.loop.run_step`) is the same for every recipe::

    hooks.begin_step(model, micro_batches)
    for batch in micro_batches:
        loss = forward(batch); hooks.after_forward(); loss.backward()
    hooks.finish_step(optimizer, max_grad_norm=max_grad_norm); scheduler.step()

``after_forward()`` is the sparse step's own (:class:`smf_kernels.sparse.MemoryStep`); ``begin_step`` also takes
the model and the micro-batches, from which the step plans its fill and runs its counting forward
(:meth:`MemoryStep.begin <smf_kernels.sparse.MemoryStep.begin>`).

:class:`DenseStep` (retrofit, lora, full) checks, clips and steps; :class:`MemoryUpdateStep` drives a
:class:`~smf_kernels.sparse.MemoryStep` of any ``--update`` kind (the exact update or an ablation,
:mod:`smf_kernels.sparse.updates`), its log's row measurements a :class:`RowChangeLog` watching it. Every step
ends in the one finishing sequence
(:meth:`smf_kernels.sparse.RowGradients.apply`: non-finite check, clip, step, zero), the dense one with no rows.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from smf.model.precision import bf16_enabled
from smf.errors import ConfigError
from smf_kernels.sparse import MemoryStep, NonFiniteGradientError, RowGradients, StepObserver, rows_moved_outside


def bf16_autocast(setting: str, device: torch.device):
    """The trainer's autocast as a no-argument context factory: bf16 when ``setting`` is 'on', or 'auto' on
    a CUDA device that supports bf16 (:func:`smf.model.precision.bf16_enabled`); else a no-op."""
    enabled = bf16_enabled(setting, device)
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


class StepHooks:
    """What a recipe does at each point of the trainer's step (see the module docstring)."""

    def begin_step(self, model: nn.Module, micro_batches: list[dict]) -> None:
        """Before the step's first forward; ``model`` unwrapped, ``micro_batches`` this rank's."""

    def after_forward(self) -> None:
        """Between a micro-batch's forward and its backward."""

    def finish_step(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float) -> None:
        """After the step's last backward: clip, step and zero the gradients."""
        raise NotImplementedError

    def step_log(self) -> dict:
        """Fields this recipe adds to the step's row of train_log.jsonl."""
        return {}


NORM_CHUNK_ROWS = 1 << 16  # rows of a table whose norms are taken at once (a 1M x 896 bf16 table: 16 chunks)


def row_norms(values: torch.Tensor) -> torch.Tensor:
    """(M,) float32 norms of the rows of an (M, D) table, :data:`NORM_CHUNK_ROWS` rows at a time: a float32 norm of a
    whole 16-bit table would first make a float32 copy of it (3.5 GiB for 1M x 896)."""
    return torch.cat([torch.linalg.vector_norm(part, dim=1, dtype=torch.float32)
                      for part in values.split(NORM_CHUNK_ROWS)])


def _diverged(err: NonFiniteGradientError) -> ConfigError:
    return ConfigError(f"training diverged: the step's gradient of {', '.join(err.names)} holds inf or NaN (nothing "
                       "was updated); lower --lr or --max-grad-norm, or check the data")


class DenseStep(StepHooks):
    """Every trainable parameter steps, through the sparse steps' finishing sequence with no rows
    (:meth:`smf_kernels.sparse.RowGradients.apply`): a non-finite gradient on any process ends the run with one
    line (nothing updated), the global norm is clipped (a sharded memory's column shard and an FSDP shard counting
    as the whole parameter), the optimizer steps, the gradients are zeroed."""

    def __init__(self) -> None:
        self._names: dict[int, str] = {}

    def begin_step(self, model: nn.Module, micro_batches: list[dict]) -> None:
        self._names = {id(p): name for name, p in model.named_parameters()}  # for a non-finite gradient's line

    def finish_step(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float) -> None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        try:
            RowGradients({}, self._names, {}, world=world).apply(optimizer, max_grad_norm=max_grad_norm)
        except NonFiniteGradientError as err:
            raise _diverged(err) from None


class MemoryUpdateStep(StepHooks):
    """The sparse recipe's step, for every ``--update``: ``update`` (a :class:`~smf_kernels.sparse.MemoryStep`)
    begins each step (:meth:`~smf_kernels.sparse.MemoryStep.begin`: its fill planned from its micro-batches,
    ``compiled`` and the most tokens a step holds on a process, ``step_tokens``: global batch / processes x max
    length, a bound every process shares), with the counting forward the plan asks for (``model`` without grad,
    under the trainer's ``autocast``), and finishes it (:meth:`~smf_kernels.sparse.MemoryStep.finish`). The rows it
    updated are kept for the log; a non-finite gradient ends the run with one line. The log's row measurements
    are a :class:`RowChangeLog` watching the step."""

    def __init__(self, update: MemoryStep, autocast, compiled: bool = False, world: int = 1,
                 step_tokens: int | None = None) -> None:
        self.update, self.autocast, self.compiled, self.step_tokens = update, autocast, compiled, step_tokens
        self.log = update.observe(RowChangeLog(update, world))

    def begin_step(self, model: nn.Module, micro_batches: list[dict]) -> None:
        def counting_forward() -> None:
            with self.autocast():
                for batch in micro_batches:
                    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])

        self.update.begin(len(micro_batches), counting_forward, compiled=self.compiled, step_tokens=self.step_tokens)

    def after_forward(self) -> None:
        self.update.after_forward()

    def finish_step(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float) -> None:
        try:
            self.log.rows = self.update.finish(optimizer, max_grad_norm=max_grad_norm).selected
        except NonFiniteGradientError as err:
            raise _diverged(err) from None

    @property
    def rows(self) -> dict[str, torch.Tensor]:
        """Layer name -> (T',) int64 rows the latest step updated."""
        return self.log.rows

    def step_log(self) -> dict:
        return self.log.fields()


class RowChangeLog(StepObserver):
    """What a sparse step's row of train_log.jsonl says about its rows, watching ``step`` (a
    :class:`~smf_kernels.sparse.MemoryStep`): ``selected_rows``, the rows it updated (:attr:`rows`, set by the
    trainer); ``rows_moved_outside``, for a kind that steps whole tables (an ablation), the value rows that moved
    without being selected (from a copy of the tables made as each step begins; the exact update's is 0 by
    construction, tests/test_sparse_exact.py); and, on one process, ``row_change``: the median over the step's
    updated rows (all layers) of the row's change relative to its norm before the step,
    ||v_after - v_before|| / ||v_before|| (from that copy of the tables, or, for the exact update, which copies no
    table, from the T rows each table is about to step: :meth:`before_rows`), and ``row_change_vs_start``: the
    same change relative to the row's norm when this process started training (the norms at its first step; a
    resumed run's are its resumption's)."""

    def __init__(self, step: MemoryStep, world: int = 1) -> None:
        self.memories, self.world = step.memories, world
        self.rows: dict[str, torch.Tensor] = {}
        self._before: dict[str, torch.Tensor] = {}  # layer -> (M, D) values at the start of the step (ablations)
        self._stepped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(values) -> (rows, their values before)
        self._start_norms: dict[str, torch.Tensor] = {}  # layer -> (M,) row norms at the first step

    def began(self, step: MemoryStep) -> None:
        if not step.update.rows:  # the whole tables step: keep them to see which rows moved
            self._before = {name: memory.values.detach().clone() for name, memory in self.memories.items()}
        if self.world == 1 and not self._start_norms:
            self._start_norms = {name: row_norms(memory.values.detach()) for name, memory in self.memories.items()}
        self._stepped = {}

    def before_rows(self, values: nn.Parameter, rows: torch.Tensor) -> None:
        """Keep the (T, D) rows of ``values`` about to step (for :meth:`row_change`: T rows copied, never a whole
        table), on one process."""
        if self.world == 1:
            self._stepped[id(values)] = (rows, values.detach().index_select(0, rows))

    def fields(self) -> dict:
        return {"selected_rows": sum(int(rows.numel()) for rows in self.rows.values()),
                "rows_moved_outside": self.rows_moved_outside(), **self.row_change()}

    def row_change(self) -> dict:
        """``{"row_change", "row_change_vs_start"}``: the median relative change of the rows this step updated, to
        their norm before the step and at the first step, on one process (none updated: 0.0); empty on several,
        whose tables are sharded."""
        if self.world != 1 or not (self._before or self._stepped):
            return {}
        changes, vs_start = [], []
        for name, rows in self.rows.items():
            table = self.memories[name].values  # the parameter the optimizer stepped (its id keys _stepped)
            values = table.detach()
            if self._before:
                before = self._before[name].index_select(0, rows).float()
            elif id(table) in self._stepped:  # the rows the optimizer stepped, ascending: those updated among them
                stepped, kept = self._stepped[id(table)]
                before = kept.index_select(0, torch.searchsorted(stepped, rows)).float()
            else:
                continue
            change = (values.index_select(0, rows).float() - before).norm(dim=1)
            changes.append(change / before.norm(dim=1).clamp_min(1e-12))
            vs_start.append(change / self._start_norms[name].index_select(0, rows).clamp_min(1e-12))
        changes, vs_start = (torch.cat(parts) if parts else torch.zeros(0) for parts in (changes, vs_start))
        return {"row_change": float(changes.median()) if changes.numel() else 0.0,
                "row_change_vs_start": float(vs_start.median()) if vs_start.numel() else 0.0}

    def rows_moved_outside(self) -> int:
        if not self._before:
            return 0
        after = {name: memory.values.detach() for name, memory in self.memories.items()}
        return rows_moved_outside(self._before, after, self.rows)
