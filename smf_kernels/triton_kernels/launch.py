"""One Triton launch as data, so the launcher and the AOT report (benchmarks/triton_aot.py) share it.

Each Triton op builds a :class:`LaunchPlan` per kernel it launches (kernel,
grid, arguments, constexprs and ``num_warps``); the op launches it, and the
AOT report compiles exactly that specialisation for sm_90 / sm_80 without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LaunchPlan:
    kernel: object  # a @triton.jit function
    grid: tuple
    args: tuple  # positional arguments: tensors and ints, as the kernel takes them
    meta: dict = field(default_factory=dict)  # constexprs by name, plus num_warps / num_stages

    @property
    def name(self) -> str:
        return self.kernel.__name__ if hasattr(self.kernel, "__name__") else self.kernel.fn.__name__

    def launch(self) -> None:
        self.kernel[self.grid](*self.args, **self.meta)
