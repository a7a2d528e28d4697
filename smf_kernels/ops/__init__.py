"""Public ops. Each validates its arguments, picks a backend and dispatches to a
``torch.library`` custom op (so models using them compile without graph breaks).
"""
from smf_kernels.ops.product_key_topk import KeyLayoutCache, product_key_topk
from smf_kernels.ops.row_adamw import row_adamw_
from smf_kernels.ops.silu_mul import silu_mul
from smf_kernels.ops.weighted_gather import GradientSink, weighted_gather

__all__ = ["GradientSink", "KeyLayoutCache", "product_key_topk", "row_adamw_", "silu_mul", "weighted_gather"]
