"""The ablations of the exact sparse update (docs/method.md#the-sparse-update-exact-default-and-the-authors-ablation),
unchanged in what they compute: both mask a dense value gradient and step a dense ``torch.optim.AdamW`` on the
whole table, so AdamW's momentum (and weight decay) still moves rows outside the selection: they measure that leak
(#pitfalls-of-earlier-implementations, :func:`rows_moved_outside`).

:class:`DenseMaskedUpdate` (``smf train --update dense_masked``) selects the step's rows as the exact update does
(once per optimizer step, from the read counts of all its micro-batches, padding excluded) and zeroes every
unselected row of the (rank-averaged) dense gradient.

:class:`AuthorsSparseUpdate` (``--update authors``, one process, as the authors' single-GPU runs) reproduces
github.com/prakharg55/SMF-ICML (``smf_rebuild/sparse_memory.py``, ``trainer_utils.py``). Per micro-batch: read
counts are zeroed (trainer_utils.py:15) and counted over its forward, padding included (a forward hook bincounts
every index, sparse_memory.py:29-33); right after that forward the top-T rows are chosen from those counts alone
(trainer_utils.py:18, sparse_memory.py:119-147); its backward's dense value gradient is multiplied by that row mask
(a tensor hook, sparse_memory.py:107-117) and gradients accumulate. Then global-norm clipping and a dense AdamW
step, so a step can touch up to (micro-batches x T) rows.

Both follow the exact update's protocol (:mod:`smf_kernels.sparse.memory_step`: ``begin_step``,
``after_forward``, ``end_step`` returning :class:`~smf_kernels.sparse.RowGradients` whose ``apply`` is the one
finishing sequence; the values' masked dense gradient is their ``.grad`` there), refuse misuse and treat
non-finite gradients as it does (:mod:`smf_kernels.sparse.step_checks`): their backwards write the dense value
gradient into a :class:`DenseGradSink`, not ``.grad``, so a value gradient made by a forward run before
``begin_step()`` is refused at the step's end as the exact update refuses it, and a step with no backward moves no
value row (the table gets no ``.grad``, which a dense optimizer leaves alone).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from smf_kernels.ops.weighted_gather import GradientSink, gather_backward
from smf_kernels.sparse.background import BackgroundStats
from smf_kernels.sparse.fill_plan import FillPlan
from smf_kernels.sparse.memory_step import MemoryStep
from smf_kernels.sparse.row_grad_sink import READS_KEPT
from smf_kernels.sparse.row_gradients import RowGradients
from smf_kernels.sharded.layout import gradient_copies


class DenseGradSink(GradientSink):
    """The dense (M, D) value gradient of one table over a step's backwards, held apart from ``.grad`` until the
    step's end; ``mask`` (an (M,) bool tensor read at each backward, or None) zeroes the rows outside it first (the
    authors' per-micro-batch selection). :attr:`grad` stays None while no backward reached the table."""

    def __init__(self, device: torch.device, mask: torch.Tensor | None = None) -> None:
        self.device, self.mask = device, mask
        self.grad: torch.Tensor | None = None
        self.closed = False

    @property
    def reached(self) -> torch.Tensor:
        """0-d bool on the table's device: whether a backward of the step reached the table."""
        return torch.tensor(self.grad is not None, device=self.device)

    def backward(self, grad_out, values, indices, weights, gate, read, backend, deterministic, need_weights):
        if self.closed:
            raise RuntimeError("a backward of a memory forward run in a step that has ended (finish_step or "
                               "abort_step came before this backward): run every backward of a step before its "
                               "end, and drop graphs of aborted steps")
        grad, grad_weights, grad_gate, _ = gather_backward(grad_out, values, indices, weights, None, gate, read,
                                                               backend, deterministic, True, need_weights, False)
        grad = grad.to(values.dtype)
        if self.mask is not None:
            grad = grad * self.mask.unsqueeze(1).to(grad.dtype)
        self.grad = grad if self.grad is None else self.grad.add_(grad)
        return grad_weights, grad_gate

    def close(self) -> None:
        self.closed = True


class DenseMaskedUpdate(MemoryStep):
    """The exact update's selection with a masked dense gradient and a dense optimizer (see the module docstring).

    Arguments as :class:`~smf_kernels.sparse.SparseMemoryController` (both are :class:`MemoryStep` kinds, with
    its protocol); ``finish_step(optimizer, max_grad_norm=...)`` with ``torch.optim.AdamW`` over the values.
    Fill: reads kept only (it selects at the step's end). Under DDP the values are reduced here
    (``ddp_ignored_names``).
    """

    def _make_sink(self, name: str, values: nn.Parameter, fill: str) -> DenseGradSink:
        return DenseGradSink(values.device)

    def _end(self) -> RowGradients:
        """Select from the step's counts; each value table's ``.grad`` := its (rank-averaged) dense gradient with
        every unselected row zeroed. Selected rows: none for a layer no backward of the step reached (it gets no
        gradient, so nothing of it moves)."""
        counts = self._step_counts()
        reached = self._reached()  # on any rank: every rank reduces the same tables
        selected = {}
        for name, memory in self.memories.items():
            rows, valid = self._padded_selection(name, counts[name])
            values, grad = memory.values, self._sinks[name].grad
            if not bool(reached[name]):
                selected[name] = rows[:0]
                continue
            selected[name] = rows[valid]
            values.grad = torch.zeros_like(values) if grad is None else grad
            world = gradient_copies(values, self._world())
            if world > 1:
                self._all_reduce_sum(values.grad)
                values.grad.div_(world)
            keep = torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)
            keep[selected[name]] = True
            values.grad.mul_(keep.unsqueeze(1).to(values.grad.dtype))
        self._close()
        return self._gradients({}, selected)


def _count_padding_too(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: drop the caller's ``valid_mask`` so padding positions are counted as well."""
    return args, {**kwargs, "valid_mask": None}


class AuthorsSparseUpdate(MemoryStep):
    """Per-micro-batch row selection with a masked dense gradient (see the module docstring). One process.

    Arguments as :class:`SparseMemoryController` (rule "kl" by default; T rows per layer per micro-batch), the
    same protocol: ``begin_step()``; per micro-batch forward, ``after_forward()`` (selects), backward;
    ``finish_step(optimizer, max_grad_norm=...)`` with a dense optimizer. Fill: reads kept only.
    """

    def __init__(self, model: nn.Module, *, rule: str = "kl", rows_per_step: int | None = None,
                 background: BackgroundStats | None = None, nonfinite: str = "raise") -> None:
        super().__init__(model, rule=rule, rows_per_step=rows_per_step, background=background, nonfinite=nonfinite)
        self._masks = {name: torch.zeros(m.num_slots, dtype=torch.bool, device=m.values.device)
                       for name, m in self.memories.items()}
        self._used_rows: dict[str, torch.Tensor] = {}  # layer -> (M,) bool: selected by a micro-batch of the step
        self._handles: list[Any] = []

    def begin_step(self, fill: str | FillPlan = READS_KEPT) -> None:
        """:meth:`MemoryStep.begin_step`; dense value gradients, masked by each micro-batch's selection, and reads
        counted with padding (as the authors count them)."""
        super().begin_step(fill)
        self._used_rows = {name: torch.zeros_like(mask) for name, mask in self._masks.items()}
        for memory in self.memories.values():
            self._handles.append(memory.register_forward_pre_hook(_count_padding_too, with_kwargs=True))

    def _make_sink(self, name: str, values: nn.Parameter, fill: str) -> DenseGradSink:
        return DenseGradSink(values.device, mask=self._masks[name])  # the mask of the micro-batch being backwarded

    def _close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        super()._close()

    def after_forward(self) -> None:
        """Select each layer's rows from the counts of the micro-batch forward just run (before its
        backward), then zero the counts for the next micro-batch."""
        super().after_forward()
        for name, memory in self.memories.items():
            rows, valid = self._padded_selection(name, memory.read_counts)
            self._masks[name].zero_()
            self._masks[name][rows[valid]] = True
            self._used_rows[name][rows[valid]] = True
            memory.reset_read_counts()

    def _end(self) -> RowGradients:
        """Each value table's ``.grad`` := its masked dense gradient summed over the step's micro-batches.
        Selected rows: those any micro-batch of the step selected ((R,) int64, ascending); none for a layer no
        backward reached (it gets no gradient, so nothing of it moves)."""
        rows = {}
        for name, memory in self.memories.items():
            memory.values.grad = self._sinks[name].grad
            used = self._used_rows[name] if memory.values.grad is not None else torch.zeros_like(self._masks[name])
            rows[name] = used.nonzero().squeeze(1)
        self._close()
        return self._gradients({}, rows)


def rows_moved_outside(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
                       selected: dict[str, torch.Tensor]) -> int:
    """Value rows, summed over layers, that changed in a step although not in its selected set.

    before/after: layer -> (M, D) values before and after the step; selected: layer -> (T,) rows.
    """
    moved = 0
    for name, old in before.items():
        changed = (after[name] != old).any(dim=1)
        changed[selected[name]] = False
        moved += int(changed.sum())
    return moved
