"""Product-key memories inside a Qwen-2 causal LM: placement, freezing per recipe, adapters."""
from smf.model.attach import LAYOUTS, PAPER_LAYERS, attach_memories, decoder_layers, decoder_stack, memory_blocks
from smf.model.block import MODES, MemoryBlock
from smf.model.checkpoint import (
    DEFAULT_MODEL,
    from_pretrained,
    load_base_model,
    load_memory_adapter,
    load_model_with_memories,
    load_tokenizer,
    read_adapter_config,
    save_memory_adapter,
)
from smf.model.freezing import LORA_TARGET_REGEX, LORA_TARGETS, STAGES, apply_lora, configure_trainable, count_parameters

__all__ = [
    "DEFAULT_MODEL",
    "LAYOUTS",
    "LORA_TARGETS",
    "LORA_TARGET_REGEX",
    "MODES",
    "MemoryBlock",
    "PAPER_LAYERS",
    "STAGES",
    "apply_lora",
    "attach_memories",
    "configure_trainable",
    "count_parameters",
    "decoder_layers",
    "decoder_stack",
    "from_pretrained",
    "load_base_model",
    "load_memory_adapter",
    "load_model_with_memories",
    "load_tokenizer",
    "memory_blocks",
    "read_adapter_config",
    "save_memory_adapter",
]
