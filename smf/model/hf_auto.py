"""Model types of their own for models with memories, so that ``save_pretrained`` directories load with
their memories wherever transformers loads models, and never silently without them.

``attach_memories`` gives ``model.config`` the class ``memory_config_class(type(config))``: a subclass
of the base config class whose ``model_type`` is ``f"{base}_smf_memories"`` (e.g.
``qwen2_smf_memories``). Its ``save_pretrained`` (which ``model.save_pretrained`` calls) writes that
type to ``config.json``, ``architectures`` naming the class with memories (``Qwen2ForCausalLMWithSmfMemories``),
plus self-contained code beside it (``modeling_smf_memories.py``, from :mod:`smf.model.remote_code` with
:mod:`smf.model.memory_spec` inlined) named in ``auto_map`` for ``AutoConfig`` and each of
:data:`~smf.model.memory_spec.AUTO_CLASSES` transformers has for the base architecture (the causal LM,
``AutoModel``: the bare decoder, and the sequence / token classification and question answering heads). So a
saved directory loads:

- with smf imported (``import smf.model``): ``AutoModelForCausalLM.from_pretrained(d)`` (or another of those
  auto classes, with or without ``trust_remote_code``) returns smf's class for the type, created on first use
  for any base type transformers knows (the registry of ``AutoConfig`` resolves ``*_smf_memories`` types
  lazily, nothing is registered at import): the base class whose ``__init__`` checks and attaches the recorded
  memories (``config.smf_memories``) with smf's kernels (:func:`smf.model.attach.attach_recorded_memories`,
  which ``smf.model.attach`` hands to this module with :func:`use_attach`: the two do not import each other);
- without smf: ``from_pretrained(d, trust_remote_code=True)`` runs the saved code (plain PyTorch memories,
  same logits); without ``trust_remote_code`` transformers refuses, saying the directory holds custom code and
  asking for ``trust_remote_code=True``.

The base type's checkpoint key conversions (transformers 5 renames some keys on load and save, e.g.
GPT-NeoX's ``embed_out``) are registered for the new type and classes too (transformers 4.x has none).
"""
from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

import transformers
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

from smf.model.memory_spec import AUTO_CLASSES, CONFIG_KEY, check_memory_spec, load_whole

logger = logging.getLogger(__name__)

SUFFIX = "_smf_memories"
REMOTE_CODE_FILE = "modeling_smf_memories.py"  # written beside the weights by save_pretrained
_REMOTE_CODE_SOURCE = Path(__file__).with_name("remote_code.py")
_SPEC_SOURCE = Path(__file__).with_name("memory_spec.py")
_BASE_TYPE_LINE = 'BASE_MODEL_TYPE = "qwen2"\n'  # the line of remote_code.py naming the base architecture
_SPEC_BEGIN, _SPEC_END = "# --- begin memory_spec", "# --- end memory_spec ---\n"  # replaced by memory_spec.py

_config_classes: dict[type, type] = {}  # base config class -> its memory config class
_model_classes: dict[tuple[type, str], type] = {}  # (memory config class, auto class name) -> its model class
_attach = []  # smf.model.attach.attach_recorded_memories, handed over by that module (it imports this one)


def use_attach(function) -> None:
    """Make the model classes of the ``*_smf_memories`` types attach their memories with ``function(model,
    spec)`` (:func:`smf.model.attach.attach_recorded_memories`; called when that module is imported)."""
    _attach[:] = [function]


def _auto_class(name: str):
    return getattr(transformers, name)


def base_model_type(config: PretrainedConfig) -> str | None:
    """``config.model_type`` without the memory suffix (``qwen2`` for ``qwen2_smf_memories``)."""
    return getattr(config, "smf_base_model_type", getattr(config, "model_type", None))


def decoder_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config of the decoder a memory config's memories were attached to: a copy of ``config`` of the base
    architecture's class, without ``smf_memories`` and without the ``auto_map`` and ``architectures`` naming the
    classes with memories; ``config`` itself when it is not a memory config."""
    if not getattr(type(config), "smf_base_model_type", None):
        return config
    plain = copy.deepcopy(config)
    plain.__class__ = type(config).__mro__[1]
    for name in (CONFIG_KEY, "auto_map"):
        if hasattr(plain, name):
            delattr(plain, name)
    plain.architectures = [name.removesuffix("WithSmfMemories") for name in (plain.architectures or [])] or None
    return plain


def memory_config_class(base: type) -> type:
    """The config class of models of ``base``'s type with memories, created once and registered
    with ``AutoConfig`` (and, deferred until first use, with ``AutoModelForCausalLM``)."""
    if getattr(base, "smf_base_model_type", None):
        return base
    if base not in _config_classes:
        if not base.model_type:
            raise ValueError(f"{base.__name__} has no model_type; cannot give its models with memories a type")
        name = f"{base.__name__.removesuffix('Config')}SmfMemoriesConfig"
        derived = type(name, (base,), {"model_type": base.model_type + SUFFIX, "smf_base_model_type": base.model_type,
                                       "save_pretrained": _save_config_and_code, "__module__": __name__,
                                       "__doc__": f"{base.__name__} of a model with memories."})
        globals()[name] = derived  # importable by name, e.g. for pickle
        _share_conversions(base.model_type, derived.model_type)
        AutoConfig.register(derived.model_type, derived, exist_ok=True)
        for auto_name in AUTO_CLASSES:
            if base in _auto_class(auto_name)._model_mapping:
                _auto_class(auto_name).register(derived, _deferred_model_class(derived, auto_name), exist_ok=True)
        _config_classes[base] = derived
    return _config_classes[base]


def register_memory_type(model_type: str) -> type:
    """Register ``f"{model_type}_smf_memories"`` (``model_type`` a transformers type such as
    ``"qwen2"``, or already suffixed); returns its config class. Not needed for loading: the types
    register themselves on first use once :mod:`smf.model` is imported."""
    base_type = model_type.removesuffix(SUFFIX)
    if base_type not in CONFIG_MAPPING:
        raise ValueError(f"unknown transformers model_type {base_type!r} (from {model_type!r})")
    return memory_config_class(CONFIG_MAPPING[base_type])


def _base_class(config_class: type, auto_name: str = "AutoModelForCausalLM") -> type:
    """The transformers class of ``auto_name`` for the base architecture of memory config class ``config_class``
    (KeyError if transformers has none)."""
    return _auto_class(auto_name)._model_mapping[config_class.__mro__[1]]


def memory_model_class(config_class: type, auto_name: str = "AutoModelForCausalLM") -> type:
    """The model class of ``auto_name`` (one of :data:`~smf.model.memory_spec.AUTO_CLASSES`) for a memory
    config class: the base architecture's class whose ``__init__`` attaches the memories recorded in
    ``config.smf_memories`` (checked first: a ValueError naming the field), and whose ``from_pretrained`` refuses a
    checkpoint lacking a memory tensor (:func:`~smf.model.memory_spec.load_whole`)."""
    if (config_class, auto_name) not in _model_classes:
        base_model = _base_class(config_class, auto_name)

        def __init__(self, config, *args, **kwargs):
            spec = check_memory_spec(getattr(config, CONFIG_KEY, None))
            base_model.__init__(self, config, *args, **kwargs)
            _attach[0](self, spec)

        def from_pretrained(cls, *args, **kwargs):
            return load_whole(super(model_class, cls).from_pretrained, args, kwargs)

        name = f"{base_model.__name__}WithSmfMemories"
        model_class = type(name, (base_model,), {"config_class": config_class, "__init__": __init__,
                                                 "from_pretrained": classmethod(from_pretrained),
                                                 "__module__": __name__})
        globals()[name] = model_class
        _share_conversions(base_model.__name__, name)
        _auto_class(auto_name).register(config_class, model_class, exist_ok=True)
        _model_classes[config_class, auto_name] = model_class
    return _model_classes[config_class, auto_name]


def _save_config_and_code(self, save_directory, *args, **kwargs):
    """``save_pretrained`` of a memory config: also writes :data:`REMOTE_CODE_FILE` (the self-contained
    loader of :mod:`smf.model.remote_code`, for ``trust_remote_code=True`` without smf) and names its
    classes in ``auto_map``."""
    base_config = type(self).__mro__[1]
    try:
        _base_class(type(self))
    except KeyError:
        logger.warning("%s has no causal LM class in transformers: %s will load with its memories only where "
                       "smf is imported", base_config.__name__, save_directory)
    else:
        os.makedirs(save_directory, exist_ok=True)
        (Path(save_directory) / REMOTE_CODE_FILE).write_text(saved_code(self.smf_base_model_type))
        module = REMOTE_CODE_FILE.removesuffix(".py")
        classes = {auto_name: _base_class(type(self), auto_name).__name__ for auto_name in AUTO_CLASSES
                   if base_config in _auto_class(auto_name)._model_mapping}
        self.auto_map = {**(getattr(self, "auto_map", None) or {}), "AutoConfig": f"{module}.{type(self).__name__}",
                         **{auto_name: f"{module}.{name}WithSmfMemories" for auto_name, name in classes.items()}}
        # save_pretrained names the saved module's class; a model with memories attached is of the base class
        self.architectures = [f"{name}WithSmfMemories" if name in classes.values() else name
                              for name in (getattr(self, "architectures", None) or [])]
    return base_config.save_pretrained(self, save_directory, *args, **kwargs)


def saved_code(base_model_type: str) -> str:
    """The text of ``modeling_smf_memories.py`` for a model of ``base_model_type``: :mod:`smf.model.remote_code`
    with that type and the text of :mod:`smf.model.memory_spec` in place of its import (the saved code runs
    without smf and checks ``config.smf_memories`` by the same rules as smf)."""
    source = _REMOTE_CODE_SOURCE.read_text()
    begin, end = source.find(_SPEC_BEGIN), source.find(_SPEC_END)
    if source.count(_BASE_TYPE_LINE) != 1 or begin < 0 or end < begin:
        raise RuntimeError(f"{_REMOTE_CODE_SOURCE} must hold the line {_BASE_TYPE_LINE!r} once and the "
                           f"{_SPEC_BEGIN!r} ... {_SPEC_END!r} lines")
    spec = _SPEC_SOURCE.read_text()
    spec = spec[spec.index('"""', 3) + 3:].lstrip("\n")  # without its module docstring
    source = source[:begin] + "# --- smf/model/memory_spec.py ---\n" + spec + source[end + len(_SPEC_END):]
    return source.replace(_BASE_TYPE_LINE, f"BASE_MODEL_TYPE = {base_model_type!r}\n")


def _share_conversions(base_key: str, key: str) -> None:
    """Give ``key`` (a model type or class name) the checkpoint conversions of ``base_key``, if any (transformers
    5.x; 4.x converts no keys)."""
    try:
        from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                     register_checkpoint_conversion_mapping)
    except ImportError:
        return

    conversions = get_checkpoint_conversion_mapping(base_key)
    if conversions is not None:
        register_checkpoint_conversion_mapping(key, conversions, overwrite=True)


def _deferred_model_class(config_class: type, auto_name: str) -> type:
    """Stands for ``memory_model_class(config_class, auto_name)`` in that auto class's mapping, so that
    registering a type does not import its architecture's modeling code."""

    def from_pretrained(cls, *args, **kwargs):
        return memory_model_class(config_class, auto_name).from_pretrained(*args, **kwargs)

    def _from_config(cls, config, **kwargs):
        return memory_model_class(config_class, auto_name)._from_config(config, **kwargs)

    return type(f"Deferred{config_class.__name__}{auto_name.removeprefix('AutoModel')}", (), {
        "config_class": config_class, "from_pretrained": classmethod(from_pretrained),
        "_from_config": classmethod(_from_config), "__module__": __name__})


def _memory_base_type(model_type) -> str | None:
    """The base type of ``model_type`` if it is ``f"{base}_smf_memories"`` for a base transformers knows."""
    if not isinstance(model_type, str) or not model_type.endswith(SUFFIX):
        return None
    base = model_type.removesuffix(SUFFIX)
    return base if base in CONFIG_MAPPING_NAMES else None


class _RegisteredTypes(dict):
    """The registry of model types added to transformers' ``CONFIG_MAPPING`` (its ``_extra_content``),
    which here also holds every ``f"{base}_smf_memories"`` type: registered on first lookup, so that
    ``AutoConfig`` / ``AutoModelForCausalLM`` load any architecture's memory checkpoint once smf is
    imported, at no import cost."""

    def __contains__(self, key) -> bool:
        return super().__contains__(key) or _memory_base_type(key) is not None

    def __getitem__(self, key):
        if not super().__contains__(key) and _memory_base_type(key) is not None:
            register_memory_type(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        return self[key] if key in self else default


if not isinstance(CONFIG_MAPPING._extra_content, _RegisteredTypes):
    CONFIG_MAPPING._extra_content = _RegisteredTypes(CONFIG_MAPPING._extra_content)
