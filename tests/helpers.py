"""Shared test utilities: backends under test, the relative error, gather inputs, benchmarks, a memory LM."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn

from smf_kernels import ProductKeyMemory
from smf_kernels.backends import unavailable_reason
from smf_kernels.ops import weighted_gather
from smf_kernels.sparse import BackgroundStats, RowGradSink


def backends_under_test() -> list[str]:
    """torch, triton (interpreter on CPU) and ext when it is built, on the test device."""
    names = ["torch", "triton", "ext"]
    return [n for n in names if unavailable_reason(n, torch.get_default_device()) is None]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def affine(projection: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A memory projection's map written out in plain PyTorch: x (..., in) -> x @ weight.T + bias (..., out)."""
    return x @ projection.weight.t() + projection.bias


def gather_inputs(shape, dtype, requires_grad=False):
    """Fresh random weighted_gather inputs for shape (M, D, N, L): values (M, D) of ``dtype``,
    indices (N, L) int64 in [0, M), softmax weights (N, L) fp32."""
    m, d, n, l = shape
    values = torch.randn(m, d).to(dtype).requires_grad_(requires_grad)
    indices = torch.randint(0, m, (n, l))
    weights = torch.softmax(torch.randn(n, l), -1).requires_grad_(requires_grad)
    return values, indices, weights


def gather_into_rows(values, indices, weights, rows, **kwargs) -> tuple[torch.Tensor, RowGradSink]:
    """(out, sink): :func:`weighted_gather` whose value gradient of ``rows`` ((T,) ascending distinct) goes into a
    :class:`RowGradSink` with the rows set before the backward (the sparse update's path); after a backward,
    ``sink.grad`` is their (T, D) gradient and ``values`` has none."""
    sink = RowGradSink(values, rows.numel(), fill="rows_first")
    sink.set_rows(rows, torch.ones(rows.shape, dtype=torch.bool, device=rows.device))
    return weighted_gather(values, indices, weights, grad_sink=sink, **kwargs), sink


# Relative error bounds that fit the precision of each input dtype.
# bf16 and the Triton interpreter (TRITON_INTERPRET=1, the CPU tests): it truncates every fp32->bf16 conversion
# where a GPU rounds to nearest, so interpreter bf16 errors (~3.3e-3 for a bf16 gather) run about twice a GPU's
# (~1.7e-3, H100 2026-11-23) and do not predict them: a bf16 bound set from an interpreter run is about twice
# what a GPU needs, and only a GPU run (SMF_TEST_DEVICE=cuda) measures a GPU's (issue 49).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def dry_run_names(out: str) -> list[str]:
    """The run names ``smf suite --dry-run`` printed in ``out``: the lines between its "run  state" header and its
    "total:" line."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == ["run", "state"])
    return [line.split()[0] for line in lines[start + 1:-1]]


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (the benchmarks are scripts, not a package)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class MemoryLM(nn.Module):
    """embed -> h + alpha * memory(h) -> head, the sparse stage of +S: only the memory values and alpha train.
    ``memory``: ProductKeyMemory's keyword arguments."""

    def __init__(self, vocab: int, width: int, **memory):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.memory = ProductKeyMemory(width, **memory)
        self.alpha = nn.Parameter(torch.tensor(0.5))
        self.head = nn.Linear(width, vocab)
        self.requires_grad_(False)
        self.memory.values.requires_grad_(True)
        self.alpha.requires_grad_(True)

    def forward(self, tokens, valid):
        hidden = self.embed(tokens)
        return self.head(hidden + self.alpha * self.memory(hidden, valid_mask=valid))


def random_background(model: nn.Module, documents: int, seed: int, most: int = 2) -> BackgroundStats:
    """Background statistics of ``model.memory`` from ``documents`` random count vectors (0..``most`` reads per
    slot), drawn from a generator seeded with ``seed``."""
    stats = BackgroundStats.for_memories({"memory": model.memory})
    generator = torch.Generator().manual_seed(seed)
    for _ in range(documents):
        stats.add_batch("memory", torch.randint(0, most + 1, (model.memory.num_slots,), generator=generator))
    return stats
