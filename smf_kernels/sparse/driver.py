"""The one object a training loop drives a sparse step through: ``smf train`` (:mod:`smf.train.steps`) and the
Hugging Face Trainer (:class:`smf_kernels.hf.SparseMemoryTrainer`) alike, so that neither copies the step's
bookkeeping (docs/library.md)::

    driver = StepDriver(step, compiled=..., world=..., step_tokens=...)  # step: any MemoryStep
    driver.begin(len(micro_batches), counting_forward=...)  # plans the fill, begins, counts and selects if asked
    for micro_batch in micro_batches:
        loss = forward(micro_batch)
        driver.after_forward()
        loss.backward()
    result = driver.finish(optimizer, max_grad_norm=...)    # StepResult; a step that raises is dropped

Hooks: ``before_rows`` (a callable (values (M, D) parameter, rows (T,) int64), or None), called right before a
table's rows step, e.g. to keep the rows' values before their update.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from smf_kernels.sparse.fill_plan import FillPlan
from smf_kernels.sparse.memory_step import MemoryStep
from smf_kernels.sparse.row_gradients import BeforeRows, StepResult


class StepDriver:
    """Drives ``step`` (a :class:`~smf_kernels.sparse.MemoryStep`) through a loop's optimizer steps.

    Args:
        step: the exact update (:class:`~smf_kernels.sparse.SparseMemoryController`) or an ablation.
        compiled: the model runs under torch.compile (:func:`~smf_kernels.sparse.plan_fill`).
        world: the data-parallel processes.
        step_tokens: the most tokens a step holds on a process (a bound every process shares), or None.
        before_rows: the hook of the module docstring, or None.

    ``last`` holds the latest finished step's :class:`~smf_kernels.sparse.StepResult` (None before the first).
    """

    def __init__(self, step: MemoryStep, *, compiled: bool = False, world: int = 1, step_tokens: int | None = None,
                 before_rows: BeforeRows | None = None) -> None:
        self.step, self.compiled, self.world, self.step_tokens = step, compiled, world, step_tokens
        self.before_rows = before_rows
        self.last: StepResult | None = None

    @property
    def in_step(self) -> bool:
        """True between :meth:`begin` and the step's end (:meth:`finish` or :meth:`abort`)."""
        return self.step.in_step

    def begin(self, micro_batches: int, counting_forward: Callable[[], None] | None = None) -> FillPlan:
        """Plan the step of ``micro_batches`` forwards and backwards on this process, begin it, and when the plan
        asks for it run ``counting_forward`` (a forward of every micro-batch; here without grad) and select the
        rows. ValueError when the plan needs a counting forward and none was given. Returns the plan."""
        plan = self.step.plan(micro_batches, compiled=self.compiled, world=self.world, step_tokens=self.step_tokens)
        if plan.counting_forward and counting_forward is None:
            raise ValueError(f"this step of {micro_batches} micro-batches fills rows first, after a forward of "
                             "every micro-batch that only counts: pass counting_forward")
        self.step.begin_step(plan)
        if plan.counting_forward:
            with torch.no_grad():
                counting_forward()
            self.step.select_rows()
        return plan

    def after_forward(self) -> None:
        """Between a micro-batch's forward and its backward."""
        self.step.after_forward()

    def finish(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None) -> StepResult:
        """The step's end and its finishing sequence (:meth:`MemoryStep.finish`, ``before_rows`` called before
        each table's rows step); the result is kept in :attr:`last`. A call that raises (a refused optimizer or
        norm, a non-finite gradient) drops the step, so that the loop's next :meth:`begin` starts afresh."""
        try:
            self.last = self.step.finish(optimizer, max_grad_norm=max_grad_norm, before_rows=self.before_rows)
        except BaseException:
            self.step.abort_step()
            raise
        return self.last

    def abort(self) -> None:
        """Drop the step in progress (a forward or backward raised): :meth:`MemoryStep.abort_step`."""
        self.step.abort_step()
