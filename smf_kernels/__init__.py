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
   ``projection``;
8. ``smf_kernels._rows``, ``smf_kernels._precision``.
"""
from smf_kernels.backends import BackendUnavailableError, available_backends, resolve_backend
from smf_kernels.memory import ProductKeyMemory
from smf_kernels.ops import product_key_topk, silu_mul, weighted_gather

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "ProductKeyMemory",
    "available_backends",
    "product_key_topk",
    "resolve_backend",
    "silu_mul",
    "weighted_gather",
]
