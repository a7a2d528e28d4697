"""The memory layers' share of per-token decode time: a random Qwen-2 with memories generating with the KV cache.

    python benchmarks/bench_decode.py                       # tiny Qwen-2 (hidden 64, 8 layers), 1M-slot memories
    python benchmarks/bench_decode.py --hidden 896 --layers 24 --n-keys 128 --json out.json

The model is :func:`smf.tiny.tiny_config` (or that config widened: --hidden, --intermediate, --layers), randomly
initialised, with memories at a quarter, half and three quarters of the depth (additive, value rows as wide as the
hidden state). Greedy generation of --new-tokens tokens after a --prompt-tokens prompt, the KV cache on. For each
backend it prints the time per generated token without memories (the same random Qwen-2 before they were attached),
with them, the memory layers' own forward time per token (timed around each ProductKeyMemory.forward) and that
time's share of the token: the generating thread's CPU time (steady on a loaded machine; with one torch thread the
whole work), and the wall time per token beside it. The prompt's forward is included (divided by the new tokens). ``ext, layout per call`` runs the ext backend with the top-k's key layout made on every lookup
(the path before the memories kept it, smf_kernels.ops.KeyLayoutCache). One torch thread unless --threads.

A second table times the top-k lookup alone (product_key_topk forward, the memories' shape, random queries) at
1, 2, 4 and 8 tokens on each backend, interleaved, median of --lookup-repeats calls: the thread's CPU time (what
a busy machine disturbs least) and the wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_decode.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default: 64, the tiny preset)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 2 x hidden)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default: 8)")
    p.add_argument("--n-keys", type=int, default=1024, help="sub-keys per half: n_keys**2 slots (default: 1024)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--key-dim", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="generations per variant, interleaved (default: 5)")
    p.add_argument("--lookup-repeats", type=int, default=50, help="calls per lookup timing (default: 50)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    for name in ("hidden", "layers", "n_keys", "heads", "topk", "key_dim", "prompt_tokens", "new_tokens", "repeats",
                 "lookup_repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def build_models(args):
    """(the random Qwen-2 without memories, a copy of it with memories attached, those memories)."""
    import copy

    import torch

    from smf.model import attach_memories
    from smf.tiny import tiny_config
    from transformers import Qwen2ForCausalLM

    config = tiny_config()
    config.hidden_size, config.num_hidden_layers = args.hidden, args.layers
    config.intermediate_size = args.intermediate or 2 * args.hidden
    config.layer_types = ["full_attention"] * args.layers  # sized by the config's own layer count
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(config).eval()
    model = copy.deepcopy(base)
    layers = sorted({args.layers // 4, args.layers // 2, 3 * args.layers // 4})
    blocks = attach_memories(model, layers, "additive", n_keys=args.n_keys, heads=args.heads, topk=args.topk,
                             key_dim=args.key_dim)
    return base, model, [block.memory for block in blocks]


class MemoryTimer:
    """Thread CPU seconds spent inside the memories' forwards (pre/post forward hooks)."""

    def __init__(self, memories):
        self.seconds, self._start = 0.0, 0.0
        for memory in memories:
            memory.register_forward_pre_hook(self._begin)
            memory.register_forward_hook(self._end)

    def _begin(self, *_):
        self._start = time.thread_time()

    def _end(self, *_):
        self.seconds += time.thread_time() - self._start


def benchmark(args) -> dict:
    import torch

    from smf_kernels.ops import KeyLayoutCache

    torch.set_num_threads(args.threads)
    base, model, memories = build_models(args)
    timer = MemoryTimer(memories)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens))
    from smf_kernels.backends import available_backends

    variants = {"no memories": (None, True)}
    variants.update({name: (name, True) for name in available_backends("cpu")})
    if "ext" in variants:
        variants["ext, layout per call"] = ("ext", False)

    def generate(variant):
        backend, cached = variants[variant]
        for memory in memories:
            memory.backend = backend
            memory.key_layouts = KeyLayoutCache() if cached else None
        timer.seconds = 0.0
        with torch.inference_mode():
            start, start_cpu = time.perf_counter(), time.thread_time()
            (base if backend is None else model).generate(
                prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                use_cache=True, pad_token_id=0)
            cpu, wall = time.thread_time() - start_cpu, time.perf_counter() - start
        return cpu, timer.seconds, wall

    for variant in variants:
        generate(variant)  # warm-up
    times = {v: [] for v in variants}
    for _ in range(args.repeats):
        for variant in variants:
            times[variant].append(generate(variant))
    tokens = args.new_tokens
    rows = {}
    for variant, runs in times.items():
        total = statistics.median(t for t, _, _ in runs) / tokens
        memory = statistics.median(m for _, m, _ in runs) / tokens
        wall = statistics.median(w for _, _, w in runs) / tokens
        rows[variant] = {"token_ms": total * 1e3, "memory_ms": memory * 1e3, "memory_share": memory / total,
                         "token_wall_ms": wall * 1e3}
    return {"config": {k: v for k, v in vars(args).items() if k != "json"}, "slots": args.n_keys ** 2,
            "lookup": time_lookups(args, memories[0], [v for v in variants if variants[v][0] is not None]),
            "memory_layers": len(memories), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(), "load_average": os.getloadavg(), "rows": rows,
            "note": "per generated token, prompt included in the total (divided by new tokens); medians of repeats"}


def time_lookups(args, memory, variants) -> dict:
    """{tokens: {variant: {"cpu_ms", "wall_ms"}}} medians of product_key_topk at 1, 2, 4, 8 tokens with memory's
    keys: the calling thread's CPU time (steady on a loaded machine) and wall time."""
    import torch

    from smf_kernels.ops import KeyLayoutCache, product_key_topk

    keys, result = memory.keys.detach(), {}
    with torch.inference_mode():
        for tokens in (1, 2, 4, 8):
            query = torch.randn(tokens, args.heads, args.key_dim)
            calls = {}
            for variant in variants:
                backend = variant.split(",")[0]
                cache = None if variant.endswith("per call") else KeyLayoutCache()
                calls[variant] = (lambda b=backend, c=cache: product_key_topk(query, keys, args.topk, backend=b,
                                                                              key_layouts=c))
                calls[variant]()
            wall, cpu = {v: [] for v in calls}, {v: [] for v in calls}
            for _ in range(args.lookup_repeats):
                for variant, call in calls.items():
                    start, start_cpu = time.perf_counter(), time.thread_time()
                    call()
                    cpu[variant].append(time.thread_time() - start_cpu)
                    wall[variant].append(time.perf_counter() - start)
            result[tokens] = {v: {"cpu_ms": statistics.median(cpu[v]) * 1e3, "wall_ms": statistics.median(wall[v]) * 1e3}
                              for v in calls}
    return result


def print_table(result: dict) -> None:
    c = result["config"]
    print(f"decode: random Qwen-2 (hidden {c['hidden']}, {c['layers']} layers) with {result['memory_layers']} memories "
          f"of {result['slots']:,} slots ({c['heads']} heads, top-{c['topk']}, key width {c['key_dim']}), "
          f"{c['prompt_tokens']}-token prompt, {c['new_tokens']} new tokens, KV cache, {result['threads']} thread(s); "
          "load " + " ".join(f"{v:.2f}" for v in result["load_average"]))
    print(f"{'(thread CPU time)':22} {'ms/token':>9} {'memory ms/token':>16} {'memory share':>13} {'wall ms/token':>14}")
    for name, row in result["rows"].items():
        print(f"{name:22} {row['token_ms']:9.3f} {row['memory_ms']:16.3f} {row['memory_share']:13.1%} "
              f"{row['token_wall_ms']:14.3f}")
    variants = list(next(iter(result["lookup"].values())))
    print(f"\nproduct_key_topk alone, {result['slots']:,} slots (median thread CPU ms, wall ms in brackets):")
    print(f"{'tokens':>6} " + " ".join(f"{v:>24}" for v in variants))
    for tokens, row in result["lookup"].items():
        print(f"{tokens:>6} " + " ".join(f"{row[v]['cpu_ms']:12.3f} ({row[v]['wall_ms']:8.3f})" for v in variants))


def main(argv=None) -> int:
    args = parse_args(argv)
    result = benchmark(args)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
