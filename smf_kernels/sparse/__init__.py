"""Sparse Memory Finetuning machinery: background statistics, slot selection, row-sparse AdamW and a controller
tying them to any model with ProductKeyMemory layers (docs/method.md#slot-selection, #what-sparse-means).

Usage (stage 2; only the memory values, plus e.g. a +S scale, are trainable)::

    from smf_kernels.sparse import BackgroundStats, RowSparseAdamW, SparseMemoryController

    controller = SparseMemoryController(model, rule="kl", rows_per_step=512)
    controller.collect_background(background_loader)      # batch size 1, or:
    # controller.set_background(BackgroundStats.load("bg.safetensors", controller.memories))
    optimizer = RowSparseAdamW(controller.value_parameters() + extra_params, lr=5e-4)
    # or RowSparseSGD(...): plain SGD on the selected rows (docs/method.md#the-row-optimizer-and-alphas-rate)

    for step_batches in loader:                            # one optimizer step
        controller.begin_step()                            # fill "reads_kept": backwards keep their reads
        for micro_batch in step_batches:                   # gradient accumulation
            (compute_loss(model, micro_batch) / len(step_batches)).backward()
        rows = controller.finish_step(optimizer, max_grad_norm=1.0)  # {layer name: rows}
        scheduler.step()

    # One micro-batch per step: fill "rows_first", the rows selected between the forward and the backward, which
    # then writes only the T rows' (T, D) gradient (controller.plan(1) gives this plan; after_forward() selects)
    controller.begin_step(controller.plan(1))
    loss = compute_loss(model, batch)
    controller.after_forward()
    loss.backward()
    controller.finish_step(optimizer, max_grad_norm=1.0)

The step is one object, :class:`MemoryStep` (:mod:`smf_kernels.sparse.memory_step`: ``begin`` / ``after_forward`` /
``finish``, the one sequence ``smf train`` and the Hugging Face Trainer drive), whose update kind plugs in
(:mod:`smf_kernels.sparse.updates`: the exact update, the default, and the two ablations; the named steps
:class:`SparseMemoryController`, :class:`DenseMaskedUpdate` and :class:`AuthorsSparseUpdate` are it with each kind).
Its two fills and :func:`plan_fill`: :mod:`smf_kernels.sparse.fill_plan`; its gradients and the finishing sequence
(:meth:`RowGradients.apply`): :mod:`smf_kernels.sparse.row_gradients`. The step holds no state that changes during
training (resume = same background file + optimizer state_dict).
"""
from smf_kernels.sparse.background import BackgroundStats
from smf_kernels.sparse.clipping import clip_sharded_grad_norm_
from smf_kernels.sparse.fill_plan import FillPlan, plan_fill
from smf_kernels.sparse.memory_step import (AuthorsSparseUpdate, DenseMaskedUpdate, MemoryStep, SparseMemoryController,
                                            StepObserver)
from smf_kernels.sparse.row_grad_sink import FILLS, READS_KEPT, ROWS_FIRST, RowGradSink
from smf_kernels.sparse.row_gradients import RowGradients, StepResult
from smf_kernels.sparse.row_sparse_adamw import RowSparseAdamW
from smf_kernels.sparse.row_sparse_sgd import RowSparseSGD
from smf_kernels.sparse.selection import kl_scores, score_slots, select_top_rows, tfidf_scores
from smf_kernels.sparse.step_checks import NonFiniteGradientError, StepMisuseError
from smf_kernels.sparse.updates import AuthorsMasked, DenseMasked, ExactRows, UpdateKind, rows_moved_outside

__all__ = [
    "FILLS",
    "READS_KEPT",
    "ROWS_FIRST",
    "AuthorsMasked",
    "AuthorsSparseUpdate",
    "BackgroundStats",
    "DenseMasked",
    "DenseMaskedUpdate",
    "ExactRows",
    "FillPlan",
    "MemoryStep",
    "NonFiniteGradientError",
    "RowGradSink",
    "RowGradients",
    "RowSparseAdamW",
    "RowSparseSGD",
    "SparseMemoryController",
    "StepMisuseError",
    "StepObserver",
    "StepResult",
    "UpdateKind",
    "clip_sharded_grad_norm_",
    "kl_scores",
    "plan_fill",
    "rows_moved_outside",
    "score_slots",
    "select_top_rows",
    "tfidf_scores",
]
