"""Sparse Memory Finetuning inside the Hugging Face ``transformers.Trainer`` loop.

:class:`SparseMemoryTrainer` is a ``Trainer`` whose optimizer steps are SMF steps driven by a
:class:`~smf_kernels.sparse.SparseMemoryController`: the Trainer keeps its own loop (gradient
accumulation, LR schedulers, logging, checkpoints, ``resume_from_checkpoint``); the controller plans, begins and
ends each step (``begin`` / ``after_forward`` / ``finish``, as ``smf train`` drives it,
:class:`~smf_kernels.sparse.MemoryStep`), its finishing sequence right before the Trainer's optimizer step.
Example (README, "Training with the Hugging Face Trainer")::

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
import re

import torch
from transformers import Trainer, TrainerCallback

from smf_kernels.fsdp import average_gradients
from smf_kernels.patch import MemoryPatch
from smf_kernels.sparse.fill_plan import check_one_process
from smf_kernels.sparse.memory_step import SparseMemoryController
from smf_kernels.sparse.row_sparse_adamw import RowSparseAdamW

logger = logging.getLogger(__name__)


class _FinishSparseStep(TrainerCallback):
    """Finishes the step (:meth:`SparseMemoryTrainer._finish_smf_step`) just before the Trainer's optimizer step,
    at this step's learning rate (the Trainer's scheduler steps after the optimizer)."""

    def __init__(self, trainer: "SparseMemoryTrainer") -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._finish_smf_step()


class SparseMemoryTrainer(Trainer):
    """``transformers.Trainer`` training the memories of a model with Sparse Memory Finetuning.

    Args:
        *args, **kwargs: as ``transformers.Trainer``. The model's trainable parameters should be
            the memory values (plus, e.g., the additive+s ``alpha``; see
            ``smf.model.configure_trainable(model, "sparse")``).
        controller: a :class:`SparseMemoryController` over the same model, with its background
            statistics set (``collect_background`` / ``set_background``).

    Per optimizer step, through the controller's ``begin`` / ``after_forward`` / ``finish``
    (:class:`~smf_kernels.sparse.MemoryStep`, as ``smf train`` drives it): the first micro-batch's
    ``training_step`` begins the step with the fill it plans
    (:func:`smf_kernels.sparse.plan_fill`: one micro-batch: rows first, selected between its forward and
    backward; under gradient accumulation: reads kept, no second forward); right before the Trainer's optimizer
    step, the controller ends the step (the selected rows' compact (T, D) gradient) and finishes it as ``smf train``
    does (:meth:`RowGradients.finish <smf_kernels.sparse.RowGradients.finish>`): every gradient of the step
    is checked for inf / NaN (the controller's ``nonfinite``: raise, or skip the step: no parameter moves), the
    rows' gradients join the global norm, which clips everything to ``args.max_grad_norm``, the optimizer steps
    the other parameters and the rows, and the gradients are zeroed (so the Trainer's own optimizer step then
    finds none). The values never get a ``.grad``, so the Trainer's own clipping (switched off: ``self.args.
    max_grad_norm`` is 0 in the copy of the arguments this trainer keeps; the value given is
    ``self.sparse_max_grad_norm``) sees nothing it cannot read, and the logged ``grad_norm`` is the norm of
    every gradient of the step before clipping.

    With ``TrainingArguments(torch_compile=True)`` a step must be one micro-batch
    (``gradient_accumulation_steps=1``) in one process: the backward then chooses the rows from the step's
    counts itself, and the compiled model has no graph break.

    Without ``optimizers=``, a :class:`RowSparseAdamW` is built from the arguments (learning_rate, adam betas /
    epsilon, weight_decay). ``last_selected_rows`` holds the rows of the latest step (layer name -> (T',)
    int64); the training logs add ``selected_rows`` (rows updated per step, all memories together, averaged
    over the steps since the last log) and ``selected_fraction`` (that over the memories' value rows: the
    update's density). fp16 mixed precision (a gradient scaler) is not supported; use bf16 or fp32. Gradient
    checkpointing is refused when the trainer is built: every step counts memory reads, and a re-run forward
    would count them twice. A micro-batch whose forward or backward raises discards its step
    (:meth:`~smf_kernels.sparse.SparseMemoryController.abort_step`), so ``train()`` can be called again.
    Checkpoints are the Trainer's (under accelerate's FSDP2 too, docs/sharding.md): the controller holds no
    training state.
    """

    def __init__(self, *args, controller: SparseMemoryController, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(controller, SparseMemoryController):
            raise TypeError(f"controller must be a SparseMemoryController (the exact update), got "
                            f"{type(controller).__name__}")
        if self.args.fp16:
            raise ValueError("SparseMemoryTrainer does not support fp16 (its gradient scaler); use bf16 or fp32")
        check_one_process(self.args.torch_compile, self.args.world_size, subject="torch_compile=True")
        if self.args.torch_compile and self.args.gradient_accumulation_steps != 1:
            raise ValueError("torch_compile=True needs gradient_accumulation_steps=1: the compiled backward then "
                             "chooses the rows from the step's counts")
        requested = getattr(self.args, "activation_checkpointing", None) or self.args.gradient_checkpointing
        checkpointed = any(getattr(module, "gradient_checkpointing", False) is True for module in self.model.modules())
        if requested or checkpointed:
            raise ValueError("SparseMemoryTrainer counts memory reads in every step, and gradient (activation) "
                             "checkpointing would re-run each forward in the backward and count them twice: leave "
                             "it off in TrainingArguments and call model.gradient_checkpointing_disable()")
        self.controller = controller
        self._outside_fsdp = self._keep_out_of_fsdp2()
        self.sparse_max_grad_norm = self.args.max_grad_norm
        self.args = copy.copy(self.args)
        self.args.max_grad_norm = 0.0  # clipping happens in training_step, with the rows' compact gradients
        self.last_selected_rows: dict[str, torch.Tensor] = {}
        self._sparse_grad_norm: float | None = None
        self._total_rows = sum(memory.num_slots for memory in controller.memories.values())
        self._rows_since_log, self._steps_since_log = 0, 0
        self.add_callback(_FinishSparseStep(self))

    def _keep_out_of_fsdp2(self) -> list[torch.nn.Parameter]:
        """Under accelerate's FSDP2: the memories and every trainable parameter (the values; ``alpha``, a scalar
        FSDP2 cannot shard) join the plugin's ignored modules, so they stay plain tensors on every rank; returns
        the trainable ones other than the values, whose gradients :meth:`_finish_smf_step` averages over the ranks
        (the controller averages the rows'). Elsewhere: [] (DDP reduces them)."""
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if plugin is None or getattr(plugin, "fsdp_version", 1) != 2:
            return []
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        kept = {p for memory in self.controller.memories.values() for p in memory.parameters()} | set(trainable)
        ignored = plugin.ignored_modules or []
        if isinstance(ignored, str):  # accelerate's regex over module names
            ignored = [module for name, module in self.model.named_modules() if re.fullmatch(ignored, name)]
        plugin.ignored_modules = [*ignored, torch.nn.ParameterList(list(kept))]
        values = {id(p) for p in self.controller.value_parameters()}
        return [p for p in trainable if id(p) not in values]

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            params = [p for p in (model or self.model).parameters() if p.requires_grad]
            self.optimizer = RowSparseAdamW(params, lr=self.args.learning_rate,
                                            betas=(self.args.adam_beta1, self.args.adam_beta2),
                                            eps=self.args.adam_epsilon, weight_decay=self.args.weight_decay)
            return self.optimizer
        return super().create_optimizer(model)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """The Trainer's, after giving the optimizer's parameters their (zero) state under FSDP: accelerate's FSDP2
        load would otherwise fill the empty optimizer by a dense zero-gradient step first
        (:meth:`RowSparseAdamW.init_state`)."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper
        if checkpoint is not None and self.is_fsdp_enabled and isinstance(optimizer, RowSparseAdamW):
            optimizer.init_state(self.controller.value_parameters())
        super()._load_optimizer_and_scheduler(checkpoint)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self.controller.in_step:  # the step's fill, planned as smf train plans it (plan_fill)
            self.controller.begin(self.args.gradient_accumulation_steps, compiled=bool(self.args.torch_compile))
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        except BaseException:  # the step is lost: the next training_step begins a fresh one
            self.controller.abort_step()
            raise

    def compute_loss(self, model, inputs, *args, **kwargs):
        """The Trainer's loss, then the controller's ``after_forward()`` (in a step of one eager micro-batch it
        selects the rows from the forward's counts, before the backward, which writes only their gradient)."""
        result = super().compute_loss(model, inputs, *args, **kwargs)
        if self.controller.in_step:
            self.controller.after_forward()
        return result

    def _finish_smf_step(self) -> None:
        """The step's end and finishing sequence (:meth:`MemoryStep.finish <smf_kernels.sparse.MemoryStep.finish>`)
        on the Trainer's optimizer, the gradients of the trainable parameters outside FSDP2 averaged first."""
        if not self.controller.in_step:
            return
        average_gradients(self._outside_fsdp)
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # inside accelerate's wrapper
        max_norm = self.sparse_max_grad_norm if self.sparse_max_grad_norm and self.sparse_max_grad_norm > 0 \
            else float("inf")  # the Trainer's convention: no clipping at 0 or below
        result = self.controller.finish(optimizer, max_grad_norm=max_norm)  # raised: dropped, train() begins afresh
        self.last_selected_rows = {} if result.skipped else result.selected
        self._sparse_grad_norm = float("nan") if result.skipped else float(result.grad_norm)
        if not result.skipped:
            self._rows_since_log += sum(int(rows.numel()) for rows in result.selected.values())
            self._steps_since_log += 1

    def save_patch(self, directory, base, rows=None, optimizer_rows: bool = False) -> MemoryPatch:
        """Write the knowledge patch of this run into ``directory`` (the main process writes it) and return it: the
        value rows (and any other memory tensor or trainable parameter) of the model that differ from ``base``,
        the model before training or a mapping of state name -> tensor (:meth:`MemoryPatch.between
        <smf_kernels.patch.MemoryPatch.between>`; ``rows``: the rows to save per memory path instead;
        ``optimizer_rows``: with the optimizer's state of those rows). docs/hf.md#knowledge-patches."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer) if optimizer_rows else None
        patch = MemoryPatch.between(self.model, base, rows=rows, optimizer=optimizer)
        if self.args.should_save:
            patch.save(directory)
        return patch

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if ("grad_norm" in logs or "loss" in logs) and self._sparse_grad_norm is not None:  # transformers 4.57
            logs["grad_norm"] = self._sparse_grad_norm  # logs no norm of its own when max_grad_norm is 0
        if "loss" in logs and self._steps_since_log:  # a training log
            rows = self._rows_since_log / self._steps_since_log
            logs["selected_rows"] = rows
            logs["selected_fraction"] = rows / self._total_rows
            self._rows_since_log, self._steps_since_log = 0, 0
        super().log(logs, start_time)
