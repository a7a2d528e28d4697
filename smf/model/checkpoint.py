"""Loading base models and saving / loading what the method adds (the memories) on top of them."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from smf.model.attach import CONFIG_KEY, attach_memories, memory_blocks
from smf.model.block import MODES, MemoryBlock
from smf.model.hf_auto import SUFFIX, register_memory_type
from smf.vocabulary import DEFAULT_MODEL, canonical
from smf_kernels import ProductKeyMemory

logger = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "memory_adapter.safetensors"
ADAPTER_CONFIG = "memory_adapter.json"


def _not_found(name_or_path: str, err: Exception) -> OSError:
    offline = os.environ.get("HF_HUB_OFFLINE", "0")
    return OSError(
        f"could not load {name_or_path!r}: it is not a local directory and could not be fetched from the "
        f"Hugging Face hub or its cache (HF_HUB_OFFLINE={offline}). Download it where there is network access "
        f"(`huggingface-cli download {name_or_path}`) or pass a local path. Cause: {err}"
    )


def load_base_model(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> nn.Module:
    """A pretrained causal LM (default: the paper's Qwen-2.5-0.5B-Instruct) in eval mode."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    except OSError as err:
        raise _not_found(name_or_path, err) from err
    return model.to(device).eval()


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    """The tokenizer stored with ``name_or_path`` (a hub id or a local directory)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except OSError as err:
        raise _not_found(name_or_path, err) from err


def save_memory_adapter(model: nn.Module, directory: str | Path) -> Path:
    """Write the memories of ``model`` (weights and alpha; safetensors) and their placement (json).

    Files: ``memory_adapter.safetensors`` with keys ``layers.{i}.memory.{param}`` and
    ``layers.{i}.alpha``; ``memory_adapter.json`` with mode, layers, memory kwargs and the base
    model's name. The base model itself is not saved. Returns the directory.
    """
    blocks = memory_blocks(model)
    if not blocks:
        raise ValueError("model has no memories to save; call smf.model.attach_memories first")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for block in blocks:
        for name, tensor in block.memory.state_dict().items():
            tensors[f"layers.{block.layer_index}.memory.{name}"] = tensor.detach().cpu().contiguous()
        if block.alpha is not None:
            tensors[f"layers.{block.layer_index}.alpha"] = block.alpha.detach().cpu()
    memory_kwargs = blocks[0].memory.config()
    memory_kwargs.pop("d_model")
    config = {
        "mode": blocks[0].mode,
        "layers": [block.layer_index for block in blocks],
        "memory_kwargs": memory_kwargs,
        "base_model": getattr(getattr(model, "config", None), "_name_or_path", None),
    }
    save_file(tensors, str(directory / ADAPTER_WEIGHTS))
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
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
    return tensors


def load_memory_adapter(model: nn.Module, directory: str | Path, backend: str | None = None) -> list[MemoryBlock]:
    """Attach the memories saved in ``directory`` to ``model`` (a base model without memories).

    The files are read and checked first (names, shapes, dtypes): a missing, truncated, corrupt or
    mismatched adapter raises (FileNotFoundError / ValueError) and leaves ``model`` unchanged.
    """
    directory = Path(directory)
    config = read_adapter_config(directory)
    tensors = _read_adapter_tensors(directory, config, model.config.hidden_size)
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


def load_model_with_memories(base_name_or_path: str | None, adapter_dir: str | Path,
                             dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                             backend: str | None = None) -> nn.Module:
    """Base model with the adapter's memories attached; ``base_name_or_path`` None uses the base
    model recorded in the adapter."""
    if base_name_or_path is None:
        base_name_or_path = read_adapter_config(adapter_dir)["base_model"]
        if not base_name_or_path:
            raise ValueError(f"the adapter in {str(adapter_dir)!r} records no base model; pass base_name_or_path")
    model = load_base_model(base_name_or_path, dtype=dtype, device=device)
    load_memory_adapter(model, adapter_dir, backend=backend)
    return model.eval()


def from_pretrained(directory: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    backend: str | None = None, **kwargs) -> nn.Module:
    """A causal LM saved by ``model.save_pretrained(directory)``, with its memories, in eval mode.

    ``save_pretrained`` of a model with memories writes the model type
    ``f"{base}_smf_memories"``, ``config.smf_memories`` (layers, mode, memory sizes, layout) and
    the memory weights. This registers that type (:mod:`smf.model.hf_auto`) and returns
    ``AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)``: the base model
    with the recorded memories (fp32) attached and loaded, their kernels on ``backend``. A
    directory without memories loads as a plain model. A plain ``AutoModelForCausalLM`` load
    gives the same model once :mod:`smf.model` is imported, and fails without it.
    """
    from transformers import AutoModelForCausalLM, PreTrainedConfig

    config, _ = PreTrainedConfig.get_config_dict(directory)
    model_type = config.get("model_type", "")
    if model_type.endswith(SUFFIX):
        register_memory_type(model_type)
    elif config.get(CONFIG_KEY):
        raise ValueError(f"{directory}: config.json records {CONFIG_KEY} under model_type {model_type!r} (saved by an "
                         f"older smf); set its model_type to {model_type + SUFFIX!r} to load it with its memories")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
    for block in memory_blocks(model):
        block.memory.backend = backend
    if model_type.endswith(SUFFIX):
        logger.info("loaded %s memories at layers %s from %s", config[CONFIG_KEY]["mode"],
                    config[CONFIG_KEY]["layers"], directory)
    return model.to(device).eval()
