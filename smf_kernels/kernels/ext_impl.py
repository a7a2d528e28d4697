"""The ``ext`` backend: the optional compiled extension built from ``csrc/``."""
from __future__ import annotations

import torch

from smf_kernels import _ext  # noqa: F401  (ImportError here = extension not built)


def unavailable_reason(device: torch.device) -> str | None:
    return f"the compiled extension has no {device.type} kernels" if device.type != "cpu" else None
