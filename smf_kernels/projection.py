"""MemoryProjection: the affine maps inside a product-key memory (query, gate and output projections)."""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn


@functools.lru_cache(maxsize=None)
def _cpu_lacks_fast_low_precision_gemm() -> bool:
    """True on CPUs without AVX-512 (torch reports AVX2 or less), where a bf16 / fp16 GEMM runs
    a slow fallback: measured ~60x slower than fp32 for (2048 x 896) @ (896 x 896) on AVX2."""
    return torch.backends.cpu.get_cpu_capability() not in ("AVX512",)


class MemoryProjection(nn.Module):
    """``x @ weight.T + bias``, with ``weight`` (out_features, in_features) and ``bias`` (out_features,) as in
    ``nn.Linear`` (same parameter names, shapes and initialisation, drawing the same random numbers), but not an
    ``nn.Linear``: tools that adapt every ``nn.Linear`` (peft's ``target_modules="all-linear"``) leave a memory's
    projections alone. LoRA on them stays possible by naming the parameters (docs/hf.md#lora-on-top-of-memories).

    ``x`` is cast to the weight's dtype (a memory's parameters may differ in dtype, e.g. bf16 projections beside
    fp32 values); a low-precision projection on a CPU without a fast bf16 / fp16 GEMM computes in fp32 and rounds
    the result back (gradients flow through the casts).
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation (kaiming-uniform weight, uniform bias of bound ``in_features ** -0.5``)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        bound = 1 / math.sqrt(self.in_features)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in_features) -> (..., out_features) in the weight's dtype."""
        x = x.to(self.weight.dtype)
        if (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)
                and _cpu_lacks_fast_low_precision_gemm()):
            return F.linear(x.float(), self.weight.float(), self.bias.float()).to(x.dtype)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
