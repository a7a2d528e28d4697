"""Insert product-key memories into a decoder-only causal LM (docs/method.md#placement-in-qwen-2): Qwen-2 and
any model with
``model.layers[i].mlp``, GPT-2 / GPT-NeoX / Falcon by table, other layouts by naming them."""
from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import sys

import torch
from torch import nn

from smf.model.block import MODES, MemoryBlock
from smf.model.hf_auto import base_model_type, memory_config_class, use_attach
from smf.model.memory_spec import CONFIG_KEY, check_memory_spec, layers_path_in
from smf.model.sizes import scaled_layers, scaled_memory_kwargs
from smf.vocabulary import PAPER_LAYERS, check_layers  # noqa: F401 (smf.model exports it)
from smf_kernels import ProductKeyMemory
from smf_kernels.memory import PROJECTIONS

logger = logging.getLogger(__name__)


# Where the decoder layers and their feed-forward module live, by ``config.model_type``, for
# architectures that do not use the common ``model.layers[i].mlp`` (Llama, Mistral, Qwen-2/3, Gemma-2, ...).
LAYOUTS = {
    "gpt2": ("transformer.h", "mlp"),
    "gpt_neox": ("gpt_neox.layers", "mlp"),
    "falcon": ("transformer.h", "mlp"),
}
DEFAULT_LAYOUT = ("model.layers", "mlp")
SCALED_KWARGS = ("n_keys", "heads", "topk", "key_dim")  # sizes scaled to the model when not given


def _layout(model: nn.Module, layers_path: str | None, mlp_attr: str | None) -> tuple[str, str]:
    model_type = base_model_type(getattr(model, "config", None))
    default_path, default_attr = LAYOUTS.get(model_type, DEFAULT_LAYOUT)
    return layers_path or default_path, mlp_attr or default_attr


def decoder_stack(model: nn.Module, layers_path: str | None = None, mlp_attr: str | None = None) -> nn.Module:
    """The module holding the decoder layers (``model.model`` for Qwen-2; see :func:`decoder_layers`)."""
    return _find_layers(model, layers_path, mlp_attr)[0]


def decoder_layers(model: nn.Module, layers_path: str | None = None, mlp_attr: str | None = None) -> nn.ModuleList:
    """The ``nn.ModuleList`` of decoder layers of a decoder-only LM.

    ``layers_path`` is the dotted path of that list and ``mlp_attr`` the feed-forward attribute
    of each layer; by default ``model.layers`` and ``mlp``, or the entry of :data:`LAYOUTS` for
    the model's ``config.model_type``. Raises ValueError naming both arguments if not found.
    """
    return _find_layers(model, layers_path, mlp_attr)[1]


def _find_layers(model: nn.Module, layers_path: str | None, mlp_attr: str | None) -> tuple[nn.Module, nn.ModuleList]:
    """(module holding the decoder layers, the layers); arguments as :func:`decoder_layers`."""
    layers_path, mlp_attr = _layout(model, layers_path, mlp_attr)
    holder, _, list_name = layers_path.rpartition(".")
    try:
        stack = model.get_submodule(holder) if holder else model
    except AttributeError:
        stack = None
    layers = getattr(stack, list_name, None)
    if not isinstance(layers, nn.ModuleList) or not all(isinstance(getattr(layer, mlp_attr, None), nn.Module)
                                                        for layer in layers):
        raise ValueError(
            f"could not find decoder layers {layers_path}[i].{mlp_attr} in {type(model).__name__}; name them "
            f"with attach_memories(..., layers_path=..., mlp_attr=...), e.g. layers_path='transformer.h', "
            f"mlp_attr='mlp' for GPT-2"
        )
    return stack, layers


def memory_blocks(model: nn.Module) -> list[MemoryBlock]:
    """All MemoryBlocks in ``model`` (also through wrappers such as peft), by layer index."""
    return sorted((m for m in model.modules() if isinstance(m, MemoryBlock)), key=lambda b: b.layer_index)


DEFAULT_ALPHA_INIT = 0.01  # the paper's initial alpha


def attach_memories(model: nn.Module, layers=None, mode: str = "additive",
                    alpha_init: float = DEFAULT_ALPHA_INIT, *,
                    layers_path: str | None = None, mlp_attr: str | None = None,
                    dtype: torch.dtype | None = None, **memory_kwargs) -> list[MemoryBlock]:
    """Put a fresh ProductKeyMemory (fp32, or ``dtype``) at each of ``layers`` of ``model`` (in place).

    Args:
        model: a decoder-only causal LM, e.g. ``Qwen2ForCausalLM``; ``model.model.layers[i].mlp``
            becomes a :class:`MemoryBlock` (replacement: a new module; additive: the MLP itself, which keeps
            its weights and their names), the memory created on that layer's device.
        layers_path, mlp_attr: where the decoder layers and their feed-forward module are, for
            other layouts (see :func:`decoder_layers`; GPT-2 and GPT-NeoX are known).
        layers: 0-based decoder layer indices; None: scaled to the model (:mod:`smf.model.sizes`: a quarter,
            half and three quarters of the depth; the paper's 6, 12, 18 at Qwen-2.5-0.5B).
        mode: ``"replacement"``, ``"additive"`` or ``"additive+s"`` (see :class:`MemoryBlock`).
        alpha_init: initial scalar of the memory branch in additive modes (paper: 0.01).
        dtype: the memories' dtype (None: float32). Each memory is drawn in float32 and cast as it is built,
            its value table a block of rows at a time on CPU (``ProductKeyMemory(dtype=)``): bit for bit the
            float32 memories of the same seed cast afterwards, but no table held in float32 whole (elsewhere one
            at a time; a float32 build cast afterwards holds them all first). ``alpha`` stays float32.
        **memory_kwargs: ProductKeyMemory arguments (n_keys, heads, topk, key_dim, value_dim,
            backend); unset sizes are scaled to the model (:mod:`smf.model.sizes`; the paper's at
            Qwen-2.5-0.5B), ``value_dim`` the hidden size. ``d_model`` is the model's hidden size.

    Also installs hooks on the module holding the layers (``model.model``) that hand each call's
    ``attention_mask`` to the blocks for the duration of that call (so padding is not counted as
    reads), and records the memories in ``model.config.smf_memories``; ``model.config`` becomes
    a config of type ``f"{model_type}_smf_memories"`` (:mod:`smf.model.hf_auto`), so that the
    directory of ``save_pretrained`` loads with its memories once smf is imported, and without smf
    through the code saved beside it (``trust_remote_code=True``), never silently without them.
    Returns the blocks, by layer index.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if "d_model" in memory_kwargs:
        raise ValueError("d_model is taken from model.config.hidden_size; do not pass it")
    given = set(memory_kwargs)
    layers_path, mlp_attr = _layout(model, layers_path, mlp_attr)
    stack, layer_list = _find_layers(model, layers_path, mlp_attr)
    if memory_blocks(model):
        raise ValueError(f"model already has memories at layers {[b.layer_index for b in memory_blocks(model)]}")
    d_model = model.config.get_text_config().hidden_size
    if layers is None:
        layers = scaled_layers(len(layer_list))
    if any(name not in given for name in SCALED_KWARGS):
        text = model.config.get_text_config()
        width = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * d_model
        scaled = scaled_memory_kwargs(d_model, width)
        if "n_keys" in given:  # the rule's topk for the n_keys given
            scaled["topk"] = max(1, min(scaled["topk"], memory_kwargs["n_keys"] // 2))
        memory_kwargs = {**{name: scaled[name] for name in SCALED_KWARGS}, **memory_kwargs}
    layers = tuple(sorted(check_layers(layers, len(layer_list))))
    config_class = memory_config_class(type(model.config)) if model.config.model_type else None
    blocks = _attach_blocks(model, stack, layer_list, mlp_attr, layers, mode, alpha_init, memory_kwargs, dtype)
    sizes = blocks[0].memory.config()
    sizes.pop("d_model")
    if config_class is None:
        logger.warning("%s has no model_type, so save_pretrained cannot mark the memories in config.json; save them "
                       "with smf.model.save_memory_adapter", type(model.config).__name__)
    else:
        _own_config(model, config_class)
    setattr(model.config, CONFIG_KEY, {"layers": list(layers), "mode": mode, "memory_kwargs": sizes,
                                       "layers_path": layers_path, "mlp_attr": mlp_attr})
    logger.info("attached %s memories at layers %s (%s each)", mode, layers, blocks[0].memory.extra_repr())
    return blocks


def attach_recorded_memories(model: nn.Module, spec) -> list[MemoryBlock]:
    """Attach the memories ``spec`` records (``config.smf_memories`` of a saved model) to ``model``, a freshly
    built model of that config's architecture: the causal LM it was saved from, another head on the same
    decoder (sequence classification, ...) or the bare decoder (``AutoModel``). Their weights are left to the
    checkpoint load that follows. The spec is checked first (:func:`smf.model.memory_spec.check_memory_spec`:
    a ValueError naming the field); ``model.config`` is not changed. What the classes smf registers for the
    ``*_smf_memories`` types, and the code saved beside a model's weights where smf is importable, call.

    Code saved before the memory projections were renamed (its weights hold ``query_proj`` ...) gets its own plain
    memories instead (returns no block), which load its weights: smf's would not."""
    spec = check_memory_spec(spec)
    saved_code = sys.modules.get(type(model).__module__)
    if (hasattr(saved_code, "PlainProductKeyMemory") and hasattr(saved_code, "attach_memories")
            and getattr(saved_code, "PROJECTIONS", None) != PROJECTIONS):
        logger.warning("%s comes from code saved beside its weights by an older smf-kernels (memory projections "
                       "named query_proj / gate_proj / out_proj): it gets that code's plain PyTorch memories, forward "
                       "only. smf.model.from_pretrained(directory) loads it with smf's memories, and saving that "
                       "model writes the current format.", type(model).__name__)
        saved_code.attach_memories(model, spec)
        return []
    layers_path = layers_path_in(spec, model)
    try:
        stack, layer_list = _find_layers(model, layers_path, spec["mlp_attr"])
    except ValueError as err:
        raise ValueError(f"config.{CONFIG_KEY}.layers_path / mlp_attr: {err}") from None
    spec = check_memory_spec(spec, len(layer_list))
    if memory_blocks(model):  # built by a head whose decoder is an AutoModel of the same config: attached there
        return memory_blocks(model)
    return _attach_blocks(model, stack, layer_list, spec["mlp_attr"], spec["layers"], spec["mode"],
                          DEFAULT_ALPHA_INIT, spec["memory_kwargs"])  # the checkpoint load then sets alpha


def _attach_blocks(model: nn.Module, stack: nn.Module, layer_list: nn.ModuleList, mlp_attr: str, layers, mode: str,
                   alpha_init: float, memory_kwargs: dict, dtype: torch.dtype | None = None) -> list[MemoryBlock]:
    """A fresh memory block (its memory fp32, or ``dtype``) in place of ``layer.{mlp_attr}`` at each of ``layers``
    of ``layer_list`` (``stack``'s), by layer index."""
    d_model = model.config.get_text_config().hidden_size
    blocks = []
    for index in layers:
        layer = layer_list[index]
        device = next(layer.parameters()).device
        # transformers 4.x builds a model to load with its parameters on "meta" and its buffers real: so do we
        with torch.device(device) if device.type != "meta" else contextlib.nullcontext():
            memory = ProductKeyMemory(d_model, **memory_kwargs, dtype=dtype)
            memory = memory if dtype is not None else memory.float()
        mlp = None if mode == "replacement" else getattr(layer, mlp_attr)
        block = MemoryBlock.create(memory, mlp, mode, index, alpha_init=alpha_init)
        block.set_owner(layer)
        setattr(layer, mlp_attr, block)
        blocks.append(block)
    _install_mask_hooks(stack, blocks)
    return blocks


def _own_config(model: nn.Module, config_class: type) -> None:
    """Give ``model`` (and each submodule sharing its config) a copy of its config of class
    ``config_class``, leaving the caller's config object (e.g. one passed to ``from_config``) as it was."""
    old = model.config
    if type(old) is config_class:
        return
    new = copy.deepcopy(old)
    new.__class__ = config_class
    for module in model.modules():
        if getattr(module, "config", None) is old:
            module.config = new


def _install_mask_hooks(stack: nn.Module, blocks: list[MemoryBlock]) -> None:
    signature = inspect.signature(stack.forward)

    def stash_mask(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is None and args:
            try:
                mask = signature.bind_partial(*args).arguments.get("attention_mask")
            except TypeError:
                mask = None
        for block in blocks:
            block.attention_mask = mask

    def clear_mask(module, args, kwargs, output):
        for block in blocks:
            block.attention_mask = None

    stack.register_forward_pre_hook(stash_mask, with_kwargs=True)
    stack.register_forward_hook(clear_mask, with_kwargs=True, always_call=True)


use_attach(attach_recorded_memories)  # the *_smf_memories classes attach through it (no import circle)
