"""The rules a model's ``config.smf_memories`` must follow, written once for smf's loader and for the code
saved beside a model's weights (``save_pretrained`` copies this file's text into ``modeling_smf_memories.py``,
which must run without smf: so this module imports nothing but the standard library).

``config.smf_memories`` (written by ``smf.model.attach_memories``) is a dict: ``layers`` (distinct 0-based
decoder layer indices), ``mode`` (one of :data:`MEMORY_MODES`), ``memory_kwargs`` (the memory's sizes, keys of
:data:`MEMORY_SIZES`), ``layers_path`` (dotted path of the decoder layer list, from the causal LM) and
``mlp_attr`` (each layer's feed-forward attribute). A model with memories loads from a checkpoint only whole:
:func:`load_whole` refuses one that lacks a memory tensor.
"""
CONFIG_KEY = "smf_memories"  # the config attribute recording a model's memories
# The auto classes a saved model with memories is mapped for (where transformers has the base architecture's
# class): the causal LM it was saved from, and the other heads on the same decoder.
AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModel", "AutoModelForSequenceClassification",
                "AutoModelForTokenClassification", "AutoModelForQuestionAnswering")
MEMORY_MODES = ("replacement", "additive", "additive+s")  # as smf.vocabulary.MEMORY_MODES (tests check)
MEMORY_SIZES = ("n_keys", "heads", "topk", "key_dim", "value_dim")  # ProductKeyMemory's sizes, d_model aside
SPEC_FIELDS = ("layers", "mode", "memory_kwargs", "layers_path", "mlp_attr")
# Checkpoint keys of the memory projections as saved until 2026-11-26 (``query_proj``, ``gate_proj``, ``out_proj``,
# which the usual LoRA target lists match) -> today's names (as smf_kernels.memory.LEGACY_PROJECTIONS; tests
# check): transformers' ``key_mapping``, which :func:`load_whole` passes to ``from_pretrained``.
LEGACY_KEY_MAPPING = {rf"\.memory\.{old}\.": f".memory.{new}." for old, new in
                      (("query_proj", "query_map"), ("gate_proj", "gate_map"), ("out_proj", "out_map"))}


class MemorySpecError(ValueError):
    """A ``config.smf_memories`` that no model can be built from; the message names the field."""


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_memory_spec(spec, num_layers=None) -> dict:
    """``spec`` (``config.smf_memories``) checked, as a new dict with ``layers`` a list: MemorySpecError naming
    the field otherwise. ``num_layers``: the model's decoder layer count, to check the indices against."""
    where = "config.smf_memories"
    if not isinstance(spec, dict) or not spec:
        raise MemorySpecError(f"{where} must be a non-empty dict recording the memories, got {spec!r}")
    unknown = sorted(set(spec) - set(SPEC_FIELDS))
    missing = [field for field in SPEC_FIELDS if field not in spec]
    if unknown or missing:
        raise MemorySpecError(f"{where} must have the fields {list(SPEC_FIELDS)}; "
                              f"missing {missing}, unknown {unknown}")
    layers = spec["layers"]
    if (not isinstance(layers, (list, tuple)) or not layers
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)):
        raise MemorySpecError(f"{where}.layers must be a non-empty list of int layer indices, got {layers!r}")
    if any(i < 0 for i in layers) or len(set(layers)) != len(layers):
        raise MemorySpecError(f"{where}.layers must be distinct non-negative indices, got {list(layers)}")
    if num_layers is not None and max(layers) >= num_layers:
        raise MemorySpecError(f"{where}.layers {list(layers)}: the model has {num_layers} decoder layers "
                              f"(valid indices: 0 to {num_layers - 1})")
    if spec["mode"] not in MEMORY_MODES:
        raise MemorySpecError(f"{where}.mode must be one of {list(MEMORY_MODES)}, got {spec['mode']!r}")
    for field in ("layers_path", "mlp_attr"):
        value = spec[field]
        if not isinstance(value, str) or not value or any(not part.isidentifier() for part in value.split(".")):
            raise MemorySpecError(f"{where}.{field} must be a dotted attribute path such as 'model.layers', "
                                  f"got {value!r}")
    sizes = spec["memory_kwargs"]
    if not isinstance(sizes, dict):
        raise MemorySpecError(f"{where}.memory_kwargs must be a dict of the memory's sizes, got {sizes!r}")
    unknown = sorted(set(sizes) - set(MEMORY_SIZES))
    missing = [key for key in MEMORY_SIZES[:4] if key not in sizes]
    if unknown or missing:
        raise MemorySpecError(f"{where}.memory_kwargs must have the keys {list(MEMORY_SIZES[:4])} (and may have "
                              f"value_dim); missing {missing}, unknown {unknown}")
    for key, value in sizes.items():
        if not (_positive_int(value) or (key == "value_dim" and value is None)):
            raise MemorySpecError(f"{where}.memory_kwargs.{key} must be a positive int, got {value!r}")
    if sizes["key_dim"] % 2:
        raise MemorySpecError(f"{where}.memory_kwargs.key_dim must be even (split into two halves), "
                              f"got {sizes['key_dim']}")
    if sizes["topk"] > sizes["n_keys"]:
        raise MemorySpecError(f"{where}.memory_kwargs.topk must be <= n_keys ({sizes['n_keys']}), "
                              f"got {sizes['topk']}")
    return {**spec, "layers": list(layers), "memory_kwargs": dict(sizes)}


def layers_path_in(spec: dict, model) -> str:
    """Where ``spec``'s decoder layers are in ``model``, a model of any auto class of the architecture:
    ``spec["layers_path"]`` is recorded from the causal LM (``model.layers``, ``model`` its base model); another
    head may hold the base model under its own ``base_model_prefix`` (``transformer.layers``) and the bare
    base model holds the layers itself (``layers``)."""
    path = spec["layers_path"]
    head, _, rest = path.partition(".")
    if not rest or hasattr(model, head):
        return path
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix):
        return f"{prefix}.{rest}"
    return rest


def memory_tensors_in(model, keys) -> list[str]:
    """The names among ``keys`` (a ``from_pretrained`` load's missing or mismatched ones) of ``model``'s memory
    tensors: each memory block's ``alpha`` and its memory's state (keys, values, projections)."""
    names = set()
    for prefix, module in model.named_modules():
        memory = getattr(module, "memory", None)
        if hasattr(module, "alpha") and hasattr(memory, "state_dict"):
            names.add(f"{prefix}.alpha")
            names.update(f"{prefix}.memory.{name}" for name in memory.state_dict())
    return sorted(key for key in keys if key in names)


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def forget_renaming(model, mapping: dict[str, str]) -> None:
    """Drop ``mapping``'s renamings (a ``key_mapping`` of smf's former layouts) from the conversions transformers (5.x)
    keeps on a loaded model to apply in reverse when it saves, so that a model loaded from a checkpoint of the former
    names saves the current ones."""
    kept = getattr(model, "_weight_conversions", None)
    if isinstance(kept, list):
        model._weight_conversions = [conversion for conversion in kept
                                     if getattr(conversion, "source_patterns", None) not in
                                     [[pattern] for pattern in mapping]]


def load_whole(load, args: tuple, kwargs: dict):
    """``load(*args, **kwargs)`` (a ``from_pretrained`` of a class with memories), refused with a ValueError naming
    the directory and the memory tensors its checkpoint lacks (or holds in another shape, under
    ``ignore_mismatched_sizes=True``): transformers would leave them uninitialised (NaN or any value) while its load
    report calls them newly initialised. A checkpoint of the former projection names loads (:data:`LEGACY_KEY_MAPPING`,
    added to a ``key_mapping`` given, or else to the class's own, which transformers 4.x would use), and the model
    saves under the current names."""
    wanted = kwargs.pop("output_loading_info", False)
    given = kwargs.pop("key_mapping", None)
    if given is None:
        given = getattr(getattr(load, "__self__", None), "_checkpoint_conversion_mapping", None) or {}
    model, info = load(*args, output_loading_info=True, key_mapping={**given, **LEGACY_KEY_MAPPING}, **kwargs)
    forget_renaming(model, LEGACY_KEY_MAPPING)
    missing = memory_tensors_in(model, info["missing_keys"])
    mismatched = memory_tensors_in(model, [key if isinstance(key, str) else key[0]
                                           for key in info.get("mismatched_keys", ())])
    if missing or mismatched:
        where = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        others = len(info["missing_keys"]) - len(missing)  # a head's own new weights; or a layout of another class
        problems = []
        if missing:
            problems.append(f"lacks the memory tensors {_listed(missing)}"
                            + (f" (and {others} other weights {type(model).__name__} has)" if others else ""))
        if mismatched:
            problems.append(f"holds the memory tensors {_listed(mismatched)} in other shapes")
        raise ValueError(f"{where}: the checkpoint {' and '.join(problems)}; a model with memories loads only whole "
                         "(restore the weights file, or save the model again)")
    return (model, info) if wanted else model
