"""smf-kernels: kernel-backed product-key memory layers for Sparse Memory Finetuning.

Layers, top to bottom; a module imports only from its own package or from a lower layer, never inside a function
(tests/test_import_graph.py checks it):

1. ``smf_kernels.hf``: the Hugging Face Trainer integration;
2. ``smf_kernels.sparse`` (the sparse step, its fills, finishing sequence, ablations and optimizers),
   ``smf_kernels.fsdp`` (the base model under FSDP2, the memories left out), ``smf_kernels.patch`` (knowledge
   patches: the rows a finetune changed);
3. ``smf_kernels.sharded``: memories whose value tables are split by columns over ranks;
4. ``smf_kernels.memory``: :class:`ProductKeyMemory`;
5. ``smf_kernels.ops``: the ops with their autograd and checks;
6. ``smf_kernels.backends``: the registry and the backends, a class each (torch, the base; triton, ext);
7. ``smf_kernels.triton_kernels`` (raw kernels), ``reference`` (the float64 oracle), ``build_ext``, ``_checks``,
   ``projection``, ``huge_pages`` (value tables allocated on transparent huge pages);
8. ``smf_kernels._rows``, ``smf_kernels._precision``, ``smf_kernels.names`` (the words callers pass as strings:
   scoring rules, backends; it imports nothing, so ``smf --help`` reads them without torch).

This package's own namespace imports its exports when one is first read (PEP 562), so that importing
``smf_kernels.names`` loads no torch; ``from smf_kernels import ProductKeyMemory`` works as before.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it, imported when the name is first read
_EXPORTS = {
    "BackendUnavailableError": "smf_kernels.backends",
    "available_backends": "smf_kernels.backends",
    "resolve_backend": "smf_kernels.backends",
    "ProductKeyMemory": "smf_kernels.memory",
    "product_key_topk": "smf_kernels.ops",
    "silu_mul": "smf_kernels.ops",
    "weighted_gather": "smf_kernels.ops",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'smf_kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
