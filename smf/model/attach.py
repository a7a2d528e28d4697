"""Insert product-key memories into a Qwen-2-style causal LM (SPEC §2)."""
from __future__ import annotations

import logging

import torch
from torch import nn

from smf.model.block import MODES, MemoryBlock
from smf_kernels import ProductKeyMemory

logger = logging.getLogger(__name__)

PAPER_LAYERS = (6, 12, 18)


def decoder_stack(model: nn.Module) -> nn.Module:
    """The module holding the decoder layers (``model.model``, whose ``layers[i]`` have ``.mlp``)."""
    stack = getattr(model, "model", None)
    layers = getattr(stack, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(hasattr(layer, "mlp") for layer in layers):
        raise ValueError(f"expected a causal LM whose decoder layers model.model.layers[i] have .mlp "
                         f"(e.g. Qwen2ForCausalLM); got {type(model).__name__}")
    return stack


def memory_blocks(model: nn.Module) -> list[MemoryBlock]:
    """All MemoryBlocks in ``model`` (also through wrappers such as peft), by layer index."""
    return sorted((m for m in model.modules() if isinstance(m, MemoryBlock)), key=lambda b: b.layer_index)


def _check_layers(layers, num_layers: int) -> tuple[int, ...]:
    layers = tuple(layers)
    valid = all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in layers)
    if not layers or not valid or len(set(layers)) != len(layers):
        raise ValueError(f"layers must be distinct indices in [0, {num_layers - 1}] (the model has {num_layers} "
                         f"decoder layers), got {layers}")
    return tuple(sorted(layers))


def attach_memories(model: nn.Module, layers=PAPER_LAYERS, mode: str = "additive", alpha_init: float = 0.01,
                    **memory_kwargs) -> list[MemoryBlock]:
    """Put a fresh fp32 ProductKeyMemory at each of ``layers`` of ``model`` (in place).

    Args:
        model: e.g. ``Qwen2ForCausalLM``; ``model.model.layers[i].mlp`` is replaced by a
            :class:`MemoryBlock`, created on that layer's device.
        layers: 0-based decoder layer indices (paper: 6, 12, 18).
        mode: ``"replacement"``, ``"additive"`` or ``"additive_s"`` (see :class:`MemoryBlock`).
        alpha_init: initial scalar of the memory branch in additive modes (paper: 0.01).
        **memory_kwargs: ProductKeyMemory arguments (n_keys, heads, topk, key_dim, value_dim,
            backend); unset ones keep the paper defaults. ``d_model`` is the model's hidden size.

    Also installs hooks on ``model.model`` that hand each call's ``attention_mask`` to the
    blocks for the duration of that call (so padding is not counted as reads).
    Returns the blocks, by layer index.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if "d_model" in memory_kwargs:
        raise ValueError("d_model is taken from model.config.hidden_size; do not pass it")
    stack = decoder_stack(model)
    if memory_blocks(model):
        raise ValueError(f"model already has memories at layers {[b.layer_index for b in memory_blocks(model)]}")
    layers = _check_layers(layers, len(stack.layers))
    d_model = model.config.hidden_size

    blocks = []
    for index in layers:
        layer = stack.layers[index]
        device = next(layer.parameters()).device
        with torch.device(device):
            memory = ProductKeyMemory(d_model, **memory_kwargs).float()
        mlp = None if mode == "replacement" else layer.mlp
        layer.mlp = MemoryBlock(memory, mlp, mode, index, alpha_init=alpha_init)
        blocks.append(layer.mlp)
    _install_mask_hooks(stack, blocks)
    logger.info("attached %s memories at layers %s (%s each)", mode, layers, blocks[0].memory.extra_repr())
    return blocks


def _install_mask_hooks(stack: nn.Module, blocks: list[MemoryBlock]) -> None:
    def stash_mask(module, args, kwargs):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        for block in blocks:
            block.attention_mask = mask

    def clear_mask(module, args, kwargs, output):
        for block in blocks:
            block.attention_mask = None

    stack.register_forward_pre_hook(stash_mask, with_kwargs=True)
    stack.register_forward_hook(clear_mask, with_kwargs=True, always_call=True)
