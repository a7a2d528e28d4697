"""What a recipe does around the trainer's forwards, backwards and optimizer step.

The trainer's step (:func:`smf.train.loop.run_step`) is the same for every recipe::

    hooks.begin_step(model, micro_batches)
    for batch in micro_batches:
        loss = forward(batch); hooks.after_forward(); loss.backward()
    hooks.finish_step(optimizer, max_grad_norm); scheduler.step()

:class:`DenseStep` (retrofit, lora, full) clips and steps; :class:`SparseStep` drives a
:class:`SparseMemoryController` (rows selected once per step from all its micro-batches,
docs/method.md#the-sparse-update-exact-default-and-the-authors-ablation) and :class:`AuthorsStep` the
authors' update (:class:`AuthorsSparseUpdate`, rows selected after every micro-batch's forward).
"""
from __future__ import annotations

import torch
from torch import nn

from smf.model.precision import bf16_enabled
from smf_kernels.sparse import AuthorsSparseUpdate, SparseMemoryController, rows_moved_outside


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


class _MemoryRows(StepHooks):
    """Shared by the sparse updates: the rows selected in a step and the value rows moved without being
    selected, for train_log.jsonl."""

    def __init__(self, controller: SparseMemoryController | AuthorsSparseUpdate) -> None:
        self.controller = controller
        self._before: dict[str, torch.Tensor] = {}  # layer -> (M, D) values at the start of the step
        self.rows: dict[str, torch.Tensor] = {}  # layer -> (T,) int64 rows selected in the last step

    def _snapshot(self) -> None:
        self._before = {name: memory.values.detach().clone() for name, memory in self.controller.memories.items()}

    def finish_step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> None:
        self.rows = self.controller.finish_step(optimizer, max_grad_norm=max_grad_norm)

    def step_log(self) -> dict:
        after = {name: memory.values.detach() for name, memory in self.controller.memories.items()}
        return {"selected_rows": sum(int(rows.numel()) for rows in self.rows.values()),
                "rows_moved_outside": rows_moved_outside(self._before, after, self.rows)}


class SparseStep(_MemoryRows):
    """This project's exact sparse update (``--optimizer row_sparse`` or ``dense_masked``).

    Rows are picked before the backward when they can be, so that the backward writes only the T selected
    value rows: at once for a step of one micro-batch; under gradient accumulation with
    ``sparse_backward="selected-rows"`` (row_sparse only) after a no-grad forward over every micro-batch
    that only counts reads (under ``autocast``, the trainer's bf16 context; ``model`` is the one the trainer
    runs, compiled or not). With ``rows_in_backward`` (a compiled step, fused update) a step of one
    micro-batch lets its backward choose the rows from the counts. ``"deferred"`` instead keeps
    every backward's reads and computes the selected rows' gradients at the step's end (no second forward);
    ``"read-rows"`` lets every backward write the rows its micro-batch read.
    """

    def __init__(self, controller: SparseMemoryController, sparse_backward: str, autocast,
                 rows_in_backward: bool = False) -> None:
        super().__init__(controller)
        self.sparse_backward, self.autocast = sparse_backward, autocast
        # a compiled step of one micro-batch: the fused backward selects the rows itself (no host sync)
        self.rows_in_backward = rows_in_backward and controller.fused
        self._select_after_forward = False

    def ddp_ignored_names(self) -> list[str]:
        return self.controller.ddp_ignored_names()  # the controller reduces the memory values itself

    def begin_step(self, model: nn.Module, micro_batches: list[dict]) -> None:
        self._snapshot()
        single = len(micro_batches) == 1
        row_sparse = self.controller.mode == "row_sparse"
        count_first = not single and self.sparse_backward == "selected-rows" and row_sparse
        deferred = not single and self.sparse_backward == "deferred" and row_sparse
        self.controller.begin_step(select_before_backward=single or count_first, defer_value_gradients=deferred)
        self._select_after_forward = single and not self.rows_in_backward
        if count_first:
            with torch.no_grad(), self.autocast():
                for batch in micro_batches:
                    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            self.controller.select_rows()

    def after_forward(self) -> None:
        if self._select_after_forward:
            self.controller.select_rows()


class AuthorsStep(_MemoryRows):
    """The authors' update (``--optimizer authors``, one process): rows chosen after each micro-batch's
    forward from its own counts (padding included), each backward masked, dense AdamW."""

    def begin_step(self, model: nn.Module, micro_batches: list[dict]) -> None:
        self._snapshot()
        self.controller.begin_step()

    def after_forward(self) -> None:
        self.controller.after_forward()

