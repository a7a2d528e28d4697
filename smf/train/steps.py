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
from smf_kernels.sparse.fill import Fill, plan_fill


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
    """Every trainable parameter steps: clip the global gradient norm (``clip``, torch's by default), step, zero
    the gradients."""

    clip = staticmethod(torch.nn.utils.clip_grad_norm_)

    def finish_step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> None:
        self.clip([p for group in optimizer.param_groups for p in group["params"]], max_grad_norm)
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
    """The exact sparse update (``--update exact``, :class:`SparseMemoryController`), each step filled as
    :func:`smf_kernels.sparse.fill.plan_fill` decides from its micro-batches, ``compiled``, the processes
    (``world``) and the most tokens a step holds on a process (``step_tokens``: global batch / processes x max
    length, a bound every process shares). A counting forward runs ``model`` without grad, under the trainer's
    ``autocast``. ``rows_moved_outside`` is 0 by construction (tests/test_sparse_exact.py), so no copy of the
    tables is made.
    """

    def __init__(self, controller: SparseMemoryController, autocast, compiled: bool = False, world: int = 1,
                 step_tokens: int | None = None) -> None:
        self.controller, self.autocast, self.compiled, self.world = controller, autocast, compiled, world
        self.step_tokens = step_tokens
        self.slots = min(memory.num_slots for memory in controller.memories.values())
        self.rows: dict[str, torch.Tensor] = {}
        self._fill = Fill(rows_first=False)

    def begin_step(self, model: nn.Module, micro_batches: list[dict]) -> None:
        self._fill = plan_fill(len(micro_batches), compiled=self.compiled, world=self.world,
                               step_tokens=self.step_tokens, slots=self.slots)
        self.controller.begin_step(select_before_backward=self._fill.rows_first)
        if self._fill.counting_forward:
            with torch.no_grad(), self.autocast():
                for batch in micro_batches:
                    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            self.controller.select_rows()

    def after_forward(self) -> None:
        if self._fill.select_after_forward:
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
