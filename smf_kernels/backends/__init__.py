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

A backend is a :class:`Backend` (``torch_impl``): its methods are the ops' torch implementations, and the
``ext`` and ``triton`` backends are subclasses (``ext_impl.ExtBackend``, ``triton_impl.TritonBackend``) that
override the ops they have kernels for, so an op a backend lacks runs as torch (the README's table says which).
Each adapter module holds its instance as ``BACKEND``; :func:`implementation` returns it.
:mod:`smf_kernels.ops` validates arguments, resolves the backend once per call and dispatches to its methods.
The raw Triton kernels live apart, in :mod:`smf_kernels.triton_kernels`, and the C++ / CUDA ones in ``csrc/``;
adapters import kernels, never this registry.
"""
from __future__ import annotations

import functools
import importlib
import os

import torch

from smf_kernels.backends.torch_impl import Backend
from smf_kernels.names import BACKENDS

ENV_VAR = "SMF_KERNELS_BACKEND"


class BackendUnavailableError(RuntimeError):
    """Raised when a requested backend cannot run on the given device."""


@functools.lru_cache(maxsize=None)
def _load(name: str) -> tuple[Backend | None, str]:
    """Import a backend's implementation module; return (its Backend, reason-if-missing)."""
    module_name = {
        "torch": "smf_kernels.backends.torch_impl",
        "triton": "smf_kernels.backends.triton_impl",
        "ext": "smf_kernels.backends.ext_impl",
    }[name]
    try:
        return importlib.import_module(module_name).BACKEND, ""
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
    backend, reason = _load(name)
    return None if backend is not None else f"backend {name!r} could not be imported ({reason})"


def unavailable_reason(name: str, device: torch.device | str) -> str | None:
    """None if backend ``name`` can run on ``device`` (a torch.device or a string such as "cpu"),
    else a human-readable reason."""
    device = torch.device(device)
    if name not in BACKENDS:
        return f"unknown backend {name!r}; expected one of {BACKENDS}"
    backend, reason = _load(name)
    if backend is None:
        return f"backend {name!r} could not be imported ({reason})"
    return backend.unavailable_reason(device)


def _supports(name: str, dtype: torch.dtype | None) -> bool:
    """Whether backend ``name`` takes inputs of ``dtype`` (:attr:`Backend.supported_dtypes`)."""
    supported = _load(name)[0].supported_dtypes
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


def implementation(name: str) -> Backend:
    """The :class:`Backend` named ``name``, a name already checked by resolve_backend."""
    backend, reason = _load(name)
    if backend is None:
        raise BackendUnavailableError(f"backend {name!r} is not available: {reason}")
    return backend
