"""smf-kernels: kernel-backed product-key memory layers for Sparse Memory Finetuning."""
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
