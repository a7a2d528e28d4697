"""Loads a causal LM with product-key memories (saved by smf-kernels) without smf-kernels installed.

``model.save_pretrained(directory)`` of a model with memories writes this file beside the weights
as ``modeling_smf_memories.py`` and names its classes in ``config.json``'s ``auto_map``, so that
anything that loads models through transformers gets the model with its memories::

    AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
    lm_eval --model hf --model_args pretrained=DIRECTORY,trust_remote_code=True ...

It needs only torch and transformers: the memory layer here is plain PyTorch with the semantics of
``smf_kernels.ProductKeyMemory`` (forward only: no read counting, no sparse value gradients; autograd
gives dense gradients). ``BASE_MODEL_TYPE`` names the base architecture; smf writes the saved model's.
Where smf is imported, transformers uses smf's own classes instead (its kernels, same logits).

Layout (``config.smf_memories``): ``layers`` (0-based decoder layer indices), ``mode``
(``replacement``: the layer's MLP is replaced by the memory; ``additive`` / ``additive+s``:
``mlp(h) + alpha * memory(h)``), ``memory_kwargs`` (n_keys, heads, topk, key_dim, value_dim) and where
the decoder layers are (``layers_path``, ``mlp_attr``). In the additive modes the MLP module keeps its
weights under their own names and gains ``memory`` and ``alpha``. The memories and ``alpha`` stay
float32 whatever the model's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

BASE_MODEL_TYPE = "qwen2"
CONFIG_KEY = "smf_memories"
SUFFIX = "_smf_memories"
_MEMORY_PARTS = ("memory", "alpha")


def _ranked_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of each row of scores (..., C): NaN above +inf above finite values above -inf, equal
    scores to the lower column. Returns values and int64 columns (..., k), best first."""
    values, columns = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], columns[..., :k]


class ProductKeyMemory(nn.Module):
    """Product-key memory: ``out_proj(r * silu(gate_proj(x)))``, ``r`` the softmax-weighted sum of the
    ``heads * topk`` value rows a product-key lookup finds. Parameter names and shapes as smf-kernels'."""

    def __init__(self, d_model: int, n_keys: int, heads: int, topk: int, key_dim: int, value_dim: int) -> None:
        super().__init__()
        self.d_model, self.n_keys, self.heads, self.topk, self.key_dim = d_model, n_keys, heads, topk, key_dim
        self.query_proj = nn.Linear(d_model, heads * key_dim, bias=True)
        self.keys = nn.Parameter(torch.zeros(heads, 2, n_keys, key_dim // 2))
        self.values = nn.Parameter(torch.zeros(n_keys * n_keys, value_dim))
        self.gate_proj = nn.Linear(d_model, value_dim, bias=True)
        self.out_proj = nn.Linear(value_dim, d_model, bias=True)

    def lookup(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, d_model) -> scores (N, heads, topk) fp32 (sorted descending), slot ids (N, heads, topk) int64.

        In the parameters' precision even under autocast."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            query = self.query_proj(x.to(self.query_proj.weight.dtype)).view(x.shape[0], self.heads, self.key_dim)
            dtype = torch.promote_types(query.dtype, torch.float32)
            half = self.key_dim // 2
            q, k = query.to(self.keys.dtype).to(dtype), self.keys.to(dtype)
            a, i = _ranked_topk(torch.einsum("nhd,hkd->nhk", q[..., :half], k[:, 0]), self.topk)
            b, j = _ranked_topk(torch.einsum("nhd,hkd->nhk", q[..., half:], k[:, 1]), self.topk)
            candidates = (a.unsqueeze(-1) + b.unsqueeze(-2)).flatten(-2)  # candidate id ia * topk + ib
            scores, best = _ranked_topk(candidates, self.topk)
            first = i.gather(-1, torch.div(best, self.topk, rounding_mode="floor"))
            second = j.gather(-1, best % self.topk)
            return scores, first * self.n_keys + second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., d_model) -> (..., d_model)."""
        flat = x.reshape(-1, self.d_model)
        scores, indices = self.lookup(flat)
        weights = torch.softmax(scores.float(), dim=-1)
        per_token = self.heads * self.topk
        read = F.embedding_bag(indices.view(-1, per_token), self.values, mode="sum",
                               per_sample_weights=weights.view(-1, per_token).to(self.values.dtype))
        gate = self.gate_proj(flat)
        out = self.out_proj(F.silu(gate) * read.to(gate.dtype))
        return out.view(*x.shape[:-1], self.d_model)


class MemoryBlock(nn.Module):
    """A decoder layer's feed-forward module with a memory. Replacement: a module of its own,
    ``memory(h)``. Additive: the original MLP module itself, given ``memory`` and ``alpha`` and a class
    deriving from MemoryBlock and its own class, ``mlp(h) + alpha * memory(h)``. The memory and alpha
    keep float32 through ``model.to(dtype)``; the memory branch is computed in float32."""

    def __init__(self, memory: ProductKeyMemory, layer_index: int) -> None:
        super().__init__()
        self._set_memory(memory, "replacement", layer_index)

    def _set_memory(self, memory: ProductKeyMemory, mode: str, layer_index: int) -> None:
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


def _additive_block(mlp: nn.Module, memory: ProductKeyMemory, mode: str, layer_index: int) -> MemoryBlock:
    mlp_class = type(mlp)
    if mlp_class not in _block_classes:
        _block_classes[mlp_class] = type(f"{mlp_class.__name__}WithMemory", (MemoryBlock, mlp_class), {})
    mlp.__class__ = _block_classes[mlp_class]
    mlp._set_memory(memory, mode, layer_index)
    return mlp


def attach_memories(model: nn.Module, spec: dict) -> None:
    """Put the memories that ``spec`` (``config.smf_memories``) records into ``model``, in float32."""
    holder, _, list_name = spec["layers_path"].rpartition(".")
    layers = getattr(model.get_submodule(holder) if holder else model, list_name)
    kwargs = dict(spec["memory_kwargs"])
    d_model = model.config.get_text_config().hidden_size
    kwargs.setdefault("value_dim", d_model)
    for index in spec["layers"]:
        layer = layers[index]
        with torch.device(next(layer.parameters()).device):
            memory = ProductKeyMemory(d_model, **kwargs).float()
        if spec["mode"] == "replacement":
            block = MemoryBlock(memory, index)
        else:
            block = _additive_block(getattr(layer, spec["mlp_attr"]), memory, spec["mode"], index)
        setattr(layer, spec["mlp_attr"], block)


def _model_init(self, config, *args, **kwargs):
    _base_model.__init__(self, config, *args, **kwargs)
    spec = getattr(config, CONFIG_KEY, None)
    if not spec:
        raise ValueError(f"a {config.model_type} config must record its memories in config.{CONFIG_KEY}")
    attach_memories(self, spec)


def _share_conversions(base_key: str, key: str) -> None:
    """Give ``key`` the checkpoint key conversions transformers applies to ``base_key``, if any."""
    conversions = get_checkpoint_conversion_mapping(base_key)
    if conversions is not None:
        register_checkpoint_conversion_mapping(key, conversions, overwrite=True)


_base_config = CONFIG_MAPPING[BASE_MODEL_TYPE]
_base_model = MODEL_FOR_CAUSAL_LM_MAPPING[_base_config]
CONFIG_CLASS_NAME = f"{_base_config.__name__.removesuffix('Config')}SmfMemoriesConfig"
MODEL_CLASS_NAME = f"{_base_model.__name__}WithSmfMemories"
globals()[CONFIG_CLASS_NAME] = config_class = type(CONFIG_CLASS_NAME, (_base_config,), {
    "model_type": BASE_MODEL_TYPE + SUFFIX, "__module__": __name__})
globals()[MODEL_CLASS_NAME] = type(MODEL_CLASS_NAME, (_base_model,), {
    "config_class": config_class, "__init__": _model_init, "__module__": __name__})
_share_conversions(_base_model.__name__, MODEL_CLASS_NAME)
_share_conversions(BASE_MODEL_TYPE, BASE_MODEL_TYPE + SUFFIX)
