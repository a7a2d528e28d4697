"""What a recipe does around the trainer's forwards, backwards and optimizer step.

The trainer's step (:func:`smf.train.loop.run_step`) is the same for every recipe::

    hooks.begin_step(model, micro_batches)
    for batch in micro_batches:
        loss = forward(batch); hooks.after_forward(); loss.backward()
    hooks.finish_step(optimizer, max_grad_norm); scheduler.step()

:class:`DenseStep` (retrofit, lora, full) clips and steps; :class:`SparseStep` drives a
:class:`SparseMemoryController` (the exact update: rows selected once per step from all its micro-batches,
docs/method.md#the-sparse-update-exact-default-and-the-authors-ablation) and :class:`AblationStep` the
dense-masked or the authors' update (:mod:`smf_kernels.sparse.ablations`).
"""
from __future__ import annotations

import torch
from torch import nn

from smf.model.precision import bf16_enabled
from smf.errors import ConfigError
from smf_kernels.sparse import (AuthorsSparseUpdate, DenseMaskedUpdate, NonFiniteGradientError,
                                 SparseMemoryController, rows_moved_outside)


def bf16_autocast(setting: str, device: torch.device):
    """The trainer's autocast as a no-argument context factory: bf16 when ``setting`` is 'on', or 'auto' on
    a CUDA device that supports bf16 (:func:`smf.model.precision.bf16_enabled`); else a no-op."""
    enabled = bf16_enabled(setting, device)
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


class StepHooks:
    """What a recipe does at each point of the trainer's step (see the module docstring)."""

    def ddp_ignored_names(self) -> list[str]:
        """Parameter and buffer names DDP must leave alone."""
        return []

    def begin_step(self, model: nn.Module, micro_batches: list[dict]) -> None:
        """Before the step's first forward; ``model`` unwrapped, ``micro_batches`` this rank's."""

    def after_forward(self) -> None:
        """Between a micro-batch's forward and its backward."""

    def finish_step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> None:
        """After the step's last backward: clip, step and zero the gradients."""
        raise NotImplementedError

    def step_log(self) -> dict:
        """Fields this recipe adds to the step's row of train_log.jsonl."""
        return {}


class DenseStep(StepHooks):
    """Every trainable parameter steps: clip the global gradient norm, step, zero the gradients."""

    def finish_step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]],
                                       max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _diverged(err: NonFiniteGradientError) -> ConfigError:
    return ConfigError(f"training diverged: the step's gradient of {', '.join(err.names)} holds inf or NaN (nothing "
                       "was updated); lower --lr or --max-grad-norm, or check the data")


class _RowUpdateStep(StepHooks):
    """A step whose ``controller`` selects and updates value rows: the rows it updated are kept for the log, and
    a non-finite gradient ends the run with one line."""

    controller: SparseMemoryController | DenseMaskedUpdate | AuthorsSparseUpdate
    rows: dict[str, torch.Tensor]

    def ddp_ignored_names(self) -> list[str]:
        return self.controller.ddp_ignored_names()  # the controller reduces the memory values itself

    def finish_step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> None:
        try:
            self.rows = self.controller.finish_step(optimizer, max_grad_norm=max_grad_norm)
        except NonFiniteGradientError as err:
            raise _diverged(err) from None

    def step_log(self) -> dict:
        return {"selected_rows": sum(int(rows.numel()) for rows in self.rows.values()),
                "rows_moved_outside": self.rows_moved_outside()}

    def rows_moved_outside(self) -> int:
        return 0


class SparseStep(_RowUpdateStep):
    """The exact sparse update (``--update exact``, :class:`SparseMemoryController`). How the rows' gradient is
    filled (docs/method.md#what-sparse-means): one micro-batch selects between its forward and its backward (a
    compiled step: its backward chooses from the counts). Under accumulation the backwards keep their reads (no
    second forward) unless a step can hold more tokens on a rank (``step_tokens``: global batch / processes x max
    length) than the smallest memory has slots, or the step is compiled: a no-grad forward of every micro-batch
    (``model``, under the trainer's ``autocast``) then counts first and the backwards write only the T rows.
    ``rows_moved_outside`` is 0 by construction (tests/test_sparse_exact.py), so no copy of the tables is made.
    """

    kept_reads_per_slot = 1  # kept reads while a step can hold at most this many tokens per slot on a rank

    def __init__(self, controller: SparseMemoryController, autocast, compiled: bool = False,
                 step_tokens: int | None = None) -> None:
        self.controller, self.autocast, self.compiled = controller, autocast, compiled
        slots = min(memory.num_slots for memory in controller.memories.values())
        # decided once, from a bound every rank shares (ranks that chose differently would deadlock in DDP)
        self.count_first = compiled or (step_tokens is not None and step_tokens > self.kept_reads_per_slot * slots)
        self.rows: dict[str, torch.Tensor] = {}
        self._select_after_forward = False

    def begin_step(self, model: nn.Module, micro_batches: list[dict]) -> None:
        single = len(micro_batches) == 1
        count_first = not single and self.count_first
        self.controller.begin_step(select_before_backward=single or count_first)
        self._select_after_forward = single and not self.compiled
        if count_first:
            with torch.no_grad(), self.autocast():
                for batch in micro_batches:
                    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            self.controller.select_rows()

    def after_forward(self) -> None:
        if self._select_after_forward:
            self.controller.select_rows()


class AblationStep(_RowUpdateStep):
    """An ablation of the exact update (``--update dense_masked``: :class:`DenseMaskedUpdate`; ``--update
    authors``, one process: :class:`AuthorsSparseUpdate`, rows chosen after each micro-batch's forward). Logs
    the value rows that moved without being selected, from a copy of the tables made at each step's start."""

    def __init__(self, update: DenseMaskedUpdate | AuthorsSparseUpdate) -> None:
        self.controller = update
        self._before: dict[str, torch.Tensor] = {}  # layer -> (M, D) values at the start of the step
        self.rows: dict[str, torch.Tensor] = {}

    def begin_step(self, model: nn.Module, micro_batches: list[dict]) -> None:
        self._before = {name: memory.values.detach().clone() for name, memory in self.controller.memories.items()}
        self.controller.begin_step()

    def after_forward(self) -> None:
        self.controller.after_forward()

    def rows_moved_outside(self) -> int:
        after = {name: memory.values.detach() for name, memory in self.controller.memories.items()}
        return rows_moved_outside(self._before, after, self.rows)
