"""``silu(gate) * read``, the memory layer's gated read (docs/method.md#the-memory-layer, step 6), as one op.

A backend with a fused kernel (the ``ext`` one on CPU) does the forward and the backward in one pass each and
returns outputs from its cache of freed blocks; the backward recomputes ``silu(gate)`` instead of keeping it,
so the layer saves one (N, D) activation fewer than the plain composition. Elsewhere (the ``triton`` backend
included) the plain composition runs: :meth:`smf_kernels.backends.Backend.silu_mul_forward`.
"""
from __future__ import annotations

import torch

from smf_kernels._checks import FLOAT_DTYPES, check_same_device
from smf_kernels._precision import no_autocast
from smf_kernels.backends import implementation, resolve_backend


@torch.library.custom_op("smf_kernels::silu_mul", mutates_args=())
def _silu_mul(gate: torch.Tensor, read: torch.Tensor, backend: str) -> torch.Tensor:
    return implementation(backend).silu_mul_forward(gate, read)


@_silu_mul.register_fake
def _(gate, read, backend):
    return torch.empty_like(gate)


@torch.library.custom_op("smf_kernels::silu_mul_backward", mutates_args=())
def _silu_mul_backward(
    grad: torch.Tensor, gate: torch.Tensor, read: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of gate, grad of read), in gate's dtype."""
    with no_autocast(gate.device):
        return implementation(backend).silu_mul_backward(grad, gate, read)


@_silu_mul_backward.register_fake
def _(grad, gate, read, backend):
    return torch.empty_like(gate), torch.empty_like(read)


def _setup_context(ctx, inputs, output):
    gate, read, backend = inputs
    ctx.save_for_backward(gate, read)
    ctx.backend = backend


def _backward(ctx, grad):
    gate, read = ctx.saved_tensors
    grad_gate, grad_read = _silu_mul_backward(grad.contiguous(), gate, read, ctx.backend)
    return (grad_gate if ctx.needs_input_grad[0] else None, grad_read if ctx.needs_input_grad[1] else None, None)


_silu_mul.register_autograd(_backward, setup_context=_setup_context)


def silu_mul(gate: torch.Tensor, read: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``silu(gate) * read`` elementwise, ``silu(x) = x * sigmoid(x)``.

    Args:
        gate: (..., D) float tensor, the gate projection's output before the SiLU.
        read: the memory read, same shape, dtype and device as gate.
        backend: "torch", "triton", "ext" or None (see :mod:`smf_kernels.backends`).

    Returns:
        A tensor of gate's shape and dtype; differentiable w.r.t. gate and read.
    """
    for name, t in (("gate", gate), ("read", read)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must have a float dtype, got {str(t.dtype).replace('torch.', '')}")
    if read.shape != gate.shape:
        raise ValueError(f"read must have the shape of gate {tuple(gate.shape)}, got {tuple(read.shape)}")
    if read.dtype != gate.dtype:
        raise TypeError(f"read must have gate's dtype {str(gate.dtype).replace('torch.', '')}, "
                        f"got {str(read.dtype).replace('torch.', '')}")
    check_same_device("gate", gate, read=read)
    name = resolve_backend(backend, gate.device, gate.dtype)
    return _silu_mul(gate.contiguous(), read.contiguous(), name)
