"""Raw Triton kernels and their launch plans (the ``triton`` backend's adapter is
:mod:`smf_kernels.backends.triton_impl`). Importing a submodule needs triton."""
from __future__ import annotations

import os


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET is set: Triton kernels then run on CPU tensors, through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
