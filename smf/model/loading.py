"""Every way to load a model, in one place, for training, evaluation and the suite.

- :func:`load_base`: a base model by name: a hub id, a local ``save_pretrained`` directory, or
  ``'tiny'`` (:mod:`smf.tiny`);
- :func:`load_with_adapter`: a base model with a memory adapter (:mod:`smf.model.adapter`) attached;
- :func:`load_run`: the ``final/`` artefact of a finished training run (memory adapter, peft LoRA
  adapter or fully finetuned model, by the run's recipe);
- :func:`load_model`: whichever of these a directory holds (``smf eval``, the suite);
- :func:`from_pretrained`: a ``save_pretrained`` directory of a model with memories.

Every loader returns the model in eval mode (fp32 unless asked otherwise; :func:`from_pretrained`: the
checkpoint's dtype, as transformers) with its tokenizer, and raises ConfigError naming the argument
when a name or directory holds nothing it can load.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from smf.errors import ConfigError
from smf.model.adapter import ADAPTER_CONFIG, load_memory_adapter, read_adapter_config
from smf.model.attach import CONFIG_KEY, memory_blocks
from smf.model.hf_auto import SUFFIX, register_memory_type
from smf.model.memory_spec import check_memory_spec, forget_renaming
from smf.model.relocation import moved_roots, relocated, weights_digest
from smf.vocabulary import DEFAULT_MODEL, RECIPES, TINY_MODEL
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

logger = logging.getLogger(__name__)

# A training run directory (written by smf.train): its resolved options, and its artefact once finished.
RUN_CONFIG = "run_config.json"
FINAL_DIR = "final"


def _cannot_load(name: str, err: Exception) -> ConfigError:
    offline = os.environ.get("HF_HUB_OFFLINE", "0")
    cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return ConfigError(f"model {name!r} cannot be loaded: it is not a local directory and is not in the Hugging "
                       f"Face hub cache (HF_HUB_OFFLINE={offline}); download it where there is network access "
                       f"(`huggingface-cli download {name}`), or pass a local save_pretrained directory or "
                       f"'{TINY_MODEL}' ({cause})")


def _unreadable_weights(argument: str, name: str, err: Exception) -> ConfigError:
    """The error for a local model directory whose weights do not load (crafted, truncated, corrupt, another
    model's): one line naming the argument, never torch's advice to retry with ``weights_only=False``."""
    if isinstance(err, pickle.UnpicklingError):
        refused = next((line.strip() for line in str(err).splitlines() if "GLOBAL" in line), "")
        cause = ("a pickle holding objects other than tensors and plain values, refused unread (loading it could "
                 f"run code){': ' + refused if refused else ''}")
    else:
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return ConfigError(f"{argument} {name!r} cannot be loaded ({cause})")


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    """The tokenizer stored with ``name_or_path`` (a hub id or a local directory)."""
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except OSError as err:
        raise _cannot_load(name_or_path, err) from err


def load_base(name: str = DEFAULT_MODEL, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32, *, argument: str = "--model") -> tuple[nn.Module, object]:
    """(causal LM in eval mode, tokenizer) for a hub id, a local directory, or 'tiny' (seed 0). ConfigError naming
    ``argument`` when it cannot be loaded."""
    if name == TINY_MODEL:
        from smf.tiny import tiny_model, tiny_tokenizer  # defers transformers' Qwen-2 model code and tokenizers

        model = tiny_model(seed=0)
        model.config._name_or_path = TINY_MODEL  # recorded in adapters, so they name their base
        return model.to(device=device, dtype=dtype).eval(), tiny_tokenizer()
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    except (pickle.UnpicklingError, EOFError, SafetensorError, OSError, RuntimeError, ValueError) as err:
        if not Path(name).is_dir():
            if isinstance(err, OSError):
                raise _cannot_load(name, err) from err
            raise
        raise _unreadable_weights(argument, name, err) from err
    return model.to(device).eval(), load_tokenizer(name)


def adapter_dir(path: str | Path) -> Path:
    """The folder holding a memory adapter: ``path`` itself or the ``final/`` folder of a retrofit run."""
    for candidate in (Path(path) / FINAL_DIR, Path(path)):
        if (candidate / ADAPTER_CONFIG).is_file():
            return candidate
    raise ConfigError(f"--adapter {str(path)!r} holds no memory adapter ({ADAPTER_CONFIG}), neither directly nor "
                      f"in {FINAL_DIR}/; pass a finished retrofit run directory")


def load_with_adapter(base: str | None, adapter: str | Path, device: torch.device | str = "cpu",
                      backend: str | None = None) -> tuple[nn.Module, object]:
    """(base model with the memory adapter's memories attached, tokenizer).

    ``adapter``: an adapter folder or a retrofit run directory. ``base``: the base model, which must be
    the one the adapter was trained on: its recorded path, or the same weights elsewhere (the adapter's
    ``base_sha256``; one written before it recorded that: the recorded base's place in the run folder that moved
    with it); None uses the one the adapter records (where a run folder holding both moved: its new place there).
    """
    directory = adapter_dir(adapter)
    try:
        config = read_adapter_config(directory)
    except ConfigError:
        raise
    except (OSError, ValueError) as err:  # not an adapter this code wrote: one line naming the argument
        raise ConfigError(f"--adapter {str(adapter)!r}: {err}") from None
    recorded = config.get("base_model")
    if base is None and not recorded:
        raise ConfigError(f"the adapter in {str(directory)!r} records no base model; pass --model")
    if base is not None and recorded and recorded != base and not _same_base(base, config, directory):
        raise ConfigError(f"--adapter was trained on base model {recorded!r} but --model is {base!r}; "
                          f"pass --model {recorded}")
    base = base or relocated(recorded, _moved_with(directory))
    model, tokenizer = load_base(base, device)
    if (Path(base) / ADAPTER_CONFIG).is_file() and not memory_blocks(model):
        _warn_decoder_beside_adapter(Path(base))
    try:
        load_memory_adapter(model, directory, backend=backend)
    except ConfigError:
        raise
    except (OSError, ValueError) as err:
        raise ConfigError(f"--adapter {str(adapter)!r}: {err}") from None
    return model.to(device).eval(), tokenizer


def _same_base(base: str, config: dict, directory: Path) -> bool:
    """Whether ``base`` is the base the adapter in ``directory`` (its ``config``) was trained on, although the path
    differs from the recorded one: the same weights (the ``base_sha256`` it records), or, for an adapter written
    before it recorded one, the recorded base's place in a run folder that moved with the adapter since
    (:func:`_moved_with`)."""
    if config.get("base_sha256") is not None:
        same, how = weights_digest(base) == config["base_sha256"], "holds its weights"
    else:
        roots = _moved_with(directory)
        same = roots is not None and Path(relocated(config["base_model"], roots)).absolute() == Path(base).absolute()
        how = "is where it lies in the run folder that moved with the adapter"
    if same:
        logger.info("%s: trained on base %s; %s %s", directory, config["base_model"], base, how)
    return same


def _moved_with(directory: Path) -> tuple[Path, Path] | None:
    """(old, new) of the folder that moved with the retrofit run whose ``final/`` adapter ``directory`` is
    (:func:`smf.model.relocation.moved_roots`: its run_config.json records where it ran); None when it did not move
    or is no run's."""
    if directory.name != FINAL_DIR or not (directory.parent / RUN_CONFIG).is_file():
        return None
    try:
        return moved_roots(read_run_config(directory.parent).get("output_dir"), directory.parent)
    except ConfigError:
        return None


_warned: set[Path] = set()  # directories warned about, once a process


def _warn_decoder_beside_adapter(directory: Path) -> None:
    """Warn (once a process) that ``directory`` holds a base pretrained with its memories in the layout written
    until 2026-11-29: a plain decoder (``config.json`` of the base type) beside its memory adapter, which
    transformers loads without the memories, silently."""
    if directory.resolve() not in _warned:
        _warned.add(directory.resolve())
        logger.warning("%s: a base pretrained with memories, saved as a plain decoder beside its memory adapter (the "
                       "layout until 2026-11-29): smf loads it with its memories, transformers without them; "
                       "`python -m smf.train.pretrain --upgrade %s` re-lays it", directory, directory)


def read_run_config(run_dir: str | Path) -> dict:
    """The options a training run recorded (``run_config.json``); ConfigError unless it is a JSON object with a
    ``recipe`` of :data:`~smf.vocabulary.RECIPES` and a ``model`` name."""
    path = Path(run_dir) / RUN_CONFIG
    try:
        options = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is not a run's options (not readable JSON: {str(err).splitlines()[0]})") from None
    if not isinstance(options, dict) or options.get("recipe") not in RECIPES or not isinstance(options.get("model"),
                                                                                                str):
        raise ConfigError(f"{path} is not a run's options: expected a JSON object with 'recipe' (one of "
                          f"{', '.join(RECIPES)}) and 'model' (the base model's name)")
    return options


def load_run(run_dir: str | Path, device: torch.device | str = "cpu",
             backend: str | None = None) -> tuple[nn.Module, object]:
    """(model in eval mode, tokenizer) from the ``final/`` artefact of a finished training run. A run whose folder
    moved since (its recorded ``output_dir`` is elsewhere) finds the base and adapter it recorded inside that folder
    at their new place (:func:`smf.model.relocation.relocated`)."""
    run_dir = Path(run_dir)
    final = run_dir / FINAL_DIR
    if not (run_dir / RUN_CONFIG).is_file() or not final.is_dir():
        raise ConfigError(f"{str(run_dir)!r} is not a finished training run (needs {RUN_CONFIG} and {FINAL_DIR}/)")
    options = read_run_config(run_dir)
    if options["recipe"] == "full":
        return load_base(str(final), device, argument="--adapter")
    roots = moved_roots(options.get("output_dir"), run_dir)  # a folder that moved: its base and adapter with it
    if options["recipe"] == "lora":
        return _load_peft(relocated(options["model"], roots), final, device, relocated(options.get("adapter"), roots),
                          backend)
    return load_with_adapter(relocated(options["model"], roots), final, device, backend)


def _load_peft(base: str, adapter: Path, device: torch.device | str, memories: str | None = None,
               backend: str | None = None) -> tuple[nn.Module, object]:
    """``base`` (with the memory adapter ``memories`` attached, when given: a LoRA run of ``--adapter``) and the
    peft LoRA ``adapter`` on top."""
    from peft import PeftModel  # optional and heavy: only a LoRA adapter needs it

    model, tokenizer = load_base(base, device) if memories is None else load_with_adapter(base, memories, device,
                                                                                          backend)
    try:
        model = PeftModel.from_pretrained(model, adapter)
    except (pickle.UnpicklingError, EOFError, SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise _unreadable_weights("--adapter", str(adapter), err) from err
    return model.to(device).eval(), tokenizer


ADAPTER_KINDS = ("run", "memory", "lora", "full")


def adapter_kind(adapter: str | Path) -> str:
    """What directory ``adapter`` holds, by its files (:data:`ADAPTER_KINDS`): a training run directory
    (``run_config.json`` and ``final/``), a memory adapter (``memory_adapter.json``), a peft LoRA adapter
    (``adapter_config.json``) or a fully finetuned model (``config.json``); ConfigError if none."""
    adapter = Path(adapter)
    if not adapter.is_dir():
        raise ConfigError(f"--adapter: no such directory {str(adapter)!r}")
    for kind, marker in (("run", RUN_CONFIG), ("memory", ADAPTER_CONFIG), ("lora", "adapter_config.json"),
                         ("full", "config.json")):
        if (adapter / marker).is_file() and (kind != "run" or (adapter / FINAL_DIR).is_dir()):
            return kind
    raise ConfigError(f"--adapter {str(adapter)!r} is none of: a training run directory ({RUN_CONFIG} + "
                      f"{FINAL_DIR}/), a memory adapter ({ADAPTER_CONFIG}), a peft LoRA adapter "
                      "(adapter_config.json), a finetuned model (config.json)")


def load_model(model: str | None, adapter: str | Path | None = None, device: torch.device | str = "cpu",
               backend: str | None = None) -> tuple[nn.Module, object]:
    """(model in eval mode, tokenizer): ``model`` (a base model, see :func:`load_base`; None: the base model
    the adapter records, else :data:`~smf.vocabulary.DEFAULT_MODEL`) with what ``adapter`` holds on top
    (:func:`adapter_kind`):

    - a training run directory: :func:`load_run`, on the base model the run recorded;
    - a memory adapter: :func:`load_with_adapter`;
    - a peft LoRA adapter: LoRA on ``model``;
    - a fully finetuned model directory (``model`` unused).
    """
    if adapter is None:
        return load_base(model or DEFAULT_MODEL, device)
    kind = adapter_kind(adapter)
    if kind == "run":
        return load_run(adapter, device, backend)
    if kind == "memory":
        return load_with_adapter(model, adapter, device, backend)
    if kind == "lora":
        return _load_peft(model or DEFAULT_MODEL, Path(adapter), device)
    return load_base(str(adapter), device, argument="--adapter")


def from_pretrained(directory: str | Path, *, dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu",
                    backend: str | None = None, **kwargs) -> nn.Module:
    """A causal LM saved by ``model.save_pretrained(directory)``, with its memories, in eval mode.

    ``save_pretrained`` of a model with memories writes the model type
    ``f"{base}_smf_memories"``, ``config.smf_memories`` (layers, mode, memory sizes, layout) and
    the memory weights. This returns ``AutoModelForCausalLM.from_pretrained(directory, dtype=dtype,
    **kwargs)``: the base model with the recorded memories attached and loaded (:mod:`smf.model.hf_auto`),
    their kernels on ``backend``. ``dtype`` "auto" (the default, as in transformers) is the dtype the
    checkpoint records; the memories and ``alpha`` stay float32 whatever it is. A directory without
    memories loads as a plain model. A plain ``AutoModelForCausalLM`` load gives the same model once
    :mod:`smf.model` is imported, and ``trust_remote_code=True`` gives it without smf.
    """
    config, _ = PretrainedConfig.get_config_dict(directory)
    model_type = config.get("model_type", "")
    if model_type.endswith(SUFFIX):
        register_memory_type(model_type)
    elif config.get(CONFIG_KEY):
        raise ValueError(f"{directory}: config.json records {CONFIG_KEY} under model_type {model_type!r} (saved by an "
                         f"older smf); set its model_type to {model_type + SUFFIX!r} to load it with its memories")
    if model_type.endswith(SUFFIX):
        try:
            check_memory_spec(config.get(CONFIG_KEY))
        except ValueError as err:
            raise ValueError(f"{directory}/config.json: {err}") from None
    legacy = None
    if model_type.endswith(SUFFIX) and "key_mapping" not in kwargs:
        kwargs["key_mapping"] = legacy = _legacy_key_mapping(Path(directory), config[CONFIG_KEY])
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
    if legacy:
        forget_renaming(model, legacy)  # saved again, it writes the current layout
    for block in memory_blocks(model):
        block.memory.backend = backend
    if model_type.endswith(SUFFIX):
        logger.info("loaded %s memories at layers %s from %s", config[CONFIG_KEY]["mode"],
                    config[CONFIG_KEY]["layers"], directory)
    return model.to(device).eval()


def _legacy_key_mapping(directory: Path, spec: dict) -> dict[str, str] | None:
    """transformers' ``key_mapping`` for a directory saved before additive blocks kept the MLP's own weight
    names (2026-11-22 to 11-24: ``...{mlp_attr}.mlp.{weight}``, now ``...{mlp_attr}.{weight}``), else None."""
    index, single = directory / "model.safetensors.index.json", directory / "model.safetensors"
    if index.is_file():
        names = json.loads(index.read_text()).get("weight_map", {})
    elif single.is_file():
        with safe_open(single, "pt") as handle:
            names = list(handle.keys())
    else:
        return None
    old = f".{spec['mlp_attr']}.mlp."
    if spec["mode"] == "replacement" or not any(old in name for name in names):
        return None
    logger.info("%s holds the older layout (%s*); loading its MLP weights under their current names", directory, old)
    return {re.escape(old): f".{spec['mlp_attr']}."}
