"""Which parameters each training recipe trains (docs/method.md#two-stage-training)."""
from __future__ import annotations

import logging

from torch import nn

from smf.model.attach import memory_blocks

logger = logging.getLogger(__name__)

STAGES = ("retrofit", "sparse", "full")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# peft ``target_modules`` (a regex, matched with re.fullmatch against module names): the LORA_TARGETS
# of the decoder layers, never a module inside a product-key memory. (The plain list leaves smf's memories alone
# too: their projections are query_map / gate_map / out_map; a model saved before that rename and loaded through
# its own saved code, without smf, still has a memory gate_proj.)
LORA_TARGET_REGEX = r"^(?!.*\.memory\.).*\.(" + "|".join(LORA_TARGETS) + r")$"


def count_parameters(model: nn.Module) -> dict[str, int]:
    """{"trainable": ..., "total": ...} over distinct parameters (tied weights counted once)."""
    params = list(model.parameters())
    return {"trainable": sum(p.numel() for p in params if p.requires_grad), "total": sum(p.numel() for p in params)}


def configure_trainable(model: nn.Module, stage: str) -> dict[str, int]:
    """Set ``requires_grad`` for ``stage`` and return :func:`count_parameters`.

    - ``retrofit``: every memory parameter (query, keys, values, gate, out; alpha in additive
      modes) trains, everything else is frozen.
    - ``sparse``: only memory values train (plus alpha in mode ``additive+s``); which value rows
      move each step is the trainer's business (SparseMemoryController, through ProductKeyMemory.set_grad_sink).
    - ``full``: every parameter trains (full-finetune baseline), memories included when the model holds
      some (a baseline from the same checkpoint as the sparse runs; their values get dense gradients).
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    blocks = memory_blocks(model)
    if stage == "full":
        model.requires_grad_(True)
    else:
        if not blocks:
            raise ValueError(f"stage {stage!r} trains memory parameters, but the model has none; "
                             "call smf.model.attach_memories first")
        model.requires_grad_(False)
        for block in blocks:
            if stage == "retrofit":
                block.memory.requires_grad_(True)
            else:
                block.memory.values.requires_grad_(True)
            if block.alpha is not None and (stage == "retrofit" or block.mode == "additive+s"):
                block.alpha.requires_grad_(True)
    counts = count_parameters(model)
    logger.info("stage %s: %d of %d parameters trainable", stage, counts["trainable"], counts["total"])
    return counts


def apply_lora(model: nn.Module, r: int = 16, alpha: int = 32, dropout: float = 0.05) -> nn.Module:
    """LoRA baseline (docs/method.md#two-stage-training): peft adapters on the seven projections of every decoder layer.

    Returns the peft model (base weights frozen by peft). On a model with memories the adapters
    go on the decoder layers' projections (including the original MLP inside an additive
    :class:`MemoryBlock`) and never inside a memory: the targets are :data:`LORA_TARGET_REGEX`. The memory
    parameters are frozen with the rest of the base model.
    """
    from peft import LoraConfig, get_peft_model  # optional and heavy: only the LoRA recipe needs it

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=LORA_TARGET_REGEX,
                        bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    counts = count_parameters(peft_model)
    logger.info("LoRA r=%d: %d of %d parameters trainable", r, counts["trainable"], counts["total"])
    return peft_model
