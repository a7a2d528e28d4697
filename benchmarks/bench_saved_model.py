"""How fast a saved model's memories run, against the library's (issue 35): forward only, as a loaded model runs.

    python benchmarks/bench_saved_model.py                 # CPU: memory layers at hidden 64 and 896, a tiny model
    python benchmarks/bench_saved_model.py --device cuda --json out.json

Rows, each the median of --repeats timed runs after warm-up, alternating within every repetition:

  library         smf_kernels.ProductKeyMemory on its default backend: what the saved code builds where smf is
                  importable (smf.model.attach.attach_recorded_memories)
  library torch   the same layer on the ``torch`` backend (the plain PyTorch backend of the library)
  plain           the saved code's own layer (no smf importable): PyTorch, torch.topk (rows with a tie sorted)
                  over the candidate pairs that can win
  plain, sort     that layer with the lookup it had before (a stable sort of every score and candidate)

Times: median wall and CPU time of one forward (--threads 1 by default, the steadier on a shared machine).
Cases: a memory layer at hidden 64 (the tiny preset's sizes) and at hidden 896 (the paper's: 128^2 slots,
4 heads, top-16, key_dim 256), and the tiny preset's whole model (hidden 64, memories at layers 2, 4, 6) loaded
from a save_pretrained directory each way. Prints a table with each row's CPU time over the library's.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from smf.model import attach_memories  # noqa: E402
from smf.model import remote_code  # noqa: E402
from smf.model.hf_auto import saved_code  # noqa: E402
from smf.tiny import TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS, tiny_model  # noqa: E402
from smf_kernels import ProductKeyMemory  # noqa: E402

LAYERS = {"memory layer, hidden 64 (tiny)": (64, dict(TINY_MEMORY_KWARGS)),
          "memory layer, hidden 896 (paper)": (896, dict(n_keys=128, heads=4, topk=16, key_dim=256))}


@contextlib.contextmanager
def sorting_topk(module):
    """The saved code's lookup as before issue 35: a stable sort of every sub-key score and of every candidate
    pair (``_undominated_pairs`` made to return all pairs, in candidate order)."""
    kept = module._ranked_topk, module._undominated_pairs

    def every_pair(topk, device):
        grid = torch.arange(topk, device=device)
        return grid.repeat_interleave(topk), grid.repeat(topk)

    module._ranked_topk, module._undominated_pairs = module._sorted_topk, every_pair
    try:
        yield
    finally:
        module._ranked_topk, module._undominated_pairs = kept


def time_rows(rows: dict, repeats: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU (this process, all threads) seconds of each row's callable, the rows alternating within
    every repetition. On a shared machine the CPU time is the steadier measure."""
    with torch.no_grad():
        for run in rows.values():
            run(), run()
        times = {name: {"wall": [], "cpu": []} for name in rows}
        for _ in range(repeats):
            for name, run in rows.items():
                wall, cpu = time.perf_counter(), time.process_time()
                run()
                times[name]["cpu"].append(time.process_time() - cpu)
                times[name]["wall"].append(time.perf_counter() - wall)
    return {name: {kind: statistics.median(values) for kind, values in kinds.items()}
            for name, kinds in times.items()}


def layer_rows(d_model: int, sizes: dict, tokens: int, device: str) -> dict:
    library = ProductKeyMemory(d_model, **sizes).to(device)
    plain = remote_code.PlainProductKeyMemory(d_model, **sizes).to(device)
    plain.load_state_dict(library.state_dict())
    torch_backend = ProductKeyMemory(d_model, **sizes, backend="torch").to(device)
    torch_backend.load_state_dict(library.state_dict())
    x = torch.randn(tokens, d_model, device=device)

    def plain_sorting():
        with sorting_topk(remote_code):
            return plain(x)

    return {"library": lambda: library(x), "library torch": lambda: torch_backend(x), "plain": lambda: plain(x),
            "plain, sort": plain_sorting}


def model_rows(tokens: int, device: str, directory: Path) -> dict:
    model = tiny_model()
    attach_memories(model, TINY_MEMORY_LAYERS, "additive", **TINY_MEMORY_KWARGS)
    model.save_pretrained(directory)
    (directory / "saved_code.py").write_text(saved_code("qwen2"))
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_saved_code", directory / "saved_code.py")
    saved = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(saved)
    library = saved.Qwen2ForCausalLMWithSmfMemories.from_pretrained(directory).to(device).eval()  # smf importable
    torch_backend = saved.Qwen2ForCausalLMWithSmfMemories.from_pretrained(directory).to(device).eval()
    for module in torch_backend.modules():
        if isinstance(module, ProductKeyMemory):
            module.backend = "torch"
    os.environ[saved.PLAIN_ENV] = "1"
    try:
        plain = saved.Qwen2ForCausalLMWithSmfMemories.from_pretrained(directory).to(device).eval()
    finally:
        del os.environ[saved.PLAIN_ENV]
    assert not any(isinstance(m, ProductKeyMemory) for m in plain.modules())
    ids = torch.randint(0, 256, (max(1, tokens // 128), min(tokens, 128)), device=device)

    def plain_sorting():
        with sorting_topk(saved):
            return plain(ids)

    return {"library": lambda: library(ids), "library torch": lambda: torch_backend(ids), "plain": lambda: plain(ids),
            "plain, sort": plain_sorting}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per forward (default 2048)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: steadier when shared)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"device {args.device}, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.tokens} tokens, median of {args.repeats}; library default "
          f"backend: {ProductKeyMemory(64, **TINY_MEMORY_KWARGS).backend or 'automatic'}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        cases = {name: layer_rows(d, sizes, args.tokens, args.device) for name, (d, sizes) in LAYERS.items()}
        cases["tiny model forward (hidden 64, 3 memories)"] = model_rows(args.tokens, args.device, Path(tmp))
        for case, rows in cases.items():
            results[case] = time_rows(rows, args.repeats)
    print(f"{'case':45s} {'row':14s} {'wall ms':>9s} {'cpu ms':>9s} {'cpu x library':>14s}")
    for case, times in results.items():
        for row, seconds in times.items():
            print(f"{case:45s} {row:14s} {seconds['wall'] * 1e3:9.2f} {seconds['cpu'] * 1e3:9.2f} "
                  f"{seconds['cpu'] / times['library']['cpu']:14.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "tokens": args.tokens, "threads": args.threads,
                                               "results": results},
                                              indent=1))


if __name__ == "__main__":
    main()
