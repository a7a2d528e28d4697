"""The authors' sparse update, kept as an ablation of this project's exact update
(docs/method.md#what-sparse-means, #the-protocol-setting).

What the authors' code (github.com/prakharg55/SMF-ICML, ``smf_rebuild/sparse_memory.py`` and
``trainer_utils.py``) does, per micro-batch of an optimizer step:

1. read counts are zeroed and counted over the micro-batch's forward, padding positions included
   (a forward hook bincounts every index the values table is asked for: sparse_memory.py:29-33,
   reset in trainer_utils.py:15);
2. right after that forward the top-T rows of each layer are chosen from those counts alone
   (trainer_utils.py:18, sparse_memory.py:119-147);
3. the backward's dense value gradient is multiplied by that micro-batch's row mask (a tensor
   hook, sparse_memory.py:107-117), and gradients accumulate over the micro-batches.

The optimizer step is a dense ``torch.optim.AdamW`` on the whole table after global-norm
clipping, so a step can touch up to (micro-batches x T) rows, and AdamW's momentum keeps moving
rows selected in earlier steps (weight decay would move every row; the authors' runs use 0).
This project's exact update (:class:`SparseMemoryController`, mode "row_sparse") instead selects
once per optimizer step from the counts of all its micro-batches without padding, and moves only
those rows. :func:`rows_moved_outside` measures the difference.

Single process only: the authors' runs used one GPU per run, and a distributed version would have
to define how masks of different ranks combine.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from smf_kernels.memory import ProductKeyMemory
from smf_kernels.sparse.background import BackgroundStats
from smf_kernels.sparse.selection import RULES, score_slots, select_top_rows, warn_if_not_sparse


def _count_padding_too(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: drop the caller's ``valid_mask`` so padding positions are counted as well."""
    return args, {**kwargs, "valid_mask": None}


class AuthorsSparseUpdate:
    """Per-micro-batch row selection with a masked dense gradient (see the module docstring).

    Args:
        model: any nn.Module holding :class:`ProductKeyMemory` layers (found by ``named_modules``).
        rule: "tfidf" or "kl"; rows_per_step: T, rows selected per layer per micro-batch.
        background: statistics for these memories (or :meth:`set_background` later).

    Use: ``begin_step()``; per micro-batch ``loss = forward(...)``, ``after_forward()``,
    ``loss.backward()``; then ``finish_step(optimizer, max_grad_norm)`` with a dense optimizer.
    """

    mode = "authors"

    def __init__(self, model: nn.Module, *, rule: str = "kl", rows_per_step: int = 512,
                 background: BackgroundStats | None = None) -> None:
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        if isinstance(rows_per_step, bool) or not isinstance(rows_per_step, int) or rows_per_step < 1:
            raise ValueError(f"rows_per_step must be a positive int, got {rows_per_step!r}")
        self.model, self.rule, self.rows_per_step = model, rule, rows_per_step
        self.memories = {name: module for name, module in model.named_modules()
                         if isinstance(module, ProductKeyMemory)}
        if not self.memories:
            raise ValueError("model holds no ProductKeyMemory module")
        warn_if_not_sparse({name: m.num_slots for name, m in self.memories.items()}, rows_per_step)
        self.background: BackgroundStats | None = None
        if background is not None:
            self.set_background(background)
        self._masks = {name: torch.zeros(m.num_slots, dtype=torch.bool, device=m.values.device)
                       for name, m in self.memories.items()}
        self._step_rows: dict[str, torch.Tensor] | None = None
        self._handles: list[Any] = []

    def set_background(self, background: BackgroundStats) -> None:
        """Use ``background`` for scoring; raises ValueError if it was built for other memories."""
        background.check_matches(self.memories)
        self.background = background

    def value_parameters(self) -> list[nn.Parameter]:
        return [memory.values for memory in self.memories.values()]

    def begin_step(self) -> None:
        """Start an optimizer step: dense value gradients, masked by each micro-batch's selection."""
        if self.background is None:
            raise RuntimeError("no background statistics: pass background= or call set_background() first")
        if self._step_rows is not None:
            raise RuntimeError("begin_step() called twice without finish_step(); if a forward or backward of the "
                               "step raised, call abort_step() to discard it first")
        self._step_rows = {name: torch.zeros_like(mask) for name, mask in self._masks.items()}
        for name, memory in self.memories.items():
            if not memory.values.requires_grad:
                raise RuntimeError(f"{name}.values does not require grad; nothing to train")
            memory.set_update_rows(None)
            memory.reset_read_counts()
            memory.set_read_counting(True)
            self._handles.append(memory.register_forward_pre_hook(_count_padding_too, with_kwargs=True))
            self._handles.append(memory.values.register_hook(self._masking_hook(name)))

    def abort_step(self) -> None:
        """Discard the step in progress (after one of its forwards or backwards raised): its hooks, read counts,
        selections and the memories' value gradients; the next :meth:`begin_step` starts afresh. A no-op when no
        step is in progress."""
        if self._step_rows is None:
            return
        self._end_step()
        for memory in self.memories.values():
            memory.values.grad = None

    def _end_step(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for memory in self.memories.values():
            memory.set_read_counting(False)
            memory.reset_read_counts()
        self._step_rows = None

    def _masking_hook(self, name: str):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            return grad * self._masks[name].unsqueeze(1).to(grad.dtype)
        return hook

    def after_forward(self) -> dict[str, torch.Tensor]:
        """Select each layer's rows from the counts of the micro-batch forward just run (before its
        backward), then zero the counts for the next micro-batch. Returns layer -> (T',) rows."""
        if self._step_rows is None:
            raise RuntimeError("after_forward() needs begin_step() first")
        selected = {}
        for name, memory in self.memories.items():
            counts = memory.read_counts
            device = counts.device
            scores = score_slots(self.rule, counts, self.background.doc_freq[name].to(device),
                                 self.background.reads[name].to(device), self.background.num_batches[name])
            rows = select_top_rows(scores, counts, self.rows_per_step)
            self._masks[name].zero_()
            self._masks[name][rows] = True
            self._step_rows[name][rows] = True
            selected[name] = rows
            memory.reset_read_counts()
        return selected

    def finish_step(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None
                    ) -> dict[str, torch.Tensor]:
        """Clip, step ``optimizer`` (dense), zero gradients. Returns layer -> rows selected by any
        micro-batch of the step ((R,) int64, ascending)."""
        if self._step_rows is None:
            raise RuntimeError("finish_step() called without begin_step()")
        rows = {name: used.nonzero().squeeze(1) for name, used in self._step_rows.items()}
        self._end_step()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]],
                                           max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return rows


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
