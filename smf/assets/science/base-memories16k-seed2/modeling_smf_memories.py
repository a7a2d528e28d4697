"""Loads a model with product-key memories (saved by smf-kernels) wherever transformers loads models.

``model.save_pretrained(directory)`` of a model with memories writes this file beside the weights as
``modeling_smf_memories.py`` (with the text of ``smf/model/memory_spec.py`` in place of its import) and names
its classes in ``config.json``'s ``auto_map``, so that anything that loads models through transformers gets the
model with its memories::

    AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
    AutoModel.from_pretrained(directory, trust_remote_code=True)       # the decoder alone, memories included
    lm_eval --model hf --model_args pretrained=DIRECTORY,trust_remote_code=True ...

Which memories: where smf is importable, smf's own (``smf.model.attach.attach_recorded_memories``: the
``smf_kernels.ProductKeyMemory`` layers with their kernels, which the ``SparseMemoryController``, the
``SparseMemoryTrainer`` and every ``smf`` function recognise); otherwise (an smf whose memories name their
projections otherwise, i.e. one older than this file, or the environment variable ``SMF_SAVED_CODE_PLAIN=1``) the
plain PyTorch layers below, which need only torch and transformers: the
semantics of ``smf_kernels.ProductKeyMemory`` on its ``torch`` backend, forward only (no read counting, no
sparse value gradients; autograd gives dense gradients). ``BASE_MODEL_TYPE`` names the base architecture;
smf writes the saved model's.

Layout (``config.smf_memories``, checked at load by ``check_memory_spec``, the rules smf's loader applies):
``layers`` (0-based decoder layer indices), ``mode`` (``replacement``: the layer's MLP is replaced by the
memory; ``additive`` / ``additive+s``: ``mlp(h) + alpha * memory(h)``), ``memory_kwargs`` (n_keys, heads, topk,
key_dim, value_dim) and where the decoder layers are in the causal LM (``layers_path``, ``mlp_attr``). In the
additive modes the MLP module keeps its weights under their own names and gains ``memory`` and ``alpha``. The
memories and ``alpha`` stay float32 whatever the model's dtype. ``from_pretrained`` refuses a checkpoint that lacks
a memory tensor (transformers would leave it uninitialised), naming the tensors; it loads the memory projections of a
checkpoint saved before they were renamed (``query_proj`` / ``gate_proj`` / ``out_proj``, now ``query_map`` /
``gate_map`` / ``out_map``: names and a module type that the usual LoRA target lists and ``"all-linear"`` leave alone).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

# --- smf/model/memory_spec.py ---
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

BASE_MODEL_TYPE = 'qwen2'
SUFFIX = "_smf_memories"
PLAIN_ENV = "SMF_SAVED_CODE_PLAIN"  # set to 1: the plain PyTorch memories below even where smf is importable
_MEMORY_PARTS = ("memory", "alpha")
PROJECTIONS = ("query_map", "gate_map", "out_map")  # the memory's projections, named as smf_kernels' memory names them


def _sorted_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of each row of scores (..., C) by a stable sort of the whole row."""
    values, columns = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], columns[..., :k]


def _ranked_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of each row of scores (..., C): NaN above +inf above finite values above -inf, equal
    scores to the lower column. Returns values and int64 columns (..., k), best first.

    ``torch.topk``'s answer is that whenever a row's k + 1 best scores are distinct and not NaN (only a tie may
    be ordered otherwise); only the rows with a tie or a NaN there are sorted whole."""
    width = min(k + 1, scores.shape[-1])
    values, columns = scores.topk(width, dim=-1)
    ambiguous = (values[..., 1:] == values[..., :-1]).any(-1) | values[..., 0].isnan()
    values, columns = values[..., :k].contiguous(), columns[..., :k].contiguous()
    if ambiguous.any():
        rows = ambiguous.nonzero(as_tuple=True)
        values[rows], columns[rows] = _sorted_topk(scores[rows], k)
    return values, columns


_pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _undominated_pairs(topk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks (ia, ib) with (ia + 1) * (ib + 1) <= topk, in candidate order: with both halves sorted, any other
    pair is outranked by at least topk pairs, so only these can be among the best topk (finite scores)."""
    key = (topk, str(device))
    if key not in _pairs:
        pairs = [(i, j) for i in range(topk) for j in range(topk) if (i + 1) * (j + 1) <= topk]
        _pairs[key] = torch.tensor(pairs, dtype=torch.int64, device=device).unbind(1)
    return _pairs[key]


class PlainMemoryProjection(nn.Module):
    """``x @ weight.T + bias`` in the weight's dtype: ``nn.Linear``'s parameters, but not an ``nn.Linear``, so that
    peft's ``target_modules="all-linear"`` leaves a memory's projections alone."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


class PlainProductKeyMemory(nn.Module):
    """Product-key memory: ``out_map(r * silu(gate_map(x)))``, ``r`` the softmax-weighted sum of the
    ``heads * topk`` value rows a product-key lookup of ``query_map(x)`` finds. Parameter names and shapes as
    smf-kernels'."""

    def __init__(self, d_model: int, n_keys: int, heads: int, topk: int, key_dim: int,
                 value_dim: int | None = None) -> None:
        super().__init__()
        value_dim = d_model if value_dim is None else value_dim
        self.d_model, self.n_keys, self.heads, self.topk, self.key_dim = d_model, n_keys, heads, topk, key_dim
        self.query_map = PlainMemoryProjection(d_model, heads * key_dim)
        self.keys = nn.Parameter(torch.zeros(heads, 2, n_keys, key_dim // 2))
        self.values = nn.Parameter(torch.zeros(n_keys * n_keys, value_dim))
        self.gate_map = PlainMemoryProjection(d_model, value_dim)
        self.out_map = PlainMemoryProjection(value_dim, d_model)

    def lookup(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, d_model) -> scores (N, heads, topk) fp32 (sorted descending), slot ids (N, heads, topk) int64.

        In the parameters' precision even under autocast."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            query = self.query_map(x).view(x.shape[0], self.heads, self.key_dim)
            dtype = torch.promote_types(query.dtype, torch.float32)
            half = self.key_dim // 2
            q, k = query.to(self.keys.dtype).to(dtype), self.keys.to(dtype)
            a, i = _ranked_topk(torch.einsum("nhd,hkd->nhk", q[..., :half], k[:, 0]), self.topk)
            b, j = _ranked_topk(torch.einsum("nhd,hkd->nhk", q[..., half:], k[:, 1]), self.topk)
            if bool(a.isfinite().all() and b.isfinite().all()):
                ia, ib = _undominated_pairs(self.topk, x.device)
                scores, best = _ranked_topk(a[..., ia] + b[..., ib], self.topk)
                ia, ib = ia[best], ib[best]
            else:  # every candidate, id ia * topk + ib
                scores, best = _ranked_topk((a.unsqueeze(-1) + b.unsqueeze(-2)).flatten(-2), self.topk)
                ia, ib = torch.div(best, self.topk, rounding_mode="floor"), best % self.topk
            return scores, i.gather(-1, ia) * self.n_keys + j.gather(-1, ib)

    def forward(self, x: torch.Tensor, valid_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., d_model) -> (..., d_model). ``valid_mask`` is accepted as smf_kernels' memory takes it, and
        unused: this layer counts no reads."""
        flat = x.reshape(-1, self.d_model)
        scores, indices = self.lookup(flat)
        weights = torch.softmax(scores.float(), dim=-1)
        per_token = self.heads * self.topk
        read = F.embedding_bag(indices.view(-1, per_token), self.values, mode="sum",
                               per_sample_weights=weights.view(-1, per_token).to(self.values.dtype))
        gate = self.gate_map(flat)
        out = self.out_map(F.silu(gate) * read.to(gate.dtype))
        return out.view(*x.shape[:-1], self.d_model)


class MemoryBlock(nn.Module):
    """A decoder layer's feed-forward module with a memory. Replacement: a module of its own,
    ``memory(h)``. Additive: the original MLP module itself, given ``memory`` and ``alpha`` and a class
    deriving from MemoryBlock and its own class, ``mlp(h) + alpha * memory(h)``. The memory and alpha
    keep float32 through ``model.to(dtype)``; the memory branch is computed in float32."""

    def __init__(self, memory: nn.Module, layer_index: int) -> None:
        super().__init__()
        self._set_memory(memory, "replacement", layer_index)

    def _set_memory(self, memory: nn.Module, mode: str, layer_index: int) -> None:
        self.mode, self.layer_index, self.memory = mode, layer_index, memory
        self.alpha = None if mode == "replacement" else nn.Parameter(torch.zeros((), dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        def keep_dtype(tensor):
            out = fn(tensor)
            if tensor.is_floating_point() and out.dtype != tensor.dtype:
                return tensor.to(device=out.device)
            return out

        modules, params, buffers = self._modules, self._parameters, self._buffers
        try:
            for mine, how in ((False, fn), (True, keep_dtype)):
                self._modules = {k: v for k, v in modules.items() if (k in _MEMORY_PARTS) == mine}
                self._parameters = {k: v for k, v in params.items() if (k in _MEMORY_PARTS) == mine}
                self._buffers = {k: v for k, v in buffers.items() if (k in _MEMORY_PARTS) == mine}
                super()._apply(how, recurse)
                modules.update(self._modules)
                params.update(self._parameters)
                buffers.update(self._buffers)
        finally:
            self._modules, self._parameters, self._buffers = modules, params, buffers
        return self

    def forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        read = self.memory(hidden.to(self.memory.values.dtype))
        if self.alpha is None:
            return read.to(hidden.dtype)
        return super().forward(hidden, *args, **kwargs) + (self.alpha * read).to(hidden.dtype)


_block_classes: dict[type, type] = {}


def _additive_block(mlp: nn.Module, memory: nn.Module, mode: str, layer_index: int) -> MemoryBlock:
    mlp_class = type(mlp)
    if mlp_class not in _block_classes:
        _block_classes[mlp_class] = type(f"{mlp_class.__name__}WithMemory", (MemoryBlock, mlp_class), {})
    mlp.__class__ = _block_classes[mlp_class]
    mlp._set_memory(memory, mode, layer_index)
    return mlp


def _decoder_layers(model: nn.Module, spec: dict) -> nn.ModuleList:
    """The decoder layer list ``spec`` names, in ``model`` (the causal LM, or another head or the bare decoder
    of the same architecture); MemorySpecError naming ``layers_path`` / ``mlp_attr`` if it is not there."""
    path = layers_path_in(spec, model)
    holder, _, list_name = path.rpartition(".")
    try:
        layers = getattr(model.get_submodule(holder) if holder else model, list_name, None)
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.ModuleList) or not all(
            isinstance(getattr(layer, spec["mlp_attr"], None), nn.Module) for layer in layers):
        raise MemorySpecError(f"config.{CONFIG_KEY}.layers_path / mlp_attr: {type(model).__name__} has no decoder "
                              f"layers at {path}[i].{spec['mlp_attr']}")
    return layers


def attach_memories(model: nn.Module, spec: dict) -> None:
    """Put the plain memories that ``spec`` (``config.smf_memories``) records into ``model``, in float32."""
    spec = check_memory_spec(spec)
    layers = _decoder_layers(model, spec)
    spec = check_memory_spec(spec, len(layers))
    if any(isinstance(getattr(layer, spec["mlp_attr"]), MemoryBlock) for layer in layers):
        return  # a head whose decoder is built as an AutoModel of the same config: attached there
    kwargs = dict(spec["memory_kwargs"])
    d_model = model.config.get_text_config().hidden_size
    for index in spec["layers"]:
        layer = layers[index]
        with torch.device(next(layer.parameters()).device):
            memory = PlainProductKeyMemory(d_model, **kwargs).float()
        if spec["mode"] == "replacement":
            block = MemoryBlock(memory, index)
        else:
            block = _additive_block(getattr(layer, spec["mlp_attr"]), memory, spec["mode"], index)
        setattr(layer, spec["mlp_attr"], block)


def _library_attach():
    """smf's ``attach_recorded_memories`` where smf is importable, its memories' projections have this file's names
    (an older smf's have others) and ``SMF_SAVED_CODE_PLAIN`` is not set; else None."""
    if os.environ.get(PLAIN_ENV, "") not in ("", "0"):
        return None
    try:
        from smf.model.attach import attach_recorded_memories  # the copy saved with a model runs without smf
        from smf_kernels.memory import PROJECTIONS as library_projections
    except ImportError:
        return None
    return attach_recorded_memories if tuple(library_projections) == PROJECTIONS else None


def _model_init(self, config, *args, **kwargs):
    _bases[type(self).__name__].__init__(self, config, *args, **kwargs)
    spec = check_memory_spec(getattr(config, CONFIG_KEY, None))
    library_attach = _library_attach()
    if library_attach is not None:
        library_attach(self, spec)
    else:
        attach_memories(self, spec)


def _from_pretrained(cls, *args, **kwargs):
    """The base class's ``from_pretrained``, refusing a checkpoint that lacks a memory tensor (``load_whole``)."""
    mine = next(klass for klass in cls.__mro__ if klass.__name__ in _bases and klass.__module__ == __name__)
    return load_whole(super(mine, cls).from_pretrained, args, kwargs)


def _share_conversions(base_key: str, key: str) -> None:
    """Give ``key`` the checkpoint key conversions transformers (5.x) applies to ``base_key``, if any."""
    try:
        from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                     register_checkpoint_conversion_mapping)
    except ImportError:  # transformers 4.x converts no checkpoint keys
        return
    conversions = get_checkpoint_conversion_mapping(base_key)
    if conversions is not None:
        register_checkpoint_conversion_mapping(key, conversions, overwrite=True)


_base_config = CONFIG_MAPPING[BASE_MODEL_TYPE]
CONFIG_CLASS_NAME = f"{_base_config.__name__.removesuffix('Config')}SmfMemoriesConfig"
globals()[CONFIG_CLASS_NAME] = config_class = type(CONFIG_CLASS_NAME, (_base_config,), {
    "model_type": BASE_MODEL_TYPE + SUFFIX, "__module__": __name__})
_share_conversions(BASE_MODEL_TYPE, BASE_MODEL_TYPE + SUFFIX)
_bases: dict[str, type] = {}  # class name -> the transformers class it derives from
for _auto_name in AUTO_CLASSES:
    _mapping = getattr(transformers, _auto_name)._model_mapping
    if _base_config not in _mapping:
        continue
    _base = _mapping[_base_config]
    _name = f"{_base.__name__}WithSmfMemories"
    _bases[_name] = _base
    globals()[_name] = type(_name, (_base,), {"config_class": config_class, "__init__": _model_init,
                                              "from_pretrained": classmethod(_from_pretrained),
                                              "__module__": __name__})
    _share_conversions(_base.__name__, _name)
    # a head builds its decoder with AutoModel.from_config(config): this file's class, with no prompt for code
    getattr(transformers, _auto_name).register(config_class, globals()[_name], exist_ok=True)
MODEL_CLASS_NAME = next(iter(_bases), None)  # the causal LM's class (AUTO_CLASSES' first)
