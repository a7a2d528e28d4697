"""Product-key top-k lookup (docs/method.md#the-memory-layer steps 2-3) as a differentiable custom op."""
from __future__ import annotations

import torch

from smf_kernels._checks import check_topk_args
from smf_kernels._precision import accumulation_dtype, no_autocast
from smf_kernels.backends import implementation, resolve_backend


class KeyLayoutCache:
    """The layout of a keys tensor that a backend's top-k reads (:meth:`Backend.prepare_topk_keys`), made once and
    made again only when the keys change: a lookup of a few decoded tokens would otherwise spend about half its time
    re-laying every key (the ``ext`` backend pads, casts and transposes them).

    The keys are taken as unchanged while their version counter (bumped by every in-place write: an optimizer step,
    ``copy_``, ``load_state_dict``), storage pointer, dtype, device, shape and strides are; the cache holds the keys it
    was built from, so that their memory cannot be reused by other keys of the same stamp. A write that bumps no
    version (through ``.data``, e.g. ``keys.data.add_(x)``, or a NumPy view) is not seen: write under ``no_grad``
    instead, or give the keys a new cache. The layout is made under ``no_grad`` from the detached keys: it never
    feeds autograd (the backward reads the live keys). One cache serves one keys tensor at a time
    (:class:`~smf_kernels.memory.ProductKeyMemory` holds one per memory).
    """

    def __init__(self) -> None:
        self._stamp: tuple | None = None
        self._keys: torch.Tensor | None = None
        self._layout: torch.Tensor | None = None

    @staticmethod
    def _stamp_of(keys: torch.Tensor, backend: str) -> tuple:
        return (backend, keys._version, keys.untyped_storage().data_ptr(), keys.storage_offset(), keys.dtype,
                keys.device, tuple(keys.shape), keys.stride())

    def layout(self, keys: torch.Tensor, backend: str) -> torch.Tensor | None:
        """The layout of ``keys`` (H, 2, n_keys, key_dim // 2) for ``backend`` (a resolved name); None where the
        backend reads the keys as they are or the keys cannot be tracked (inference tensors carry no version, a
        functorch wrapper shows no storage): those are laid out per call."""
        if keys.is_inference():
            return None
        try:
            stamp = self._stamp_of(keys, backend)
        except NotImplementedError:  # "Cannot access storage of TensorWrapper"
            return None
        if stamp != self._stamp:
            with torch.no_grad():
                self._layout = implementation(backend).prepare_topk_keys(keys.detach())
            self._stamp, self._keys = stamp, keys.detach()
        return self._layout


@torch.library.custom_op("smf_kernels::product_key_topk", mutates_args=())
def _product_key_topk(query: torch.Tensor, keys: torch.Tensor, topk: int, backend: str,
                      key_layout: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    with no_autocast(query.device):  # the kernels choose their own precision
        return implementation(backend).topk_forward(query, keys, topk, key_layout)


@_product_key_topk.register_fake
def _(query, keys, topk, backend, key_layout=None):
    shape = (query.shape[0], query.shape[1], topk)
    return query.new_empty(shape, dtype=accumulation_dtype(query.dtype)), query.new_empty(shape, dtype=torch.int64)


@torch.library.custom_op("smf_kernels::product_key_topk_backward", mutates_args=())
def _topk_backward(
    grad_scores: torch.Tensor,
    query: torch.Tensor,
    keys: torch.Tensor,
    indices: torch.Tensor,
    backend: str,
    need_query: bool,
    need_keys: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_query (N, H, key_dim), grad_keys (H, 2, n_keys, key_dim // 2)) in the scores' dtype;
    a gradient not needed comes back empty (0 elements)."""
    with no_autocast(query.device):
        grad_scores = grad_scores.to(accumulation_dtype(query.dtype)).contiguous()
        return implementation(backend).topk_backward(grad_scores, query, keys, indices, need_query, need_keys)


@_topk_backward.register_fake
def _(grad_scores, query, keys, indices, backend, need_query, need_keys):
    dtype = accumulation_dtype(query.dtype)
    return (query.new_empty(query.shape if need_query else (0,), dtype=dtype),
            keys.new_empty(keys.shape if need_keys else (0,), dtype=dtype))


def _setup_context(ctx, inputs, output):
    query, keys, _, backend, _ = inputs
    _, indices = output
    ctx.save_for_backward(query, keys, indices)
    ctx.backend = backend


def _backward(ctx, grad_scores, _grad_indices):
    query, keys, indices = ctx.saved_tensors
    need_query, need_keys = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_query, grad_keys = _topk_backward(grad_scores, query, keys, indices, ctx.backend, need_query, need_keys)
    return (grad_query.to(query.dtype) if need_query else None, grad_keys.to(keys.dtype) if need_keys else None,
            None, None, None)


_product_key_topk.register_autograd(_backward, setup_context=_setup_context)


def product_key_topk(
    query: torch.Tensor, keys: torch.Tensor, topk: int, *, backend: str | None = None,
    key_layouts: KeyLayoutCache | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``topk`` slots of a product-key memory for every (token, head).

    Args:
        query: (N, H, key_dim) float tensor; halves ``[:key_dim//2]`` and
            ``[key_dim//2:]`` are matched against the two sub-key tables.
        keys: (H, 2, n_keys, key_dim // 2), same dtype and device as query.
        topk: slots per (token, head), 1 <= topk <= n_keys.
        backend: "torch", "triton", "ext" or None (see :mod:`smf_kernels.backends`).
        key_layouts: a :class:`KeyLayoutCache` kept with ``keys``: the backend's layout of the keys is taken from
            it (made once, made again when the keys change) instead of being made on every call. Same results.
            Not used while torch.compile traces (the compiled graph lays the keys out itself).

    Returns:
        scores: (N, H, topk) float32 (float64 for float64 inputs), descending;
            differentiable w.r.t. query and keys.
        indices: (N, H, topk) int64 slot ids ``i * n_keys + j`` in [0, n_keys**2).
    """
    check_topk_args(query, keys, topk)
    if key_layouts is not None and not isinstance(key_layouts, KeyLayoutCache):
        raise TypeError(f"key_layouts must be a KeyLayoutCache or None, got {type(key_layouts).__name__}")
    name = resolve_backend(backend, query.device, query.dtype)
    if key_layouts is None or torch.compiler.is_compiling():
        return _product_key_topk(query, keys, topk, name)
    return _product_key_topk(query, keys, topk, name, key_layouts.layout(keys, name))
