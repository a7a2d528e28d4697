"""How a sparse step fills its rows' gradient, decided once per step from what the caller knows before it
(docs/method.md#what-sparse-means). The two fills:

- **rows first** (``begin_step(select_before_backward=True)``): the rows are known before the first backward,
  which adds only their (T, D) gradient. One eager micro-batch selects between its forward and its backward
  (``select_after_forward``); a compiled step's backward chooses them from the counts itself (one process); a
  step of several micro-batches runs a no-grad forward of each that only counts first (``counting_forward``).
- **reads kept** (``begin_step()``): every backward keeps its reads and the step's end fills the rows' gradient
  from them: no second forward, about N x (D x itemsize + 12 L) bytes per layer for the step's N tokens.

:func:`plan_fill` is the one place that chooses; ``smf train`` (:class:`smf.train.steps.SparseStep`, sharded
memories included) and :class:`smf_kernels.hf.SparseMemoryTrainer` follow it.
"""
from __future__ import annotations

from dataclasses import dataclass

# Reads are kept while a step can hold at most this many tokens per slot on a rank (more: count first).
KEPT_READS_PER_SLOT = 1


@dataclass(frozen=True)
class Fill:
    """One step's fill (see the module docstring)."""

    rows_first: bool
    counting_forward: bool = False
    select_after_forward: bool = False

    @property
    def name(self) -> str:
        return "rows first" if self.rows_first else "reads kept"


def plan_fill(micro_batches: int, *, compiled: bool, world: int, step_tokens: int | None = None,
              slots: int | None = None) -> Fill:
    """The fill of a step of ``micro_batches`` forwards and backwards per process.

    Args:
        micro_batches: forwards (each with its backward) in the step on this process.
        compiled: the model runs under torch.compile: no host sync in its backward, so rows come first
            (one micro-batch: the backward chooses them; under accumulation: a counting forward).
        world: data-parallel processes; a compiled step needs one (its backward chooses rows from this process's
            counts, which other processes would not share): ValueError otherwise.
        step_tokens, slots: the most tokens a step holds on a process and the smallest memory's slot count;
            when both are given and the tokens exceed ``KEPT_READS_PER_SLOT x slots``, kept reads would take
            more memory than a dense gradient, so rows come first (a counting forward). Every process must pass
            the same bound (processes that chose differently would deadlock).
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    if compiled and world > 1:
        raise ValueError("a compiled sparse step runs in one process: under torch.distributed every process must "
                         "select the same rows before its backward, outside the compiled graph")
    if micro_batches == 1:
        return Fill(rows_first=True, select_after_forward=not compiled)
    too_many = step_tokens is not None and slots is not None and step_tokens > KEPT_READS_PER_SLOT * slots
    if compiled or too_many:
        return Fill(rows_first=True, counting_forward=True)
    return Fill(rows_first=False)
