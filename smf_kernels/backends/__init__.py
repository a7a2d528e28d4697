"""Backend registry: which implementation of the ops runs for a given device.

Backends:
  * ``torch``  - plain PyTorch, any device (the reference path).
  * ``triton`` - Triton kernels; CUDA tensors, or CPU tensors when the Triton
    interpreter is enabled (``TRITON_INTERPRET=1`` before import).
  * ``ext``    - the optional compiled extension (``csrc/``), when it was built.

``backend=None`` picks, in order: the ``SMF_KERNELS_BACKEND`` environment
variable, else the fastest available backend for the tensors' device (CUDA:
triton, then ext, then torch; CPU: ext, then torch). Asking for a backend that
cannot run raises :class:`BackendUnavailableError` saying why.

Each adapter module here (``torch_impl``, ``triton_impl``, ``ext_impl``) exposes the
same functions; :mod:`smf_kernels.ops` validates arguments and dispatches to them.
The raw Triton kernels live apart, in :mod:`smf_kernels.triton_kernels`, and the C++
/ CUDA ones in ``csrc/``; adapters import kernels, never this registry.

    unavailable_reason(device) -> str | None
    topk_forward(query, keys, topk) -> (scores fp32 (N,H,k), indices int64 (N,H,k))
    gather_forward(values, indices, weights, counts, valid) -> out (N, D), values' dtype
    gather_backward(grad_out, values, indices, weights, update_rows, deterministic,
                    need_values, need_weights)
        -> (grad_values, grad_weights), both fp32 (fp64 for fp64):
           grad_values (M, D) if update_rows is None else (T, D), row t for update_rows[t];
           grad_weights (N, L); a gradient not needed has 0 rows.

The ops hand the backends ``indices``, ``weights``, ``valid`` and ``update_rows`` contiguous, and
``grad_out`` / ``grad_scores`` contiguous; ``values``, ``counts`` (written in place), ``query`` and
``keys`` may be strided views.

Optional (the op runs its plain-PyTorch form where a backend lacks one or returns None):

    topk_backward(grad_scores, query, keys, indices, need_query, need_keys) -> (grad_query, grad_keys)
    silu_mul_forward(gate, read) -> silu(gate) * read;  silu_mul_backward(grad, gate, read) -> (grad_gate, grad_read)
    row_adamw(param, exp_avg, exp_avg_sq, row_step, rows, grad, valid, lr, grad_scale, beta1, beta2, eps,
              weight_decay) -> None   (in place; smf_kernels.ops.row_adamw; the torch one runs elsewhere)
"""
from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

BACKENDS = ("torch", "triton", "ext")
ENV_VAR = "SMF_KERNELS_BACKEND"


class BackendUnavailableError(RuntimeError):
    """Raised when a requested backend cannot run on the given device."""


@functools.lru_cache(maxsize=None)
def _load(name: str) -> tuple[ModuleType | None, str]:
    """Import a backend's implementation module; return (module, reason-if-missing)."""
    module_name = {
        "torch": "smf_kernels.backends.torch_impl",
        "triton": "smf_kernels.backends.triton_impl",
        "ext": "smf_kernels.backends.ext_impl",
    }[name]
    try:
        return importlib.import_module(module_name), ""
    except ImportError as exc:  # missing optional dependency or unbuilt extension
        return None, f"{type(exc).__name__}: {exc}"


def _assume_constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo`` (about 1 s) when
    smf_kernels is imported: the decorator only sets the attribute Dynamo reads while tracing, and
    tests/test_compile_inductor.py checks that torch's own decorator sets the same one."""
    fn._dynamo_marked_constant = True
    return fn


def refresh() -> None:
    """Forget cached import results, e.g. after building the compiled extension in this process."""
    _load.cache_clear()


def construction_error(name: str | None) -> str | None:
    """Why ``backend=name`` can run on no device (an unknown name, or a module that cannot be imported: an
    extension not built, Triton missing), else None; None is the automatic choice. Whether a backend runs on a
    given device is checked when it runs (:func:`resolve_backend`)."""
    if name is None:
        return None
    if name not in BACKENDS:
        return f"unknown backend {name!r}; expected one of {BACKENDS} or None (automatic)"
    module, reason = _load(name)
    return None if module is not None else f"backend {name!r} could not be imported ({reason})"


def unavailable_reason(name: str, device: torch.device | str) -> str | None:
    """None if backend ``name`` can run on ``device`` (a torch.device or a string such as "cpu"),
    else a human-readable reason."""
    device = torch.device(device)
    if name not in BACKENDS:
        return f"unknown backend {name!r}; expected one of {BACKENDS}"
    module, reason = _load(name)
    if module is None:
        return f"backend {name!r} could not be imported ({reason})"
    return module.unavailable_reason(device)


def _supports(name: str, dtype: torch.dtype | None) -> bool:
    """Whether backend ``name`` takes inputs of ``dtype`` (a module may list SUPPORTED_DTYPES)."""
    supported = getattr(_load(name)[0], "SUPPORTED_DTYPES", None)
    return dtype is None or supported is None or dtype in supported


def available_backends(device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> list[str]:
    """Backends that can run on ``device`` (for inputs of ``dtype``, if given), fastest first."""
    device = torch.device(device)
    order = ("triton", "ext", "torch") if device.type == "cuda" else ("ext", "torch")
    return [name for name in order if unavailable_reason(name, device) is None and _supports(name, dtype)]


@_assume_constant_result
def resolve_backend(backend: str | None, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """Name of the backend to run on ``device`` for inputs of ``dtype``; raises if the choice cannot run.

    The automatic choice skips backends that do not take ``dtype`` (Triton has no float64).

    torch.compile evaluates this once while tracing and bakes the answer into
    the graph (the environment is not re-read on every call of a compiled model).
    """
    requested = backend if backend is not None else os.environ.get(ENV_VAR) or None
    if requested is None:
        return available_backends(device, dtype)[0]
    reason = unavailable_reason(requested, device)
    if reason is not None:
        source = f"environment variable {ENV_VAR}" if backend is None else "backend="
        raise BackendUnavailableError(
            f"backend {requested!r} (from {source}) cannot run on {device.type}: {reason}"
        )
    return requested


def implementation(name: str) -> ModuleType:
    """The implementation module of a backend already checked by resolve_backend."""
    module, reason = _load(name)
    if module is None:
        raise BackendUnavailableError(f"backend {name!r} is not available: {reason}")
    return module
