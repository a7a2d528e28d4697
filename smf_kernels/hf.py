"""Sparse Memory Finetuning inside the Hugging Face ``transformers.Trainer`` loop.

:class:`SparseMemoryTrainer` is a ``Trainer`` whose optimizer steps are SMF steps driven by a
:class:`~smf_kernels.sparse.SparseMemoryController`: the Trainer keeps its own loop (gradient
accumulation, LR schedulers, logging, checkpoints, ``resume_from_checkpoint``); the controller
picks each step's rows and restricts the memory value gradients to them. Example (README,
"Training with the Hugging Face Trainer")::

    controller = SparseMemoryController(model, rule="tfidf", rows_per_step=512)
    controller.collect_background(background_batches)
    trainer = SparseMemoryTrainer(model=model, args=TrainingArguments(...), train_dataset=data,
                                  controller=controller)
    trainer.train()

Needs ``transformers`` (not a dependency of smf_kernels).
"""
from __future__ import annotations

import copy
import logging

import torch
from transformers import Trainer, TrainerCallback

from smf_kernels.sparse.clipping import clip_grad_norm_
from smf_kernels.sparse.controller import SparseMemoryController
from smf_kernels.sparse.row_sparse_adamw import RowSparseAdamW

logger = logging.getLogger(__name__)


class _RestoreSparseGradients(TrainerCallback):
    """Hands the restricted sparse value gradients back just before the optimizer steps."""

    def __init__(self, trainer: "SparseMemoryTrainer") -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        for param, grad in self.trainer._held_gradients.items():
            param.grad = grad
        self.trainer._held_gradients = {}
        if self.trainer.controller.fused:  # the value rows step here, at the optimizer's learning rate of this step
            optimizer = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)  # accelerate's wrapper
            self.trainer.controller.apply_row_gradients(optimizer, grad_scale=self.trainer._row_grad_scale)


class SparseMemoryTrainer(Trainer):
    """``transformers.Trainer`` training the memories of a model with Sparse Memory Finetuning.

    Args:
        *args, **kwargs: as ``transformers.Trainer``. The model's trainable parameters should be
            the memory values (plus, e.g., the additive+s ``alpha``; see
            ``smf.model.configure_trainable(model, "sparse")``).
        controller: a :class:`SparseMemoryController` over the same model, with its background
            statistics set (``collect_background`` / ``set_background``).

    Per optimizer step: the first micro-batch's ``training_step`` calls
    ``controller.begin_step(defer_value_gradients=True)`` (backwards keep their reads; no second
    forward); after the last micro-batch's backward,
    ``controller.restrict_gradients()`` selects the step's rows (from the reads of every
    micro-batch of the step) and restricts the value gradients to them; then all gradients are
    clipped to ``args.max_grad_norm`` with the sparse-aware
    :func:`~smf_kernels.sparse.clip_grad_norm_` and the Trainer steps its optimizer and scheduler.
    The Trainer's own clipping is switched off (``self.args.max_grad_norm`` is 0 in the copy of
    the arguments this trainer keeps; the value given is ``self.sparse_max_grad_norm``) and the
    logged ``grad_norm`` is the sparse-aware total norm before clipping.

    With a ``fused=True`` controller the value rows' gradients stay compact (no COO ``.grad``): their norm
    joins the global norm, and the rows are updated right before the optimizer steps the other parameters.
    With ``TrainingArguments(torch_compile=True)`` the controller must be fused and a step one micro-batch
    (``gradient_accumulation_steps=1``) in one process: the backward then chooses the rows from the step's
    counts itself, and the compiled model has no graph break.

    Without ``optimizers=``, mode "row_sparse" builds a :class:`RowSparseAdamW` from the
    arguments (learning_rate, adam betas / epsilon, weight_decay); mode "dense_masked" keeps the
    Trainer's default optimizer. ``last_selected_rows`` holds the rows of the latest step
    (layer name -> (T',) int64); the training logs add ``selected_rows`` (rows updated per step, all
    memories together, averaged over the steps since the last log) and ``selected_fraction`` (that
    over the memories' value rows: the update's density). fp16 mixed precision (a gradient scaler) is
    not supported; use bf16 or fp32. Gradient checkpointing is refused when the trainer is built: every
    step counts memory reads, and a re-run forward would count them twice. A micro-batch whose
    forward or backward raises discards its step
    (:meth:`~smf_kernels.sparse.SparseMemoryController.abort_step`), so ``train()`` can be called again.
    Checkpoints are the Trainer's: the controller holds no training state.
    """

    def __init__(self, *args, controller: SparseMemoryController, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(controller, SparseMemoryController):
            raise TypeError(f"controller must be a SparseMemoryController, got {type(controller).__name__}")
        if self.args.fp16:
            raise ValueError("SparseMemoryTrainer does not support fp16 (its gradient scaler); use bf16 or fp32")
        if self.args.torch_compile and not (controller.fused and self.args.gradient_accumulation_steps == 1
                                            and self.args.world_size == 1):
            raise ValueError("torch_compile=True needs SparseMemoryController(..., fused=True), "
                             "gradient_accumulation_steps=1 and one process: the compiled backward then chooses "
                             "the rows from the step's counts (a sparse COO gradient cannot be compiled)")
        requested = getattr(self.args, "activation_checkpointing", None) or self.args.gradient_checkpointing
        checkpointed = any(getattr(module, "gradient_checkpointing", False) is True for module in self.model.modules())
        if requested or checkpointed:
            raise ValueError("SparseMemoryTrainer counts memory reads in every step, and gradient (activation) "
                             "checkpointing would re-run each forward in the backward and count them twice: leave "
                             "it off in TrainingArguments and call model.gradient_checkpointing_disable()")
        self.controller = controller
        self.sparse_max_grad_norm = self.args.max_grad_norm
        self.args = copy.copy(self.args)
        self.args.max_grad_norm = 0.0  # clipping happens in training_step, where sparse gradients are understood
        self.last_selected_rows: dict[str, torch.Tensor] = {}
        self._held_gradients: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._sparse_grad_norm: float | None = None
        self._row_grad_scale: torch.Tensor | None = None
        self._total_rows = sum(memory.num_slots for memory in controller.memories.values())
        self._rows_since_log, self._steps_since_log = 0, 0
        self.add_callback(_RestoreSparseGradients(self))

    def create_optimizer(self, model=None):
        if self.optimizer is None and self.controller.mode == "row_sparse":
            params = [p for p in (model or self.model).parameters() if p.requires_grad]
            self.optimizer = RowSparseAdamW(params, lr=self.args.learning_rate,
                                            betas=(self.args.adam_beta1, self.args.adam_beta2),
                                            eps=self.args.adam_epsilon, weight_decay=self.args.weight_decay)
            return self.optimizer
        return super().create_optimizer(model)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self.controller.in_step:  # rows from every micro-batch's reads, no second forward (or, compiled,
            compiled = bool(self.args.torch_compile)  # chosen by the backward itself)
            self.controller.begin_step(select_before_backward=compiled,
                                       defer_value_gradients=not compiled and self.controller.mode == "row_sparse")
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        except BaseException:  # the step is lost: the next training_step begins a fresh one
            self.controller.abort_step()
            raise
        if self.accelerator.sync_gradients:  # the step's last micro-batch: the Trainer steps next
            self._end_smf_step()
        return loss

    def _end_smf_step(self) -> None:
        self.last_selected_rows = self.controller.restrict_gradients()
        self._rows_since_log += sum(int(rows.numel()) for rows in self.last_selected_rows.values())
        self._steps_since_log += 1
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        max_norm = self.sparse_max_grad_norm if self.sparse_max_grad_norm and self.sparse_max_grad_norm > 0 \
            else float("inf")
        if self.controller.fused:  # one norm over the rows' compact gradients and every other gradient
            total, self._row_grad_scale = self.controller.clip_with_row_gradients_(params, max_norm)
            self._sparse_grad_norm = float(total)
            return
        self._sparse_grad_norm = float(clip_grad_norm_(params, max_norm))
        # torch's clip_grad_norm_ (which the Trainer calls for its grad_norm) cannot read sparse gradients:
        # hold them until the optimizer step (_RestoreSparseGradients).
        self._held_gradients = {p: p.grad for p in self.controller.value_parameters()
                                if p.grad is not None and p.grad.is_sparse}
        for param in self._held_gradients:
            param.grad = None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "grad_norm" in logs and self._sparse_grad_norm is not None:
            logs["grad_norm"] = self._sparse_grad_norm
        if "loss" in logs and self._steps_since_log:  # a training log
            rows = self._rows_since_log / self._steps_since_log
            logs["selected_rows"] = rows
            logs["selected_fraction"] = rows / self._total_rows
            self._rows_since_log, self._steps_since_log = 0, 0
        super().log(logs, start_time)
