"""Benchmark the memory-layer ops on every available backend, at the paper's configuration.

    python benchmarks/bench_lookup.py                  # CPU, paper config, 4096 tokens (layer: 2048)
    python benchmarks/bench_lookup.py --device cuda --tokens 16384 --dtype bfloat16
    python benchmarks/bench_lookup.py --tiny --backends torch triton   # Triton interpreter on CPU

For each backend it times (median of --repeats runs after warm-up):
  lookup          product_key_topk forward
  gather+hist     weighted_gather forward, counting reads into a histogram
  dense bwd       weighted_gather backward: dense (M, D) value grad + weight grad
  sparse bwd      weighted_gather backward into a RowGradSink of T rows (the sparse update's
                  path: their (T, D) fp32 gradient added into the sink) + weight grad
  topk bwd        product_key_topk backward alone: grad of query and keys from the scores' grad
  core fwd+bwd    the memory core, forward and backward: lookup, softmax, gather with
                  histogram, dense value grad, weight grad, top-k backward (query and keys)
  core sparse     the same with the value grad of T rows into a RowGradSink
  layer fwd+bwd   ProductKeyMemory forward and backward (dense value grad), --layer-tokens
                  tokens; backend "authors" is the authors' layer formulation (see
                  AuthorsMemoryLayer) at the same size and dtype
and prints median time, effective GB/s (the bytes the op must move, see
``_bytes_moved``), the speed-up over the torch backend and, for the layer, over
the authors' layer. Backends alternate within every repetition, so each ratio
compares runs taken side by side. On CPU the compiled extension is built on
first use (once, cached; see smf_kernels.build_ext) so that the table shows it;
without a compiler the table has the torch rows. ``--json PATH`` also writes
every number. Needs no GPU and no download. Progress goes to stderr as it happens (what is loading, the
extension's build file by file, then one line per op and backend as each op finishes, and, whenever
``Progress.QUIET_SECONDS`` pass without a line, what is running: which op, backend and run); the table comes at
the end, on stdout.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import threading
import time

from smf_kernels.names import BACKENDS as BACKEND_NAMES  # imports no torch: --backends is checked at once

PAPER = dict(n_keys=128, heads=4, topk=16, key_dim=256, value_dim=896)
TINY = dict(n_keys=16, heads=2, topk=4, key_dim=32, value_dim=96)
logger = logging.getLogger("bench_lookup")


class UsageError(Exception):
    """A request this machine cannot run (a backend unavailable on the device): one line, exit code 2."""


class Progress(threading.Thread):
    """What the benchmark is doing (:meth:`doing`), logged whenever ``QUIET_SECONDS`` pass without any log line
    (the benchmark's, the extension build's), once :meth:`start` ed: one op's runs take minutes on a loaded machine,
    and silence looks like a hang. Unstarted, it only records (a caller of :func:`benchmark` that wants no
    thread)."""

    QUIET_SECONDS = 8

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.started = self.last_line = time.perf_counter()
        self.what = "starting"
        self.done = threading.Event()
        self.seen = _LineSeen(self)

    def doing(self, what: str) -> None:
        self.what = what

    def start(self) -> None:
        logging.getLogger().addHandler(self.seen)
        super().start()

    def run(self) -> None:
        while not self.done.wait(1.0):
            now = time.perf_counter()
            if now - self.last_line >= self.QUIET_SECONDS:
                logger.info("  still %s (%.0f s since the start)", self.what, now - self.started)
                self.last_line = now

    def stop(self) -> None:
        self.done.set()
        if self.is_alive():
            self.join()
        logging.getLogger().removeHandler(self.seen)


class _LineSeen(logging.Handler):
    """Restarts a :class:`Progress`'s quiet interval at every log line."""

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        self.progress.last_line = time.perf_counter()


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = _OneLineParser(prog="bench_lookup.py", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per batch of the ops (default: 4096 at paper size, 64 with --tiny)")
    p.add_argument("--layer-tokens", type=int, default=None,
                   help="tokens per batch of the layer rows (default: 2048 at paper size, 64 with --tiny)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of query, keys and values (accumulation is always fp32)")
    p.add_argument("--update-rows", type=int, default=512, help="T: rows kept by the sparse backward")
    p.add_argument("--backends", nargs="+", default=None, choices=BACKEND_NAMES,
                   help="backends to time (default: all available on the device; torch is always timed)")
    p.add_argument("--tiny", action="store_true", help="a tiny configuration (for the Triton interpreter on CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per op (default: 10, 3 with --tiny)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch (and extension) CPU threads (default: torch's default)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    if args.tokens is not None and args.tokens < 1:
        p.error("--tokens must be >= 1")
    if args.layer_tokens is not None and args.layer_tokens < 1:
        p.error("--layer-tokens must be >= 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    if args.update_rows < 1:
        p.error("--update-rows must be >= 1")
    return args


def _bytes_moved(op: str, cfg: dict, tokens: int, itemsize: int, update_rows: int) -> int:
    """Bytes an ideal kernel must move (reads + writes) for ``op``: its floor traffic."""
    n, h, k, kd = tokens, cfg["heads"], cfg["topk"], cfg["key_dim"]
    d, m, reads = cfg["value_dim"], cfg["n_keys"] ** 2, tokens * cfg["heads"] * cfg["topk"]
    ids_and_weights = reads * (8 + 4)
    if op == "lookup":
        return n * h * kd * itemsize + h * 2 * cfg["n_keys"] * (kd // 2) * itemsize + n * h * k * (4 + 8)
    if op == "gather+hist":
        return ids_and_weights + reads * d * itemsize + n * d * itemsize + reads * 8
    if op == "dense bwd":  # rows for the weight grad, grad_out, the whole dense grad written
        return ids_and_weights + reads * d * itemsize + n * d * itemsize + m * d * itemsize + reads * 4
    if op == "sparse bwd":  # the (T, D) fp32 sink read and written
        return ids_and_weights + reads * d * itemsize + n * d * itemsize + 2 * update_rows * d * 4 + reads * 4
    if op == "topk bwd":  # query and keys read, their gradients written (input dtype), score grads and ids read
        key_elems = h * 2 * cfg["n_keys"] * (kd // 2)
        return 2 * (n * h * kd + key_elems) * itemsize + reads * (4 + 8)
    return 0  # the whole layer: GB/s not meaningful


def _timer(device):
    """time_once(fn) -> seconds of one call (CUDA synchronised)."""
    import torch

    def time_once(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    return time_once


def _time_side_by_side(fns: dict, repeats: int, time_once, warmup: int = 2, doing=lambda what: None) -> dict:
    """Median seconds of each of ``fns`` (name -> callable), the calls alternating within every repetition;
    ``doing(what)`` is told each call before it starts ("torch, warm-up 1 of 2", "ext, run 3 of 10")."""
    for number in range(1, warmup + 1):
        for name, fn in fns.items():
            doing(f"{name}, warm-up {number} of {warmup}")
            fn()
    times = {name: [] for name in fns}
    for number in range(1, repeats + 1):
        for name, fn in fns.items():
            doing(f"{name}, run {number} of {repeats}")
            times[name].append(time_once(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def authors_layer_class():
    """The authors' memory layer, written here from the published algorithm (Berges et al. 2024;
    Sparse Memory Finetuning) as plain PyTorch in the input dtype: a query projection with bias,
    the product-key lookup as two einsums and three torch.topk, softmax in fp32 cast back,
    F.embedding_bag with per-sample weights, and the SwiGLU value projection
    ``value_proj(read * silu(swiglu_proj(x)))``. The baseline of the "vs authors" column."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class AuthorsMemoryLayer(nn.Module):
        def __init__(self, d_model, n_keys, heads, topk, key_dim, value_dim):
            super().__init__()
            self.n_keys, self.heads, self.topk, self.key_dim = n_keys, heads, topk, key_dim
            self.query_proj = nn.Linear(d_model, heads * key_dim, bias=True)
            self.keys = nn.Parameter(torch.rand(heads, 2, n_keys, key_dim // 2) * 2 - 1)
            self.values = nn.Parameter(torch.randn(n_keys * n_keys, value_dim) * value_dim ** -0.5)
            self.swiglu_proj = nn.Linear(d_model, value_dim, bias=True)
            self.value_proj = nn.Linear(value_dim, d_model, bias=True)

        def lookup(self, query):  # (N, H, key_dim) -> scores, slots (N, H, topk)
            half, k = self.key_dim // 2, self.topk
            s1 = torch.einsum("nhd,hkd->nhk", query[..., :half], self.keys[:, 0])
            s2 = torch.einsum("nhd,hkd->nhk", query[..., half:], self.keys[:, 1])
            s1, i1 = s1.topk(k, dim=-1)
            s2, i2 = s2.topk(k, dim=-1)
            pairs = (s1.unsqueeze(-1) + s2.unsqueeze(-2)).flatten(-2)
            scores, best = pairs.topk(k, dim=-1)
            first = i1.gather(-1, torch.div(best, k, rounding_mode="floor"))
            return scores, first * self.n_keys + i2.gather(-1, best % k)

        def forward(self, x):
            n = x.shape[0]
            scores, slots = self.lookup(self.query_proj(x).view(n, self.heads, self.key_dim))
            weights = F.softmax(scores.float(), dim=-1).type_as(scores)
            read = F.embedding_bag(slots.view(n, -1), self.values, per_sample_weights=weights.view(n, -1),
                                   mode="sum")
            return self.value_proj(read * F.silu(self.swiglu_proj(x)))

    return AuthorsMemoryLayer


def benchmark(args: argparse.Namespace, progress: Progress | None = None) -> dict:
    """Time the ops and the layer as ``args`` say; ``progress`` (a started :class:`Progress`) is told each step."""
    progress = progress or Progress()
    progress.doing("loading torch and smf_kernels")
    import torch

    import smf_kernels
    from smf_kernels import ProductKeyMemory
    from smf_kernels.backends import available_backends, unavailable_reason
    from smf_kernels.ops import product_key_topk, weighted_gather
    from smf_kernels.sparse import RowGradSink

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cfg = TINY if args.tiny else PAPER
    tokens = args.tokens or (64 if args.tiny else 4096)
    layer_tokens = args.layer_tokens or (64 if args.tiny else 2048)
    repeats = args.repeats or (3 if args.tiny else 10)
    backends = args.backends or available_backends(device)
    backends = ["torch"] + [b for b in backends if b != "torch"]
    for name in backends:  # a clear error now if one cannot run
        if unavailable_reason(name, device) is not None:
            raise UsageError(f"argument --backends: {name} cannot run on {device.type}: "
                             f"{unavailable_reason(name, device)}")
    num_slots, dim, per_token = cfg["n_keys"] ** 2, cfg["value_dim"], cfg["heads"] * cfg["topk"]
    update_rows = min(args.update_rows, num_slots)
    time_once = _timer(device)
    logger.info("making the inputs and the layers: %d tokens (layer %d), %s slots of width %d, %s, on %s",
                tokens, layer_tokens, f"{num_slots:,}", dim, args.dtype, device)
    progress.doing("making the inputs and the layers")

    gen = torch.Generator(device="cpu").manual_seed(0)
    query = torch.randn(tokens, cfg["heads"], cfg["key_dim"], generator=gen).to(device, dtype)
    keys = (torch.rand(cfg["heads"], 2, cfg["n_keys"], cfg["key_dim"] // 2, generator=gen) * 0.1).to(device, dtype)
    values = (torch.randn(num_slots, dim, generator=gen) * dim ** -0.5).to(device, dtype).requires_grad_(True)
    _, slots = product_key_topk(query, keys, cfg["topk"], backend="torch")
    indices = slots.view(tokens, per_token)
    weights = torch.softmax(torch.randn(tokens, per_token, generator=gen), -1).to(device).requires_grad_(True)
    grad_out = torch.randn(tokens, dim, generator=gen).to(device, dtype)
    counts = torch.zeros(num_slots, dtype=torch.int64, device=device)
    rows = torch.randperm(num_slots, generator=gen)[:update_rows].sort().values.to(device)
    all_valid = torch.ones(update_rows, dtype=torch.bool, device=device)

    def sink_of_rows():
        """A RowGradSink of ``rows`` (set before the backward), as the sparse update's step makes one."""
        sink = RowGradSink(values, update_rows, fill="rows_first")
        sink.set_rows(rows, all_valid)
        return sink
    core_query, core_keys = query.detach().requires_grad_(True), keys.detach().requires_grad_(True)
    grad_scores = torch.randn(tokens, cfg["heads"], cfg["topk"], generator=gen).to(device)
    x = torch.randn(layer_tokens, cfg["value_dim"], generator=gen).to(device, dtype)
    layer_args = dict(n_keys=cfg["n_keys"], heads=cfg["heads"], topk=cfg["topk"], key_dim=cfg["key_dim"])

    def step(layer):
        def run():
            layer.zero_grad(set_to_none=True)
            layer(x).float().square().mean().backward()
        return run

    def ops_of(name):
        def lookup():
            product_key_topk(query, keys, cfg["topk"], backend=name)

        def gather_hist():
            with torch.no_grad():
                weighted_gather(values, indices, weights, counts=counts, backend=name)

        def backward(sparse: bool):  # sparse: the values' gradient goes into the sink (autograd gives None)
            out = weighted_gather(values, indices, weights, grad_sink=sink_of_rows() if sparse else None,
                                  backend=name)
            return lambda: torch.autograd.grad(out, (values, weights), grad_out, retain_graph=True,
                                               allow_unused=sparse)

        def topk_backward():
            scores, _ = product_key_topk(core_query, core_keys, cfg["topk"], backend=name)
            return lambda: torch.autograd.grad(scores, (core_query, core_keys), grad_scores, retain_graph=True)

        def core(sparse: bool):
            def run():
                scores, found = product_key_topk(core_query, core_keys, cfg["topk"], backend=name)
                read = weighted_gather(values, found.view(tokens, per_token),
                                       torch.softmax(scores, -1).view(tokens, per_token), counts=counts,
                                       grad_sink=sink_of_rows() if sparse else None, backend=name)
                torch.autograd.grad(read, (values, core_query, core_keys), grad_out, allow_unused=sparse)
            return run

        layer = ProductKeyMemory(cfg["value_dim"], **layer_args, backend=name).to(device, dtype)
        return {"lookup": lookup, "gather+hist": gather_hist, "dense bwd": backward(False),
                "sparse bwd": backward(True), "topk bwd": topk_backward(), "core fwd+bwd": core(False),
                "core sparse": core(True), "layer fwd+bwd": step(layer)}

    per_backend = {name: ops_of(name) for name in backends}
    authors = step(authors_layer_class()(cfg["value_dim"], value_dim=cfg["value_dim"], **layer_args).to(device, dtype))
    authors_unavailable = None
    progress.doing("running the authors' layer once")
    try:
        authors()
    except NotImplementedError as exc:  # CUDA bf16: ATen has no per-sample-weights embedding_bag backward
        authors_unavailable = f"the authors' layer cannot run here: {str(exc).splitlines()[0]}"
    results = []
    started = time.perf_counter()
    logger.info("timing %d ops on %s, %d runs each after 2 warm-up runs; a line per op and backend as it finishes",
                len(_OP_ORDER), ", ".join(backends), repeats)
    for number, op in enumerate(_OP_ORDER, 1):
        fns = {name: per_backend[name][op] for name in backends}
        if op == "layer fwd+bwd" and authors_unavailable is None:
            fns["authors"] = authors

        def doing(what: str, op: str = op, number: int = number) -> None:
            progress.doing(f"timing {op} (op {number} of {len(_OP_ORDER)}): {what}")

        for name, seconds in _time_side_by_side(fns, repeats, time_once, doing=doing).items():
            moved = _bytes_moved(op, cfg, tokens, values.element_size(), update_rows)
            results.append({"op": op, "backend": name, "median_ms": seconds * 1e3,
                            "gb_per_s": moved / seconds / 1e9 if moved else None, "bytes": moved})
            logger.info("  %-13s %-7s %10.3f ms  (op %d of %d, %.0f s)", op, name, seconds * 1e3, number,
                        len(_OP_ORDER), time.perf_counter() - started)
    base = {r["op"]: r["median_ms"] for r in results if r["backend"] == "torch"}
    authors_ms = next((r["median_ms"] for r in results if r["backend"] == "authors"), None)
    for r in results:
        r["speedup_vs_torch"] = base[r["op"]] / r["median_ms"]
        r["speedup_vs_authors"] = authors_ms / r["median_ms"] if r["op"] == "layer fwd+bwd" and authors_ms else None
    return {
        "authors_unavailable": authors_unavailable,
        "config": {**cfg, "tokens": tokens, "layer_tokens": layer_tokens, "update_rows": update_rows, "dtype": args.dtype,
                   "device": str(device), "repeats": repeats},
        "machine": {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "smf_kernels": smf_kernels.__version__},
        "results": results,
    }


def format_table(report: dict) -> str:
    c = report["config"]
    lines = [
        f"smf-kernels lookup benchmark: {c['tokens']} tokens (layer {c['layer_tokens']}), n_keys={c['n_keys']} heads={c['heads']} "
        f"topk={c['topk']} key_dim={c['key_dim']} D={c['value_dim']} T={c['update_rows']} {c['dtype']} "
        f"on {c['device']} ({report['machine']['device_name']}, {report['machine']['threads']} threads)",
        "",
        f"| {'op':<14} | {'backend':<7} | {'median ms':>10} | {'GB/s':>7} | {'vs torch':>8} | {'vs authors':>10} |",
        f"|{'-' * 16}|{'-' * 9}|{'-' * 12}|{'-' * 9}|{'-' * 10}|{'-' * 12}|",
    ]
    first = {"authors": 0, "torch": 1}
    for r in sorted(report["results"], key=lambda r: (_OP_ORDER.index(r["op"]), first.get(r["backend"], 2))):
        gbs = f"{r['gb_per_s']:.2f}" if r["gb_per_s"] is not None else "-"
        authors = f"{r['speedup_vs_authors']:.2f}x" if r["speedup_vs_authors"] is not None else "-"
        lines.append(f"| {r['op']:<14} | {r['backend']:<7} | {r['median_ms']:>10.3f} | {gbs:>7} | "
                     f"{r['speedup_vs_torch']:>7.2f}x | {authors:>10} |")
    if report.get("authors_unavailable"):
        lines += ["", f"note: {report['authors_unavailable']}"]
    return "\n".join(lines)


_OP_ORDER = ["lookup", "gather+hist", "dense bwd", "sparse bwd", "topk bwd", "core fwd+bwd", "core sparse",
             "layer fwd+bwd"]


def prepare_extension(args: argparse.Namespace) -> None:
    """On CPU, build the compiled extension on first use (once; cached) so that the table shows the
    ``ext`` rows; if it cannot be built, say why (the table then has the torch rows)."""
    if args.device != "cpu" or (args.backends and "ext" not in args.backends):
        return
    import torch

    from smf_kernels import backends, build_ext

    if backends.unavailable_reason("ext", torch.device("cpu")) is None:
        return
    missing = build_ext.missing_build_tools()
    digest = build_ext.source_hash()
    if missing or digest is None:
        why = f"this machine lacks {' and '.join(missing)}" if missing else "its sources (csrc/) are not here"
        logger.warning("note: the compiled extension (backend 'ext') cannot be built: %s; the table shows the torch "
                       "rows only", why)
        return
    logger.info("building the smf_kernels CPU extension for the 'ext' rows (first run only; cached in %s)",
                build_ext.build_dir(digest))
    os.environ[build_ext.BUILD_ENV_VAR] = "1"
    backends.refresh()
    reason = backends.unavailable_reason("ext", torch.device("cpu"))
    if reason is None:
        logger.info("built.")
    else:
        logger.warning("note: %s; the table shows the torch rows only", reason)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.device == "cpu" and args.backends and "triton" in args.backends:
        # Triton on CPU runs only through its interpreter, enabled before any kernel is defined, i.e. before
        # torch is imported (torch 2.13 imports triton.language, whose own helpers are @triton.jit).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    progress = Progress()
    logger.info("bench_lookup: the memory-layer ops on %s (%s); loading torch and smf_kernels", args.device,
                "tiny configuration" if args.tiny else "the paper's configuration")
    progress.doing("loading torch, then the CPU extension (built on the first run: a line per file)")
    progress.start()
    try:
        prepare_extension(args)
        report = benchmark(args, progress)
    except UsageError as exc:
        print(f"bench_lookup.py: error: {exc}", file=sys.stderr)
        return 2
    finally:
        progress.stop()
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
