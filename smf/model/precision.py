"""Weight dtypes: when bf16 is on, and the authors' bf16 weights (docs/method.md#the-protocol-setting).

This project keeps fp32 weights and runs bf16 under autocast (:func:`bf16_enabled`); the memories and
``alpha`` stay fp32 through ``model.to(dtype)`` (:class:`smf.model.MemoryBlock`). The authors' code
loads the model in bf16 (``dtype="auto"``, ``smf_rebuild/memory_model.py: dtype_from_name``,
``load_qwen_with_memory``: ``model.to(dtype)`` after the memories are added) for training and
evaluation, and casts the parameters that train back to fp32 (``cast_trainable_params``,
``--trainable-param-dtype fp32``), except in full finetuning, which steps the bf16 weights directly
(``train_full_finetune.py``: no cast, no fp32 master copy). :func:`cast_like_the_authors` does the same
to a model here; the protocol field ``Protocol.bf16_weights`` says when (:mod:`smf.data.protocol`).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from smf.data.protocol import get_protocol


def bf16_enabled(setting: str, device: torch.device | str) -> bool:
    """Whether bf16 is on: ``setting`` 'on', or 'auto' on a CUDA device that supports bf16 (the authors'
    ``dtype="auto"`` gives bf16 exactly there)."""
    device = torch.device(device)
    return setting == "on" or (setting == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())


def authors_bf16_weights(protocol: str, setting: str, device: torch.device | str) -> bool:
    """Whether ``protocol`` keeps bf16 weights (not fp32 weights under autocast) with bf16 ``setting`` on ``device``."""
    return get_protocol(protocol).bf16_weights and bf16_enabled(setting, device)


@torch.no_grad()
def cast_like_the_authors(model: nn.Module, keep_fp32: Iterable[nn.Parameter] = ()) -> nn.Module:
    """Every floating parameter and buffer of ``model`` in bf16, the memories and ``alpha`` included,
    then the parameters of ``keep_fp32`` back in fp32 (rounded through bf16, as the authors' casts round
    them). In place; returns ``model``."""
    model.to(torch.bfloat16)  # the base model and its buffers; MemoryBlock keeps its memory and alpha
    for param in model.parameters():
        if param.is_floating_point():
            param.data = param.data.to(torch.bfloat16)
    for param in keep_fp32:
        param.data = param.data.to(torch.float32)
    return model
