"""In-kernel index guards: a Triton kernel never reads or writes outside its tensors.

The ops check index ranges on the host before launching (``smf_kernels._checks``), but not
while torch.compile traces them, and a kernel must not trust its caller anyway. So every
kernel that loads an index from a tensor masks each access it makes through that index with
:func:`in_range`, which also raises a one-element int32 error flag where an index is out of
range. The launcher makes the flag (:func:`new_error_flag`), launches, and turns a raised flag
into a Python error with :func:`raise_if_flagged`: at once on CPU (the interpreter), at the
next synchronising call on CUDA (``torch._assert_async``: no host sync on the launch path).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def in_range(err_ptr, idx, upper, mask):
    """``mask & (0 <= idx < upper)``; sets ``*err_ptr = 1`` where ``mask`` holds but ``idx`` is out of range.

    idx: an integer tensor of any shape; mask: a bool tensor broadcastable with it.
    """
    ok = (idx >= 0) & (idx < upper)
    bad = mask & ~ok
    tl.store(err_ptr + tl.zeros_like(idx).to(tl.int32), tl.full(idx.shape, 1, tl.int32), mask=bad)
    return mask & ok


def new_error_flag(device: torch.device) -> torch.Tensor:
    """A (1,) int32 zero for a kernel's :func:`in_range` calls to raise."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def raise_if_flagged(flag: torch.Tensor, message: str) -> None:
    """RuntimeError(``message``) if a kernel raised ``flag``: at once on CPU; on CUDA a device-side
    assertion that fails the next synchronising call, so the launch path never waits for the GPU."""
    torch._assert_async(flag[0] == 0, message)
