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

The whole step (its protocol, its two fills, :func:`plan_fill`, the finishing sequence :meth:`RowGradients.apply`):
:mod:`smf_kernels.sparse.controller`; the ablations beside it: :mod:`smf_kernels.sparse.ablations`. The controller
holds no state that changes during training (resume = same background file + optimizer state_dict).
"""
from smf_kernels.sparse.ablations import AuthorsSparseUpdate, DenseMaskedUpdate, rows_moved_outside
from smf_kernels.sparse.background import BackgroundStats
from smf_kernels.sparse.clipping import clip_sharded_grad_norm_
from smf_kernels.sparse.controller import (FillPlan, MemoryStep, RowGradients, SparseMemoryController, StepResult,
                                           plan_fill)
from smf_kernels.sparse.row_grad_sink import FILLS, READS_KEPT, ROWS_FIRST, RowGradSink
from smf_kernels.sparse.row_sparse_adamw import RowSparseAdamW
from smf_kernels.sparse.row_sparse_sgd import RowSparseSGD
from smf_kernels.sparse.selection import kl_scores, score_slots, select_top_rows, tfidf_scores
from smf_kernels.sparse.step_checks import NonFiniteGradientError, StepMisuseError

__all__ = [
    "FILLS",
    "READS_KEPT",
    "ROWS_FIRST",
    "AuthorsSparseUpdate",
    "BackgroundStats",
    "DenseMaskedUpdate",
    "FillPlan",
    "MemoryStep",
    "NonFiniteGradientError",
    "RowGradSink",
    "RowGradients",
    "RowSparseAdamW",
    "RowSparseSGD",
    "SparseMemoryController",
    "StepMisuseError",
    "StepResult",
    "clip_sharded_grad_norm_",
    "kl_scores",
    "plan_fill",
    "rows_moved_outside",
    "score_slots",
    "select_top_rows",
    "tfidf_scores",
]
