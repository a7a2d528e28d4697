"""One memory layer's forward + backward at N tokens: ProductKeyMemory on the triton and torch backends against
the authors' layer (benchmarks/bench_lookup.py's AuthorsMemoryLayer), in fp32 and bf16.

    python benchmarks/gpu_layer.py                          # CUDA: N = 16,384, the paper's memory, D = 896
    python benchmarks/gpu_layer.py --tiny                   # CPU, Triton interpreter, a tiny layer
    python benchmarks/gpu_layer.py --items triton/bf16 authors/bf16 --jsonl rows.jsonl

Each item ("backend/dtype") builds its layer from one seed, and times ``layer(x).float().square().mean()``
forward and backward (the parameters' gradients set to None first, as bench_lookup's layer row): the step's time
with the host path (median of CUDA-event timed calls) and its kernels' time alone (``torch.profiler``). The
triton item also checks its output and input gradient against the torch backend's layer of the same weights.
Each item is guarded (benchmarks/guarded.py): the authors' layer cannot train in bf16 on CUDA (ATen has no bf16
per-sample-weights embedding_bag backward), which fails that item only.
"""
from __future__ import annotations

import argparse
import os
import sys

PAPER = dict(tokens=16384, d_model=896, n_keys=128, heads=4, topk=16, key_dim=256)
TINY = dict(tokens=6, d_model=20, n_keys=8, heads=2, topk=4, key_dim=16)
BACKENDS = ("triton", "torch", "authors")
ITEMS = tuple(f"{backend}/{dtype}" for dtype in ("bf16", "fp32") for backend in BACKENDS)
# item -> (text of its failure's reason, why it fails): the failures that are the design, not a defect
EXPECTED_FAILURES = {"authors/bf16": ("'BFloat16'", "by design: ATen has no bf16 per-sample-weights embedding_bag "
                                                    "backward on CUDA, so the authors' layer cannot train in bf16")}


def _layer(backend: str, cfg: dict, dtype, device):
    """The layer of ``backend`` in ``dtype`` on ``device``, its weights drawn from seed 0."""
    import torch

    from bench_lookup import authors_layer_class
    from smf_kernels import ProductKeyMemory

    sizes = {k: cfg[k] for k in ("n_keys", "heads", "topk", "key_dim")}
    torch.manual_seed(0)
    if backend == "authors":
        layer = authors_layer_class()(cfg["d_model"], value_dim=cfg["d_model"], **sizes)
    else:
        layer = ProductKeyMemory(cfg["d_model"], **sizes, backend=backend)
    return layer.to(device, dtype)


def _input(cfg: dict, dtype, device):
    """x (N, d_model), the same for every item."""
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randn(cfg["tokens"], cfg["d_model"], generator=generator).to(device, dtype)


def _step(layer, x):
    """(output, input gradient) of one forward + backward."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = layer(x)
    out.float().square().mean().backward()
    return out, x.grad


def _rel(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def measure(item: str, cfg: dict, device, repeats: int) -> dict:
    """One row: the layer of ``item`` = "backend/dtype" stepped and timed."""
    import torch

    from gpu_timing import kernel_time_or_reason, op_time

    backend, dtype_name = item.split("/")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    layer, x = _layer(backend, cfg, dtype, device), _input(cfg, dtype, device)
    out, grad_x = _step(layer, x)
    check = None
    if backend == "triton":
        ref_out, ref_grad = _step(_layer("torch", cfg, dtype, device), x)
        check = f"vs torch: out {_rel(out, ref_out):.1e}, dx {_rel(grad_x, ref_grad):.1e}"
    step_s = op_time(lambda: _step(layer, x), device, repeats)
    kernel_ms, launches, profiler_failed = kernel_time_or_reason(lambda: _step(layer, x), device, min(repeats, 5))
    return dict(backend=backend, dtype=dtype_name, tokens=cfg["tokens"], step_ms=step_s * 1e3, kernel_ms=kernel_ms,
                launches=launches, profiler_failed=profiler_failed, check=check)


def table(rows: list[dict]) -> list[str]:
    """Markdown rows of :func:`measure` results and failed items ({"item", "reason"}): each against the authors'
    layer in the same dtype where it ran."""
    authors = {r["dtype"]: r["step_ms"] for r in rows if r.get("backend") == "authors"}
    lines = ["| layer | dtype | N | fwd+bwd ms | kernels ms | launches | vs authors | check |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "reason" in r:
            backend, dtype = r["item"].split("/")
            lines.append(f"| {backend} | {dtype} | - | - | - | - | - | failed: {r['reason']} |")
            continue
        ratio = f"{authors[r['dtype']] / r['step_ms']:.2f}x" if r["dtype"] in authors else "-"
        kernels = (f"{r['kernel_ms']:.3f} | {r['launches']:.0f}" if r["kernel_ms"] is not None
                   else f"profiler failed: {r['profiler_failed']} | -")
        lines.append(f"| {r['backend']} | {r['dtype']} | {r['tokens']:,} | {r['step_ms']:.3f} | {kernels} | {ratio} "
                     f"| {r['check'] or '-'} |")
    return lines


def main(argv=None) -> int:
    from guarded import run_items

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny layer on CPU under the Triton interpreter")
    p.add_argument("--items", nargs="+", choices=ITEMS, default=list(ITEMS), metavar="BACKEND/DTYPE",
                   help=f"the items to run, in order (default: {', '.join(ITEMS)})")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per item (default 10, 1 with --tiny)")
    p.add_argument("--jsonl", help="append each item's row to this file the moment it finishes (benchmarks/guarded.py)")
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before smf_kernels defines its kernels
    import torch

    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here: use --tiny for the CPU interpreter run")
    cfg = TINY if args.tiny else PAPER
    rows = run_items(args.items, lambda item: measure(item, cfg, device, args.repeats or (1 if args.tiny else 10)),
                     args.jsonl, device)
    print("\n".join(table([r["result"] if r["event"] == "done" else r for r in rows])))
    return 0 if all(r["event"] == "done" for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
