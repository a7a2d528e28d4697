"""Switching the memory mode of a model that holds memories: an additive retrofit finetuned as +S (alpha trains)."""
from __future__ import annotations

import logging

from torch import nn

from smf.model.attach import CONFIG_KEY, memory_blocks
from smf.model.block import MemoryBlock

logger = logging.getLogger(__name__)

ALPHA_MODES = ("additive", "additive+s")  # the modes with an alpha, between which a model may switch


def set_memory_mode(model: nn.Module, mode: str) -> list[MemoryBlock]:
    """Put every memory of ``model`` in ``mode``: ``additive`` <-> ``additive+s`` (the two differ only in whether
    sparse finetuning trains alpha, :func:`smf.model.configure_trainable`); how the paper's +S starts from an
    additive retrofit. ``model.config.smf_memories`` records the new mode, so a model saved afterwards loads in it.
    When the model is already set up for sparse finetuning (only memory values train), alpha's ``requires_grad``
    follows the new mode at once. ValueError for a replacement model (it has no alpha) or another mode.
    Returns the blocks."""
    blocks = memory_blocks(model)
    if not blocks:
        raise ValueError("model holds no memories; call smf.model.attach_memories first")
    current = blocks[0].mode
    if mode not in ALPHA_MODES or current not in ALPHA_MODES:
        raise ValueError(f"set_memory_mode switches between {' and '.join(ALPHA_MODES)}; the model's memories are "
                         f"{current!r} and {mode!r} was asked (a replacement memory has no alpha)")
    for block in blocks:
        sparse_setup = block.memory.values.requires_grad and not block.memory.keys.requires_grad
        block.mode = mode
        if sparse_setup:
            block.alpha.requires_grad_(mode == "additive+s")
    recorded = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    if isinstance(recorded, dict):
        recorded["mode"] = mode
    if mode != current:
        logger.info("memories switched from %s to %s (alpha %s)", current, mode,
                    ", ".join(f"{float(block.alpha.detach()):.4g}" for block in blocks))
    return blocks
