"""How a sparse step fills its rows' gradient, decided once per step (docs/method.md#what-sparse-means).

**The two fills** (:data:`~smf_kernels.sparse.row_grad_sink.FILLS`, ``begin_step(fill)``):

- ``"rows_first"``: the rows are known before the step's first backward, which adds only their (T, D) gradient:
  :meth:`~smf_kernels.sparse.SparseMemoryController.select_rows` between the forwards and the first backward (one
  eager micro-batch: ``after_forward()`` does it; under accumulation after a no-grad forward of every micro-batch
  that only counts), or, in one process without the call, the first backward chooses the rows from the counts
  itself (no host sync: what a torch.compile'd step runs).
- ``"reads_kept"`` (the default): every backward keeps its reads and the step's end sums the selected rows'
  gradient from them: no second forward, about N x (D x itemsize + 12 L) bytes per layer for the step's N tokens.

:func:`plan_fill` is the one place that chooses (through :meth:`~smf_kernels.sparse.MemoryStep.plan`, which the
the step's ``begin`` every loop calls: :meth:`~smf_kernels.sparse.MemoryStep.begin`).
"""
from __future__ import annotations

from dataclasses import dataclass

from smf_kernels.sparse.row_grad_sink import READS_KEPT, ROWS_FIRST

# Reads are kept while a step can hold at most this many tokens per slot on a rank (more: rows first, counted).
KEPT_READS_PER_SLOT = 1


@dataclass(frozen=True)
class FillPlan:
    """One step's fill (``fill``: "rows_first" or "reads_kept", see the module docstring) and what the caller
    does for it: ``counting_forward``, a no-grad forward of every micro-batch that only counts, then
    ``select_rows()``, before the first forward with grad; ``select_after_forward``, the rows selected between
    the forward and the backward of the step's one micro-batch (``after_forward()`` does it)."""

    fill: str = READS_KEPT
    counting_forward: bool = False
    select_after_forward: bool = False


def check_one_process(compiled: bool, world: int, subject: str = "a compiled sparse step") -> None:
    """ValueError naming ``subject`` (how the caller's user spells a compiled step) when a ``compiled`` sparse step
    would run in ``world`` > 1 data-parallel processes: its backward chooses the rows from this process's counts,
    which the other processes would not share. The one statement of the rule: :func:`plan_fill`, the HF Trainer and
    ``smf train``'s rules (:mod:`smf.train.rules`) call it."""
    if compiled and world > 1:
        raise ValueError(f"{subject} runs in one process: under torch.distributed every process must select the "
                         "same rows before its backward, outside the compiled graph")


def plan_fill(micro_batches: int, *, compiled: bool, world: int, step_tokens: int | None = None,
              slots: int | None = None) -> FillPlan:
    """The fill of an exact step of ``micro_batches`` forwards and backwards per process.

    Args:
        micro_batches: forwards (each with its backward) in the step on this process.
        compiled: the model runs under torch.compile: no host sync in its backward, so rows come first
            (one micro-batch: the backward chooses them; under accumulation: a counting forward).
        world: data-parallel processes; a compiled step needs one: ValueError otherwise (:func:`check_one_process`).
        step_tokens, slots: the most tokens a step holds on a process and the smallest memory's slot count;
            when both are given and the tokens exceed ``KEPT_READS_PER_SLOT x slots``, kept reads would take
            more memory than a dense gradient, so rows come first (a counting forward). Every process must pass
            the same bound (processes that chose differently would deadlock).
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    check_one_process(compiled, world)
    if micro_batches == 1:
        return FillPlan(ROWS_FIRST, select_after_forward=not compiled)
    too_many = step_tokens is not None and slots is not None and step_tokens > KEPT_READS_PER_SLOT * slots
    if compiled or too_many:
        return FillPlan(ROWS_FIRST, counting_forward=True)
    return FillPlan(READS_KEPT)
