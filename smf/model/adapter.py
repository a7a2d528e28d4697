"""Memory adapters: the memories a model gained (weights, alpha, placement) saved apart from its base model,
checked and attached again. Whole models load through :mod:`smf.model.loading`."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from smf.files import write_json_atomic
from smf.model.attach import attach_memories, memory_blocks
from smf.model.block import MODES, MemoryBlock
from smf.model.memory_mode import ALPHA_MODES, set_memory_mode
from smf.model.relocation import weights_digest
from smf.vocabulary import canonical, check_layers
from smf_kernels import ProductKeyMemory
from smf_kernels.memory import rename_legacy_projections

ADAPTER_WEIGHTS = "memory_adapter.safetensors"
ADAPTER_CONFIG = "memory_adapter.json"
MEMORY_KWARGS = ("n_keys", "heads", "topk", "key_dim", "value_dim")  # what an adapter records of its memories


def memory_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a memory adapter of ``model`` holds (``memory_adapter.safetensors``): ``layers.{i}.memory.{param}``
    and ``layers.{i}.alpha``, float32 on the CPU; ValueError when ``model`` has no memories."""
    blocks = memory_blocks(model)
    if not blocks:
        raise ValueError("model has no memories to save; call smf.model.attach_memories first")
    tensors = {}  # fp32, exactly, whatever dtype a parameter trained in (the authors' protocol keeps some bf16)
    for block in blocks:
        for name, tensor in block.memory.state_dict().items():
            tensors[f"layers.{block.layer_index}.memory.{name}"] = tensor.detach().cpu().float().contiguous()
        if block.alpha is not None:
            tensors[f"layers.{block.layer_index}.alpha"] = block.alpha.detach().cpu().float()
    return tensors


def save_memory_adapter(model: nn.Module, directory: str | Path) -> Path:
    """Write the memories of ``model`` (weights and alpha; safetensors) and their placement (json).

    Files: ``memory_adapter.safetensors`` with keys ``layers.{i}.memory.{param}`` and
    ``layers.{i}.alpha``; ``memory_adapter.json`` with mode, layers, memory kwargs, the base
    model's name and, for a base in a local directory, ``base_sha256``, the digest of its weights
    (:func:`smf.model.relocation.weights_digest`: the base is known by content when it moved). The base model
    itself is not saved. Returns the directory.
    """
    tensors = memory_tensors(model)
    blocks = memory_blocks(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    memory_kwargs = blocks[0].memory.config()
    memory_kwargs.pop("d_model")
    base = getattr(getattr(model, "config", None), "_name_or_path", None)
    digest = weights_digest(base)
    config = {
        "mode": blocks[0].mode,
        "layers": [block.layer_index for block in blocks],
        "memory_kwargs": memory_kwargs,
        "base_model": base,
        **({} if digest is None else {"base_sha256": digest}),
    }
    save_file(tensors, str(directory / ADAPTER_WEIGHTS))
    write_json_atomic(directory / ADAPTER_CONFIG, config)
    return directory


def read_adapter_config(directory: str | Path) -> dict:
    """The json written by :func:`save_memory_adapter`; ValueError if it is not one."""
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"no memory adapter in {str(directory)!r}: {ADAPTER_CONFIG} is missing")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not a memory adapter config (not valid JSON: {err})") from err
    if isinstance(config, dict):
        config["mode"] = canonical(config.get("mode"), f"{path}: mode")  # adapters written before the rename
    if (not isinstance(config, dict) or not isinstance(config.get("layers"), list)
            or not isinstance(config.get("memory_kwargs"), dict) or config.get("mode") not in MODES):
        raise ValueError(f"{path} is not a memory adapter config: expected a JSON object with 'mode' in {MODES}, "
                         "a 'layers' list and a 'memory_kwargs' object")
    unknown = sorted(set(config["memory_kwargs"]) - set(MEMORY_KWARGS))
    if unknown:
        raise ValueError(f"{path}: memory_kwargs may hold only {', '.join(MEMORY_KWARGS)}, not {', '.join(unknown)} "
                         "(the kernel backend is chosen when loading: backend=)")
    check_layers(config["layers"], argument=f"{path}: layers")
    if not isinstance(config.get("base_model"), (str, type(None))):
        raise ValueError(f"{path}: base_model must be a model name or null, got {config['base_model']!r}")
    if not isinstance(config.get("base_sha256"), (str, type(None))):
        raise ValueError(f"{path}: base_sha256 must be the base's weights digest (hex) or absent, got "
                         f"{config['base_sha256']!r}")
    return config


def _read_adapter_tensors(directory: Path, config: dict, d_model: int) -> dict[str, torch.Tensor]:
    """The adapter's tensors, checked against the names, shapes and dtypes its config implies
    (ValueError otherwise), before anything is attached to a model."""
    path = directory / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"no memory adapter in {str(directory)!r}: {ADAPTER_WEIGHTS} is missing")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {err}") from err
    for index in config["layers"]:  # an adapter saved before the memory projections were renamed
        rename_legacy_projections(tensors, f"layers.{index}.memory.")
    try:
        with torch.device("meta"):
            shapes = {name: (t.shape, t.dtype)
                      for name, t in ProductKeyMemory(d_model, **config["memory_kwargs"]).state_dict().items()}
    except (TypeError, ValueError) as err:
        raise ValueError(f"{directory / ADAPTER_CONFIG}: invalid memory_kwargs {config['memory_kwargs']}: {err}") \
            from err
    expected = {}
    for index in config["layers"]:
        expected.update({f"layers.{index}.memory.{name}": spec for name, spec in shapes.items()})
        if config["mode"] != "replacement":
            expected[f"layers.{index}.alpha"] = (torch.Size([]), torch.float32)
    if set(tensors) != set(expected):
        missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        raise ValueError(f"{path} does not match its config (mode {config['mode']!r}, layers {config['layers']}): "
                         f"missing {missing}, unexpected {unexpected}")
    for name, (shape, dtype) in expected.items():
        if tensors[name].shape != shape or tensors[name].dtype != dtype:
            raise ValueError(f"{path}: {name} must be {tuple(shape)} {dtype} for this config (d_model={d_model}), "
                             f"got {tuple(tensors[name].shape)} {tensors[name].dtype}")
        if not bool(torch.isfinite(tensors[name]).all()):
            raise ValueError(f"{path}: {name} holds non-finite values (saved by a run that diverged?)")
    return tensors


def load_memory_adapter(model: nn.Module, directory: str | Path, backend: str | None = None) -> list[MemoryBlock]:
    """Attach the memories saved in ``directory`` to ``model``: a base model without memories, or one holding
    memories at the adapter's layers and of its sizes (a base pretrained with its memories, loaded whole), whose
    weights (and mode, additive or additive+s) the adapter's replace.

    The files are read and checked first (names, shapes, dtypes, and the memories ``model`` holds): a missing,
    truncated, corrupt or mismatched adapter raises (FileNotFoundError / ValueError) and leaves ``model`` unchanged.
    """
    directory = Path(directory)
    config = read_adapter_config(directory)
    tensors = _read_adapter_tensors(directory, config, model.config.hidden_size)
    if memory_blocks(model):
        blocks = _held_memories(model, directory, config)
        for block in blocks:
            block.memory.backend = backend
    else:
        blocks = attach_memories(model, layers=config["layers"], mode=config["mode"], backend=backend,
                                 **config["memory_kwargs"])
    for block in blocks:
        prefix = f"layers.{block.layer_index}."
        state = {k[len(prefix) + len("memory."):]: v for k, v in tensors.items() if k.startswith(prefix + "memory.")}
        block.memory.load_state_dict(state, strict=True)
        if block.alpha is not None:
            with torch.no_grad():
                block.alpha.copy_(tensors[prefix + "alpha"])
    return blocks


def _held_memories(model: nn.Module, directory: Path, config: dict) -> list[MemoryBlock]:
    """The memory blocks ``model`` holds, put in the adapter's mode, when they are where the adapter's are and of
    their sizes; ValueError naming both otherwise (``model`` unchanged)."""
    blocks = memory_blocks(model)
    with torch.device("meta"):
        sizes = ProductKeyMemory(model.config.hidden_size, **config["memory_kwargs"]).config()
    held = {"layers": [block.layer_index for block in blocks], "sizes": blocks[0].memory.config()}
    modes = {block.mode for block in blocks} | {config["mode"]}
    if (held != {"layers": config["layers"], "sizes": sizes} or any(b.memory.config() != sizes for b in blocks)
            or (len(modes) > 1 and not modes <= set(ALPHA_MODES))):
        raise ValueError(f"{directory / ADAPTER_CONFIG}: the model already holds memories ({blocks[0].mode} at "
                         f"layers {held['layers']}, {held['sizes']}) that the adapter's ({config['mode']} at layers "
                         f"{config['layers']}, {sizes}) cannot replace; load the adapter on the base without them")
    return set_memory_mode(model, config["mode"]) if config["mode"] != blocks[0].mode else blocks
