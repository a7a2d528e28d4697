"""Our memory layer against lucidrains' ``product-key-memory`` (PyPI) at the shapes both can take.

    python benchmarks/bench_vs_lucidrains.py                 # 2,048 tokens, fp32, one thread
    python benchmarks/bench_vs_lucidrains.py --json out.json --profile

Both layers: d_model 896, 128**2 slots, 4 heads, top-16, key width 256 (theirs: ``dim_head`` 128 per half), values
896 wide, fp32 on the CPU, one torch thread. They are not the same layer: theirs normalises the queries (LayerNorm)
and returns the weighted read; ours adds the gate and output projections of docs/method.md
(``out_map(r * silu(gate_map(x)))``: two more 896 x 896 matmuls a token). The table times each layer's own forward
as a user calls it.

Rows: ``forward`` (under no_grad); ``read only`` (under no_grad): ours without the gate and output projections
(query projection, top-k, softmax, weighted gather: the work both layers do); ``forward, gated`` (under no_grad):
ours against theirs with the gate and output ``nn.Linear`` a user adds to get the same function,
``out(theirs(x) * silu(gate(x)))`` (like for like); ``forward+backward`` and ``fwd+bwd, gated`` (the backward of
the output's sum, into every parameter).
The two layers run in interleaved pairs (the order alternating between pairs), so each ratio compares runs taken
side by side; the table shows the median of each layer's times (the thread's CPU time, which a loaded machine
disturbs far less than the wall time, shown beside it) and the median of the per-pair CPU-time ratios ours / theirs
(< 1: ours faster). ``--profile`` adds the median time of each stage of our forward (query projection, top-k,
softmax, gather, gate, output projection) and the ops of theirs by self CPU time (torch.profiler). Exits 0 with a message when ``product-key-memory`` is not installed
(``pip install -c constraints-cpu.txt product-key-memory colt5-attention local-attention hyper-connections einops
--no-deps``, or the ``bench`` extra).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time

SHAPE = dict(d_model=896, n_keys=128, heads=4, topk=16, key_dim=256)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_vs_lucidrains.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per forward (default: 2048)")
    p.add_argument("--pairs", type=int, default=15, help="timed pairs per row (default: 15)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--backend", default=None, choices=["torch", "ext"], help="our backend (default: automatic)")
    p.add_argument("--profile", action="store_true", help="also time the stages of our forward")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    for name in ("tokens", "pairs", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def build_layers(backend):
    """(ours, theirs) at SHAPE, fp32, seeded."""
    import torch
    from product_key_memory import PKM

    from smf_kernels import ProductKeyMemory

    torch.manual_seed(0)
    ours = ProductKeyMemory(SHAPE["d_model"], n_keys=SHAPE["n_keys"], heads=SHAPE["heads"], topk=SHAPE["topk"],
                            key_dim=SHAPE["key_dim"], backend=backend)
    theirs = PKM(SHAPE["d_model"], heads=SHAPE["heads"], num_keys=SHAPE["n_keys"], topk=SHAPE["topk"],
                 dim_head=SHAPE["key_dim"] // 2)
    return ours, theirs


class GatedTheirs:
    """Their layer with the gate and output projections a user adds to get docs/method.md's function,
    ``out(theirs(x) * silu(gate(x)))``: two ``nn.Linear(896, 896)`` initialised as ours are (seeded)."""

    def __init__(self, theirs, d_model: int):
        import torch
        from torch import nn

        torch.manual_seed(1)
        self.theirs, self.gate, self.out = theirs, nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def parameters(self):
        yield from self.theirs.parameters()
        yield from self.gate.parameters()
        yield from self.out.parameters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for module in (self.theirs, self.gate, self.out):
            module.zero_grad(set_to_none=set_to_none)

    def __call__(self, x):
        import torch.nn.functional as F

        return self.out(self.theirs(x) * F.silu(self.gate(x)))


def _time(fn) -> tuple[float, float]:
    """(the calling thread's CPU seconds, wall seconds) of fn(): with one torch thread the CPU time is the whole
    work, and a loaded machine disturbs it far less than the wall time."""
    start, start_cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.thread_time() - start_cpu, time.perf_counter() - start


def time_pairs(ours_fn, theirs_fn, pairs: int) -> dict:
    """Medians (s) of each side's CPU and wall times and of the per-pair CPU-time ratios ours / theirs; two untimed
    pairs first."""
    for _ in range(2):
        ours_fn()
        theirs_fn()
    ours, theirs = [], []
    for p in range(pairs):
        if p % 2:
            b, a = _time(theirs_fn), _time(ours_fn)
        else:
            a, b = _time(ours_fn), _time(theirs_fn)
        ours.append(a)
        theirs.append(b)
    return {"ours_s": statistics.median(a for a, _ in ours), "theirs_s": statistics.median(b for b, _ in theirs),
            "ours_wall_s": statistics.median(a for _, a in ours),
            "theirs_wall_s": statistics.median(b for _, b in theirs),
            "ratio": statistics.median(a[0] / b[0] for a, b in zip(ours, theirs, strict=True)), "pairs": pairs}


def profile_ours(ours, x, pairs: int) -> dict:
    """Median CPU seconds of each stage of our forward (no_grad), the stages run as ProductKeyMemory.forward runs
    them."""
    import torch

    from smf_kernels.ops import product_key_topk, silu_mul, weighted_gather

    flat = x.reshape(-1, ours.d_model)
    backend = ours.resolved_backend(flat.device)
    n = flat.shape[0]
    with torch.no_grad():
        query = ours.query_map(flat).view(n, ours.heads, ours.key_dim)
        scores, indices = product_key_topk(query, ours.keys, ours.topk, backend=backend, key_layouts=ours.key_layouts)
        weights = torch.softmax(scores, dim=-1)
        gate = ours.gate_map(flat)
        read = weighted_gather(ours.values, indices.view(n, -1), weights.view(n, -1), backend=backend)
        gated = silu_mul(gate, read, backend=backend)
        stages = {
            "query projection": lambda: ours.query_map(flat),
            "top-k": lambda: product_key_topk(query, ours.keys, ours.topk, backend=backend,
                                              key_layouts=ours.key_layouts),
            "softmax": lambda: torch.softmax(scores, dim=-1),
            "gate projection": lambda: ours.gate_map(flat),
            "gather + gate (fused)": lambda: weighted_gather(ours.values, indices.view(n, -1), weights.view(n, -1),
                                                             gate=gate, backend=backend),
            "gather": lambda: weighted_gather(ours.values, indices.view(n, -1), weights.view(n, -1), backend=backend),
            "silu(gate) * read": lambda: silu_mul(gate, read, backend=backend),
            "output projection": lambda: ours.out_map(gated),
            "whole forward": lambda: ours(x),
        }
        times = {name: [] for name in stages}
        for name, fn in stages.items():
            fn()
        for _ in range(pairs):
            for name, fn in stages.items():
                times[name].append(_time(fn)[0])
    return {name: statistics.median(t) for name, t in times.items()}


def profile_theirs(theirs, x, runs: int) -> dict:
    """Self CPU seconds per call of each op of their forward (no_grad), by torch.profiler over ``runs`` forwards."""
    import torch

    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(runs):
            theirs(x)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return {e.key: e.self_cpu_time_total * 1e-6 / runs for e in events[:10]}


def benchmark(args) -> dict:
    import torch

    from smf_kernels.ops import weighted_gather

    torch.set_num_threads(args.threads)
    ours, theirs = build_layers(args.backend)
    x = torch.randn(1, args.tokens, SHAPE["d_model"])
    rows = {}
    flat = x.reshape(-1, SHAPE["d_model"])

    def read_only():
        scores, indices = ours.lookup(flat)
        weights = torch.softmax(scores, dim=-1).view(flat.shape[0], -1)
        return weighted_gather(ours.values, indices.view(flat.shape[0], -1), weights)

    gated = GatedTheirs(theirs, SHAPE["d_model"])
    with torch.no_grad():
        rows["forward"] = time_pairs(lambda: ours(x), lambda: theirs(x), args.pairs)
        rows["read only"] = time_pairs(read_only, lambda: theirs(x), args.pairs)
        rows["forward, gated"] = time_pairs(lambda: ours(x), lambda: gated(x), args.pairs)

    def train_step(layer):
        def step():
            layer.zero_grad(set_to_none=True)
            layer(x).sum().backward()
        return step

    rows["forward+backward"] = time_pairs(train_step(ours), train_step(theirs), args.pairs)
    rows["fwd+bwd, gated"] = time_pairs(train_step(ours), train_step(gated), args.pairs)
    result = {"shape": SHAPE, "tokens": args.tokens, "threads": torch.get_num_threads(), "dtype": "float32",
              "backend": ours.resolved_backend(x.device), "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "load_average": os.getloadavg(), "rows": rows}
    if args.profile:
        result["profile"] = profile_ours(ours, x, args.pairs)
        result["profile_theirs"] = profile_theirs(theirs, x, 3)
    return result


def print_table(result: dict) -> None:
    print(f"ours (backend {result['backend']}) vs lucidrains' product-key-memory: {result['tokens']} tokens, "
          f"d_model {SHAPE['d_model']}, {SHAPE['n_keys']}**2 slots, {SHAPE['heads']} heads, top-{SHAPE['topk']}, "
          f"key width {SHAPE['key_dim']}, fp32, {result['threads']} thread(s); load "
          + " ".join(f"{v:.2f}" for v in result["load_average"]))
    print(f"{'(thread CPU time)':18} {'ours ms':>9} {'theirs ms':>10} {'ours/theirs':>12} {'wall: ours':>11} "
          f"{'theirs':>8}  (ratio: median of {result['rows']['forward']['pairs']} per-pair ratios)")
    for name, row in result["rows"].items():
        print(f"{name:18} {row['ours_s'] * 1e3:9.2f} {row['theirs_s'] * 1e3:10.2f} {row['ratio']:12.3f} "
              f"{row['ours_wall_s'] * 1e3:11.2f} {row['theirs_wall_s'] * 1e3:8.2f}")
    if "profile" in result:
        print("\nour forward by stage (no_grad, median thread CPU ms):")
        for name, seconds in result["profile"].items():
            print(f"  {name:24} {seconds * 1e3:8.2f}")
        print("\ntheir forward by op (no_grad, self CPU ms per forward, torch.profiler):")
        for name, seconds in result["profile_theirs"].items():
            print(f"  {name:32} {seconds * 1e3:8.2f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if importlib.util.find_spec("product_key_memory") is None:
        print("bench_vs_lucidrains: skipped: lucidrains' product-key-memory is not installed (pip install -c "
              "constraints-cpu.txt product-key-memory colt5-attention local-attention hyper-connections einops "
              "--no-deps)")
        return 0
    result = benchmark(args)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
