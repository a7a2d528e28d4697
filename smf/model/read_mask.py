"""Read counting restricted to the tokens a loss scores (``count_reads: loss``, docs/own-data.md#read-counting).

By default (the paper's, ``count_reads: all``) every non-padding token's memory reads count towards the sparse
selection. :func:`reads_counted_at_loss` counts only the reads of the positions whose next-token label is scored
(``labels[:, 1:] != -100``, shifted onto the input positions), so that, e.g., with ``loss_on: answer`` the prompt
template's tokens do not steer which rows train. Gradients are unchanged: only the counts (and so the selection)
differ.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from smf.data.causal_lm import IGNORE_INDEX
from smf.model.attach import memory_blocks


def loss_positions(labels: torch.Tensor) -> torch.Tensor:
    """(batch, seq) bool: position t is True when the loss scores its next-token prediction (``labels[:, t + 1]``
    is not -100); the last position predicts nothing scored. ``labels``: (batch, seq) int64."""
    if labels.dim() != 2:
        raise ValueError(f"labels must be (batch, seq), got shape {tuple(labels.shape)}")
    positions = torch.zeros_like(labels, dtype=torch.bool)
    positions[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return positions


@contextlib.contextmanager
def reads_counted_at_loss(model: nn.Module, batches: Sequence[dict]) -> Iterator[None]:
    """While active, a forward of ``model`` whose ``input_ids`` is the very tensor of one of ``batches`` (dicts with
    ``input_ids`` and ``labels``, (batch, seq)) counts memory reads only at that batch's :func:`loss_positions`
    (and, as always, not at padding). Forwards of other inputs count as usual; ``batches`` empty: a no-op. The
    batches are matched by tensor identity, so every forward a training step runs on them (a counting pass
    before the backward included) is restricted the same way."""
    blocks = memory_blocks(model)
    if not batches or not blocks:
        yield
        return
    by_input = {id(batch["input_ids"]): loss_positions(batch["labels"]) for batch in batches}

    def set_mask(module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        mask = by_input.get(id(input_ids))
        for block in blocks:
            block.read_mask = mask

    def clear_mask(module, args, kwargs, output):
        for block in blocks:
            block.read_mask = None

    handles = [model.register_forward_pre_hook(set_mask, with_kwargs=True),
               model.register_forward_hook(clear_mask, with_kwargs=True, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for block in blocks:
            block.read_mask = None
