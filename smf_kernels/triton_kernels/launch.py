"""One Triton launch as data, so the launcher and the AOT report (benchmarks/triton_aot.py) share it.

Each Triton op builds a :class:`LaunchPlan` per kernel it launches (kernel,
grid, arguments, constexprs and ``num_warps``); the op launches it, and the
AOT report compiles exactly that specialisation for sm_90 / sm_80 without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field


# Host-side integer helpers for grids and block sizes. triton.cdiv and triton.next_power_of_2 are
# constexpr functions since Triton 3.5 and cost ~8 us per host call (0.04 us for these).
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


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
