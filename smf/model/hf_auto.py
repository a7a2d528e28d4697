"""Model types of their own for models with memories, so that ``save_pretrained`` directories
never load silently without them.

``attach_memories`` gives ``model.config`` the class ``memory_config_class(type(config))``: a
subclass of the base config class whose ``model_type`` is ``f"{base}_smf_memories"`` (e.g.
``qwen2_smf_memories``); ``save_pretrained`` writes that type to ``config.json``. Without smf,
``AutoModelForCausalLM.from_pretrained`` fails on it ("does not recognize this architecture",
naming the type). Importing :mod:`smf.model` registers the type of every tested architecture
(:data:`REGISTERED_AT_IMPORT`; :func:`register_memory_type` adds others) with ``AutoConfig`` and
``AutoModelForCausalLM``: the model class is a subclass of the base causal LM that attaches the
recorded memories (``config.smf_memories``) in ``__init__``, so the checkpoint's memory weights
load into them under their unchanged names. The base type's checkpoint key conversions
(transformers 5 renames some keys on load and save, e.g. GPT-NeoX's ``embed_out``) are
registered for the new type and class too.
"""
from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

SUFFIX = "_smf_memories"
REGISTERED_AT_IMPORT = ("qwen2", "llama", "mistral", "qwen3", "gemma2", "gpt2", "gpt_neox")

_config_classes: dict[type, type] = {}  # base config class -> its memory config class
_model_classes: dict[type, type] = {}  # memory config class -> its causal LM class


def base_model_type(config: PreTrainedConfig) -> str | None:
    """``config.model_type`` without the memory suffix (``qwen2`` for ``qwen2_smf_memories``)."""
    return getattr(config, "smf_base_model_type", getattr(config, "model_type", None))


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
                                       "__module__": __name__, "__doc__": f"{base.__name__} of a model with memories."})
        globals()[name] = derived  # importable by name, e.g. for pickle
        _share_conversions(base.model_type, derived.model_type)
        AutoConfig.register(derived.model_type, derived, exist_ok=True)
        AutoModelForCausalLM.register(derived, _deferred_model_class(derived), exist_ok=True)
        _config_classes[base] = derived
    return _config_classes[base]


def register_memory_type(model_type: str) -> type:
    """Register ``f"{model_type}_smf_memories"`` (``model_type`` a transformers type such as
    ``"qwen2"``, or already suffixed); returns its config class."""
    base_type = model_type.removesuffix(SUFFIX)
    if base_type not in CONFIG_MAPPING:
        raise ValueError(f"unknown transformers model_type {base_type!r} (from {model_type!r})")
    return memory_config_class(CONFIG_MAPPING[base_type])


def memory_model_class(config_class: type) -> type:
    """The causal LM class for a memory config class: the base causal LM whose ``__init__``
    attaches the memories recorded in ``config.smf_memories``."""
    if config_class not in _model_classes:
        base_model = MODEL_FOR_CAUSAL_LM_MAPPING[config_class.__mro__[1]]

        def __init__(self, config, *args, **kwargs):
            from smf.model.attach import CONFIG_KEY, attach_memories

            base_model.__init__(self, config, *args, **kwargs)
            spec = getattr(config, CONFIG_KEY, None)
            if not spec:
                raise ValueError(f"a {config.model_type} config must record its memories in config.{CONFIG_KEY}")
            attach_memories(self, layers=spec["layers"], mode=spec["mode"], layers_path=spec["layers_path"],
                            mlp_attr=spec["mlp_attr"], **spec["memory_kwargs"])

        name = f"{base_model.__name__}WithSmfMemories"
        model_class = type(name, (base_model,), {"config_class": config_class, "__init__": __init__,
                                                 "__module__": __name__})
        globals()[name] = model_class
        _share_conversions(base_model.__name__, name)
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
        _model_classes[config_class] = model_class
    return _model_classes[config_class]


def _share_conversions(base_key: str, key: str) -> None:
    """Give ``key`` (a model type or class name) the checkpoint conversions of ``base_key``, if any."""
    conversions = get_checkpoint_conversion_mapping(base_key)
    if conversions is not None:
        register_checkpoint_conversion_mapping(key, conversions, overwrite=True)


def _deferred_model_class(config_class: type) -> type:
    """Stands for ``memory_model_class(config_class)`` in the AutoModelForCausalLM mapping, so that
    registering at import does not import every architecture's modeling code."""

    def from_pretrained(cls, *args, **kwargs):
        return memory_model_class(config_class).from_pretrained(*args, **kwargs)

    def _from_config(cls, config, **kwargs):
        return memory_model_class(config_class)._from_config(config, **kwargs)

    return type(f"Deferred{config_class.__name__}", (), {
        "config_class": config_class, "from_pretrained": classmethod(from_pretrained),
        "_from_config": classmethod(_from_config), "__module__": __name__})


for _model_type in REGISTERED_AT_IMPORT:
    register_memory_type(_model_type)
