"""What a recipe does around the trainer's forwards, backwards and optimizer step.

The trainer's step (:func:`smf.train.loop.run_step`) is the same for every recipe::

    hooks.begin_step(model, micro_batches)
    for batch in micro_batches:
        loss = forward(batch); hooks.after_forward(); loss.backward()
    hooks.finish_step(optimizer, max_grad_norm=max_grad_norm); scheduler.step()

``after_forward()`` and ``finish_step(optimizer, *, max_grad_norm)`` are the sparse steps' own
(:class:`smf_kernels.sparse.MemoryStep`); ``begin_step`` also takes the model and the micro-batches, from which
the hooks plan the step's fill and run its counting forward (the library's ``begin_step`` takes the planned fill).

:class:`DenseStep` (retrofit, lora, full) clips and steps; :class:`MemoryUpdateStep` drives any
:class:`~smf_kernels.sparse.MemoryStep` (``--update``: the exact update, :class:`SparseMemoryController`, or an
ablation, :mod:`smf_kernels.sparse.ablations`), whose steps all end in the one finishing sequence
(:meth:`smf_kernels.sparse.RowGradients.apply`).
"""
from __future__ import annotations

import torch
from torch import nn

from smf.model.precision import bf16_enabled
from smf.errors import ConfigError
from smf_kernels.sparse import MemoryStep, NonFiniteGradientError, SparseMemoryController, rows_moved_outside
from smf_kernels.sparse.controller import FillPlan


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

    def finish_step(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float) -> None:
        """After the step's last backward: clip, step and zero the gradients."""
        raise NotImplementedError

    def step_log(self) -> dict:
        """Fields this recipe adds to the step's row of train_log.jsonl."""
        return {}


class DenseStep(StepHooks):
    """Every trainable parameter steps: clip the global gradient norm (``clip``, torch's by default), step, zero
    the gradients."""

    clip = staticmethod(torch.nn.utils.clip_grad_norm_)

    def finish_step(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float) -> None:
        self.clip([p for group in optimizer.param_groups for p in group["params"]], max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _diverged(err: NonFiniteGradientError) -> ConfigError:
    return ConfigError(f"training diverged: the step's gradient of {', '.join(err.names)} holds inf or NaN (nothing "
                       "was updated); lower --lr or --max-grad-norm, or check the data")


class MemoryUpdateStep(StepHooks):
    """The sparse recipe's step, for every ``--update``: ``update`` (a :class:`~smf_kernels.sparse.MemoryStep`)
    plans each step's fill (:meth:`~smf_kernels.sparse.MemoryStep.plan`, from its micro-batches, ``compiled``,
    the processes ``world`` and the most tokens a step holds on a process, ``step_tokens``: global batch /
    processes x max length, a bound every process shares), begins it, runs the counting forward the plan asks
    for (``model`` without grad, under the trainer's ``autocast``), and finishes it with ``finish_step``. The
    rows it updated are kept for the log; a non-finite gradient ends the run with one line. An ablation's log also
    counts the value rows that moved without being selected (from a copy of the tables made at each step's
    start); the exact update's is 0 by construction (tests/test_sparse_exact.py), so no copy is made."""

    def __init__(self, update: MemoryStep, autocast, compiled: bool = False, world: int = 1,
                 step_tokens: int | None = None) -> None:
        self.update, self.autocast, self.compiled, self.world = update, autocast, compiled, world
        self.step_tokens = step_tokens
        self.rows: dict[str, torch.Tensor] = {}
        self._measure_leak = not isinstance(update, SparseMemoryController)
        self._before: dict[str, torch.Tensor] = {}  # layer -> (M, D) values at the start of the step (ablations)

    def ddp_ignored_names(self) -> list[str]:
        return self.update.ddp_ignored_names()  # the update reduces the memory values itself

    def begin_step(self, model: nn.Module, micro_batches: list[dict]) -> None:
        if self._measure_leak:
            self._before = {name: memory.values.detach().clone() for name, memory in self.update.memories.items()}
        plan: FillPlan = self.update.plan(len(micro_batches), compiled=self.compiled, world=self.world,
                                          step_tokens=self.step_tokens)
        self.update.begin_step(plan)
        if plan.counting_forward:
            with torch.no_grad(), self.autocast():
                for batch in micro_batches:
                    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            self.update.select_rows()

    def after_forward(self) -> None:
        self.update.after_forward()

    def finish_step(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float) -> None:
        try:
            self.rows = self.update.finish_step(optimizer, max_grad_norm=max_grad_norm)
        except NonFiniteGradientError as err:
            raise _diverged(err) from None

    def step_log(self) -> dict:
        return {"selected_rows": sum(int(rows.numel()) for rows in self.rows.values()),
                "rows_moved_outside": self.rows_moved_outside()}

    def rows_moved_outside(self) -> int:
        if not self._measure_leak:
            return 0
        after = {name: memory.values.detach() for name, memory in self.update.memories.items()}
        return rows_moved_outside(self._before, after, self.rows)
