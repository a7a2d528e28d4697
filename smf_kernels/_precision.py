"""Precision rules shared by the ops and every backend."""
from __future__ import annotations

import contextlib

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are accumulated and gradients returned in: fp32 for fp32 / bf16 / fp16
    inputs, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def no_autocast(device: torch.device):
    """Context in which autocast is off for ``device``: op implementations pick their own precision
    (under autocast an inner matmul would silently return bf16 where a kernel expects fp32)."""
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()
