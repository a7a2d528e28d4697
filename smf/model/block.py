"""MemoryBlock: a decoder layer's feed-forward slot holding a product-key memory
(docs/method.md#placement-in-qwen-2)."""
from __future__ import annotations

import torch
from torch import nn

from smf.vocabulary import MEMORY_MODES as MODES
from smf.vocabulary import canonical
from smf_kernels import ProductKeyMemory


class MemoryBlock(nn.Module):
    """Stands in for ``layer.mlp`` of one decoder layer.

    - ``replacement``: ``out = mem(h)``; the original MLP is dropped.
    - ``additive`` / ``additive+s``: ``out = mlp(h) + alpha * mem(h)``, ``alpha`` a scalar
      parameter; the two modes differ only in whether sparse training trains ``alpha``
      (see :func:`smf.model.configure_trainable`).

    The memory and ``alpha`` are fp32 whatever the base model's dtype: ``h`` is cast to fp32
    for the memory and the memory branch is cast back to ``h``'s dtype. ``model.to(dtype)``,
    ``.half()`` and ``.bfloat16()`` convert the original MLP but leave the memory and ``alpha``
    in float32 (devices still move).

    Padding: the owning model's pre-forward hook (installed by
    :func:`smf.model.attach_memories`) stores the call's 2-D ``attention_mask``
    ``(batch, past + current length)`` in ``self.attention_mask`` and clears it afterwards.
    When the memory counts reads, the last ``seq`` columns of that mask become its
    ``valid_mask``, so padded positions are not counted. No mask means all positions valid.
    Activation checkpointing re-runs this forward during backward, after the mask is cleared,
    so read counts would be added twice (and padding counted): a forward that counts reads
    while the owning decoder layer (``owner``, set by :func:`smf.model.attach_memories`) has
    Hugging Face gradient checkpointing on raises RuntimeError.
    """

    def __init__(self, memory: ProductKeyMemory, mlp: nn.Module | None, mode: str, layer_index: int,
                 alpha_init: float = 0.01) -> None:
        super().__init__()
        mode = canonical(mode, "mode")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if (mlp is None) != (mode == "replacement"):
            raise ValueError(f"mode {mode!r} needs {'no' if mode == 'replacement' else 'the original'} mlp")
        self.mode = mode
        self.layer_index = layer_index
        self.memory = memory
        self.mlp = mlp
        if mode == "replacement":
            self.alpha = None
        else:
            self.alpha = nn.Parameter(torch.tensor(float(alpha_init), device=memory.values.device))
        self.attention_mask: torch.Tensor | None = None
        self._owner: list[nn.Module] = []  # a list, so the decoder layer is not registered as a submodule

    def set_owner(self, layer: nn.Module) -> None:
        """Record the decoder layer this block sits in (to see whether it is gradient-checkpointed)."""
        self._owner = [layer]

    def _checkpointed(self) -> bool:
        layer = self._owner[0] if self._owner else None
        return layer is not None and bool(getattr(layer, "gradient_checkpointing", False)) and layer.training

    def _apply(self, fn, recurse=True):
        """Like nn.Module._apply, but the memory and alpha keep their floating dtype (fp32)."""
        def keep_dtype(tensor):
            out = fn(tensor)
            if tensor.is_floating_point() and out.dtype != tensor.dtype:
                return tensor.to(device=out.device)
            return out

        mlp = self._modules.get("mlp")
        if mlp is not None and recurse:
            mlp._apply(fn, recurse)
        self._modules["mlp"] = None  # hidden from nn.Module._apply, which would convert it again
        try:
            super()._apply(keep_dtype, recurse)
        finally:
            self._modules["mlp"] = mlp
        return self

    def valid_mask(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Bool (batch, seq) of real (non-padding) positions for ``hidden`` (batch, seq, d), or None."""
        mask = self.attention_mask
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise ValueError("counting memory reads needs a 2-D attention_mask (batch, past + current length) of "
                             f"0/1; got {type(mask).__name__} with shape {getattr(mask, 'shape', None)}")
        batch, seq = hidden.shape[0], hidden.shape[1]
        if mask.shape[0] != batch or mask.shape[1] < seq:
            raise ValueError(f"attention_mask of shape {tuple(mask.shape)} does not cover hidden states of "
                             f"shape (batch={batch}, seq={seq}, ...): need (batch, >= seq)")
        return mask[:, -seq:].to(device=hidden.device, dtype=torch.bool)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (batch, seq, d_model) -> (batch, seq, d_model) in hidden's dtype."""
        if self.memory.count_reads and torch.is_grad_enabled() and self._checkpointed():
            raise RuntimeError(
                f"memory at layer {self.layer_index} counts reads while gradient checkpointing is on: the "
                "backward would re-run this forward and count every read twice. Call "
                "model.gradient_checkpointing_disable() while reads are counted (SMF training, background "
                "statistics)."
            )
        valid = self.valid_mask(hidden) if self.memory.count_reads else None
        read = self.memory(hidden.to(self.memory.values.dtype), valid_mask=valid)
        if self.mlp is None:
            return read.to(hidden.dtype)
        return self.mlp(hidden) + (self.alpha * read).to(hidden.dtype)

    def extra_repr(self) -> str:
        return f"mode={self.mode}, layer_index={self.layer_index}"
