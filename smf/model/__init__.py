"""Product-key memories inside a Qwen-2 causal LM: placement, freezing per recipe, adapters, loading."""
from smf.model.adapter import load_memory_adapter, read_adapter_config, save_memory_adapter
from smf.model.attach import LAYOUTS, PAPER_LAYERS, attach_memories, decoder_layers, decoder_stack, memory_blocks
from smf.model.block import MODES, MemoryBlock
from smf.model.diagnostics import INERT_KL, MemoryDiagnostics, memory_diagnostics, warn_if_inert
from smf.model.freezing import (LORA_TARGET_REGEX, LORA_TARGETS, STAGES, apply_lora, configure_trainable,
                                count_parameters)
from smf.model.loading import (
    from_pretrained,
    load_base,
    load_model,
    load_run,
    load_tokenizer,
    load_with_adapter,
)
from smf.model.memory_mode import set_memory_mode
from smf.model.patch import load_patch, save_patch
from smf.model.read_mask import loss_positions, reads_counted_at_loss
from smf.model.saved_tokenizer import TOKENIZER_SUBFOLDER, save_tokenizer
from smf.model.sizes import scaled_memory_sizes
from smf.vocabulary import DEFAULT_MODEL

__all__ = [
    "DEFAULT_MODEL",
    "INERT_KL",
    "LAYOUTS",
    "LORA_TARGETS",
    "LORA_TARGET_REGEX",
    "MODES",
    "MemoryBlock",
    "MemoryDiagnostics",
    "PAPER_LAYERS",
    "STAGES",
    "TOKENIZER_SUBFOLDER",
    "apply_lora",
    "attach_memories",
    "configure_trainable",
    "count_parameters",
    "decoder_layers",
    "decoder_stack",
    "from_pretrained",
    "load_base",
    "load_memory_adapter",
    "load_model",
    "load_run",
    "load_tokenizer",
    "load_with_adapter",
    "load_patch",
    "loss_positions",
    "memory_blocks",
    "memory_diagnostics",
    "read_adapter_config",
    "reads_counted_at_loss",
    "save_memory_adapter",
    "save_patch",
    "save_tokenizer",
    "scaled_memory_sizes",
    "set_memory_mode",
    "warn_if_inert",
]
