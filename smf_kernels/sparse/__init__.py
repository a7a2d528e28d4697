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
        controller.begin_step()                            # backwards keep their reads
        for micro_batch in step_batches:                   # gradient accumulation
            (compute_loss(model, micro_batch) / len(step_batches)).backward()
        rows = controller.finish_step(optimizer, max_grad_norm=1.0)  # {layer name: rows}
        scheduler.step()

    # One micro-batch per step: select before the backward, which then writes only the T rows' (T, D) gradient
    controller.begin_step(select_before_backward=True)
    loss = compute_loss(model, batch)
    controller.select_rows()
    loss.backward()
    controller.finish_step(optimizer, max_grad_norm=1.0)

The controller holds no state that changes during training (resume = same background file + optimizer
state_dict); DDP: see :mod:`smf_kernels.sparse.controller`. The ablations: :mod:`smf_kernels.sparse.ablations`.
"""
from smf_kernels.sparse.ablations import AuthorsSparseUpdate, DenseMaskedUpdate, rows_moved_outside
from smf_kernels.sparse.background import BackgroundStats
from smf_kernels.sparse.clipping import clip_grad_norm_
from smf_kernels.sparse.controller import MemoryStep, RowGradients, SparseMemoryController
from smf_kernels.sparse.row_grad_sink import RowGradSink
from smf_kernels.sparse.row_sparse_adamw import RowSparseAdamW
from smf_kernels.sparse.row_sparse_sgd import RowSparseSGD
from smf_kernels.sparse.selection import kl_scores, score_slots, select_top_rows, tfidf_scores
from smf_kernels.sparse.step_checks import NonFiniteGradientError, StepMisuseError

__all__ = [
    "AuthorsSparseUpdate",
    "BackgroundStats",
    "DenseMaskedUpdate",
    "MemoryStep",
    "NonFiniteGradientError",
    "RowGradSink",
    "RowGradients",
    "RowSparseAdamW",
    "RowSparseSGD",
    "SparseMemoryController",
    "StepMisuseError",
    "clip_grad_norm_",
    "kl_scores",
    "rows_moved_outside",
    "score_slots",
    "select_top_rows",
    "tfidf_scores",
]
