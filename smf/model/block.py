"""MemoryBlock: a decoder layer's feed-forward slot holding a product-key memory
(docs/method.md#placement-in-qwen-2)."""
from __future__ import annotations

import torch
from torch import nn

from smf.vocabulary import MEMORY_MODES as MODES
from smf_kernels import ProductKeyMemory

_MEMORY_PARTS = ("memory", "alpha")  # what a block adds to the module it stands for


class MemoryBlock(nn.Module):
    """Stands in for ``layer.mlp`` of one decoder layer; build one with :meth:`create`.

    - ``replacement``: ``out = mem(h)``; the original MLP is dropped. The block is a module of
      its own holding ``memory``.
    - ``additive`` / ``additive+s``: ``out = mlp(h) + alpha * mem(h)``, ``alpha`` a scalar
      parameter; the two modes differ only in whether sparse training trains ``alpha``
      (see :func:`smf.model.configure_trainable`). The block is the original MLP module itself,
      given ``memory`` and ``alpha`` and a class that derives from both its own class and
      MemoryBlock (e.g. ``Qwen2MLPWithMemory``): the MLP keeps its parameter names, so a
      checkpoint holds the base model's weights under the base model's keys, plus
      ``...mlp.memory.*`` and ``...mlp.alpha``.

    The memory and ``alpha`` are fp32 whatever the base model's dtype (the memory in another dtype only where
    asked: ``attach_memories(dtype=)``, the authors' bf16 weights): ``h`` is cast to the memory's dtype
    for the memory and the memory branch is cast back to ``h``'s dtype. ``model.to(dtype)``,
    ``.half()`` and ``.bfloat16()`` convert the original MLP but leave the memory and ``alpha``
    in their dtype (devices still move).

    Padding: the owning model's pre-forward hook (installed by
    :func:`smf.model.attach_memories`) stores the call's 2-D ``attention_mask``
    ``(batch, past + current length)`` in ``self.attention_mask`` and clears it afterwards.
    When the memory counts reads, the last ``seq`` columns of that mask become its
    ``valid_mask``, so padded positions are not counted. No mask means all positions valid.
    :func:`smf.model.reads_counted_at_loss` narrows the counted positions further to those a loss scores
    (``self.read_mask``, (batch, seq) bool, set for the duration of a forward).
    Activation checkpointing re-runs this forward during backward, after the mask is cleared,
    so read counts would be added twice (and padding counted): a forward that counts reads
    while the owning decoder layer (``owner``, set by :func:`smf.model.attach_memories`) has
    Hugging Face gradient checkpointing on raises RuntimeError.
    """

    memory: ProductKeyMemory
    alpha: nn.Parameter | None

    def __init__(self, memory: ProductKeyMemory, layer_index: int) -> None:
        """A replacement block (no MLP); :meth:`create` builds blocks of every mode."""
        super().__init__()
        self._set_memory(memory, "replacement", layer_index, None)

    @classmethod
    def create(cls, memory: ProductKeyMemory, mlp: nn.Module | None, mode: str, layer_index: int,
               alpha_init: float = 0.01) -> "MemoryBlock":
        """The block of ``mode`` at decoder layer ``layer_index``: for ``replacement`` (``mlp`` None)
        a new module; for the additive modes ``mlp`` itself, turned into a block in place."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if (mlp is None) != (mode == "replacement"):
            raise ValueError(f"mode {mode!r} needs {'no' if mode == 'replacement' else 'the original'} mlp")
        if mlp is None:
            return cls(memory, layer_index)
        if isinstance(mlp, MemoryBlock):
            raise ValueError(f"layer {layer_index}'s feed-forward module already holds a memory")
        clash = [name for name in _MEMORY_PARTS if hasattr(mlp, name)]
        if clash:
            raise ValueError(f"{type(mlp).__name__} already has attributes {clash}; cannot add a memory to it")
        mlp.__class__ = with_memory_class(type(mlp))
        mlp._set_memory(memory, mode, layer_index, alpha_init)
        return mlp

    def _set_memory(self, memory: ProductKeyMemory, mode: str, layer_index: int, alpha_init: float | None) -> None:
        self.mode = mode
        self.layer_index = layer_index
        self.memory = memory
        if alpha_init is None:
            self.alpha = None
        else:
            self.alpha = nn.Parameter(torch.tensor(float(alpha_init), dtype=torch.float32,
                                                   device=memory.values.device))
        self.attention_mask: torch.Tensor | None = None
        self.read_mask: torch.Tensor | None = None
        self._owner: list[nn.Module] = []  # a list, so the decoder layer is not registered as a submodule

    @property
    def has_mlp(self) -> bool:
        """Whether the block keeps the original MLP (the additive modes)."""
        return self.alpha is not None

    def set_owner(self, layer: nn.Module) -> None:
        """Record the decoder layer this block sits in (to see whether it is gradient-checkpointed)."""
        self._owner = [layer]

    def _checkpointed(self) -> bool:
        layer = self._owner[0] if self._owner else None
        return layer is not None and bool(getattr(layer, "gradient_checkpointing", False)) and layer.training

    def _apply(self, fn, recurse=True):
        """Like nn.Module._apply, but the memory and alpha keep their floating dtype (fp32): ``fn``
        applies to the original MLP's weights, and only its device change to the memory and alpha."""
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
                modules.update(self._modules)  # keys exist already: the order stays
                params.update(self._parameters)
                buffers.update(self._buffers)
        finally:
            self._modules, self._parameters, self._buffers = modules, params, buffers
        return self

    def valid_mask(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Bool (batch, seq) of the positions whose reads count for ``hidden`` (batch, seq, d): the real
        (non-padding) ones, and of those only the ones in ``read_mask`` when it is set; or None (all)."""
        mask, read_mask = self.attention_mask, getattr(self, "read_mask", None)
        batch, seq = hidden.shape[0], hidden.shape[1]
        if read_mask is not None and tuple(read_mask.shape) != (batch, seq):
            raise ValueError(f"read_mask of shape {tuple(read_mask.shape)} does not match the hidden states' "
                             f"(batch={batch}, seq={seq})")
        read_mask = None if read_mask is None else read_mask.to(device=hidden.device, dtype=torch.bool)
        if mask is None:
            return read_mask
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise ValueError("counting memory reads needs a 2-D attention_mask (batch, past + current length) of "
                             f"0/1; got {type(mask).__name__} with shape {getattr(mask, 'shape', None)}")
        if mask.shape[0] != batch or mask.shape[1] < seq:
            raise ValueError(f"attention_mask of shape {tuple(mask.shape)} does not cover hidden states of "
                             f"shape (batch={batch}, seq={seq}, ...): need (batch, >= seq)")
        valid = mask[:, -seq:].to(device=hidden.device, dtype=torch.bool)
        return valid if read_mask is None else valid & read_mask

    def mlp_forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The original MLP's output alone (additive modes): hidden (batch, seq, d_model) -> same shape."""
        if not self.has_mlp:
            raise ValueError(f"a {self.mode} block at layer {self.layer_index} has no MLP")
        return super().forward(hidden, *args, **kwargs)

    def forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """hidden: (batch, seq, d_model) -> (batch, seq, d_model) in hidden's dtype; other arguments go to the MLP."""
        if self.memory.count_reads and torch.is_grad_enabled() and self._checkpointed():
            raise RuntimeError(
                f"memory at layer {self.layer_index} counts reads while gradient checkpointing is on: the "
                "backward would re-run this forward and count every read twice. Call "
                "model.gradient_checkpointing_disable() while reads are counted (SMF training, background "
                "statistics)."
            )
        valid = self.valid_mask(hidden) if self.memory.count_reads else None
        read = self.memory(hidden.to(self.memory.values.dtype), valid_mask=valid)
        if self.alpha is None:
            return read.to(hidden.dtype)
        return super().forward(hidden, *args, **kwargs) + (self.alpha * read).to(hidden.dtype)

    def extra_repr(self) -> str:
        own = super().extra_repr() if self.has_mlp else ""
        return ", ".join(part for part in (own, f"mode={self.mode}, layer_index={self.layer_index}") if part)


_with_memory_classes: dict[type, type] = {}


def with_memory_class(mlp_class: type) -> type:
    """The class of an additive block built from an ``mlp_class`` module: MemoryBlock first (its
    ``forward`` adds the memory to ``mlp_class.forward``), then ``mlp_class``. Created once per class
    and importable from this module by its name (e.g. ``Qwen2MLPWithMemory``), so models pickle."""
    if mlp_class not in _with_memory_classes:
        name = f"{mlp_class.__name__}WithMemory"
        if name in globals():
            name = f"{mlp_class.__module__.replace('.', '_')}_{name}"
        derived = type(name, (MemoryBlock, mlp_class), {"__module__": __name__, "__qualname__": name})
        globals()[name] = derived
        _with_memory_classes[mlp_class] = derived
    return _with_memory_classes[mlp_class]
