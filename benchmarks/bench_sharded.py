"""One SMF step of a column-sharded memory at several world sizes: tokens/s, bytes sent, peak memory.

Per rank and step (docs/sharding.md): tokens/s, the bytes each rank sends (measured, and as the byte
model predicts), peak memory per rank.

The layer is ShardedProductKeyMemory with issue 29's 1M slots (n_keys 1,024, D = d_model = 896) and the
paper's 4 heads, top-16 and key_dim 256; only the values train (SMF stage 2). One step, on every rank:
begin_step(fill="rows_first"), the forward of this rank's share of ``--tokens`` tokens,
select_rows (the read counts summed over ranks, T rows chosen), the backward (which writes only the T rows
of this rank's columns), finish_step (clipping with the whole table's norm, RowSparseAdamW on this rank's
columns). ``--world-sizes`` runs one job per size: gloo processes on CPU, or NCCL with one GPU per rank
(``--device cuda``).

Measured per rank and step: wall time (the step ends when its slowest rank ends); bytes sent, counted twice:
what the sharded reads hand to collectives (:data:`smf_kernels.sharded.LEDGER`) and, on CPU, what the
process wrote to its sockets (``wchar`` of /proc/self/io: gloo's TCP traffic, headers included, plus the
controller's read-count all_reduce and the clipping norms); peak memory: the bytes of the values and their
optimizer state (tensor sizes), the process's peak RSS, on CUDA torch.cuda.max_memory_allocated. The byte
model's prediction for the same token split is printed beside the measurement.

    nice -n 10 python benchmarks/bench_sharded.py                      # CPU, world sizes 1 2 4, 1M slots
    python benchmarks/bench_sharded.py --device cuda --tokens 16384    # NCCL, 1 2 4 8 up to the GPUs there
    python benchmarks/bench_sharded.py --n-keys 128 --compare          # paper layer: weights vs world 1
    python benchmarks/bench_sharded.py --model                         # docs/sharding.md's predicted tables
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from smf_kernels.sharded import LEDGER, ShardedProductKeyMemory  # noqa: E402
from smf_kernels.sharded import byte_model  # noqa: E402
from smf_kernels.sparse import BackgroundStats, RowSparseAdamW, SparseMemoryController  # noqa: E402

GIB = 2 ** 30


class _Holder(nn.Module):
    """A model holding just the memory, for the controller."""

    def __init__(self, memory: nn.Module) -> None:
        super().__init__()
        self.memory = memory


def token_split(tokens: int, world: int) -> list[int]:
    """``tokens`` spread over ``world`` ranks as evenly as possible."""
    base, extra = divmod(tokens, world)
    return [base + (rank < extra) for rank in range(world)]


def bytes_written() -> int:
    """This process's ``wchar`` (bytes passed to write-like calls, sockets included); 0 where unavailable."""
    try:
        with open("/proc/self/io") as handle:
            return int(next(line for line in handle if line.startswith("wchar")).split()[1])
    except (OSError, StopIteration):
        return 0


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _rank_main(rank: int, world: int, args: argparse.Namespace, init_file: str, out_dir: str) -> None:
    cuda = args.device == "cuda"
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(minutes=30))
    try:
        result = _measure(rank, world, args, device)
        with open(Path(out_dir) / f"rank{rank}.json", "w") as handle:
            json.dump(result, handle)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _measure(rank: int, world: int, args: argparse.Namespace, device: torch.device) -> dict:
    torch.manual_seed(0)
    with torch.device(device):
        memory = ShardedProductKeyMemory(args.d_model, n_keys=args.n_keys, heads=args.heads, topk=args.topk,
                                         key_dim=args.key_dim, backend=args.backend)
    memory.requires_grad_(False)
    memory.values.requires_grad_(True)
    model = _Holder(memory)
    controller = SparseMemoryController(model, rule="tfidf", rows_per_step=args.rows_per_step)
    stats = BackgroundStats.for_memories(controller.memories)
    generator = torch.Generator().manual_seed(1)
    stats.doc_freq["memory"] = torch.randint(0, 50, (memory.num_slots,), generator=generator)
    stats.reads["memory"] = stats.doc_freq["memory"] * 3
    stats.num_batches["memory"] = 2000
    controller.set_background(stats)
    optimizer = RowSparseAdamW([memory.values], lr=1e-3)

    split = token_split(args.tokens, world)
    mine = slice(sum(split[:rank]), sum(split[:rank + 1]))
    generator = torch.Generator().manual_seed(100)  # the same tokens at every world size, split over the ranks
    x = torch.randn(args.tokens, args.d_model, generator=generator)[mine].to(device)
    probe = torch.randn(args.tokens, args.d_model, generator=generator)[mine].to(device)

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    times, phases, written, ledger, selected = [], [], [], [], []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        LEDGER.reset()
        before, started = bytes_written(), now()
        controller.begin_step(fill="rows_first")
        loss = (memory(x) * probe).sum() * (world / args.tokens)  # the DDP convention: x world / all tokens
        forwarded = now()
        rows = controller.select_rows()["memory"]
        selected_at = now()
        loss.backward()
        backwarded = now()
        controller.finish_step(optimizer, max_grad_norm=1.0)
        finished = now()
        sent = bytes_written() - before
        if step >= args.warmup:
            times.append(finished - started)
            phases.append({"forward": forwarded - started, "select": selected_at - forwarded,
                           "backward": backwarded - selected_at, "finish": finished - backwarded})
            written.append(sent)
            ledger.append(dict(LEDGER.sent))
        selected.append(rows.cpu())
    state = optimizer.state[memory.values]
    result = {
        "rank": rank, "world": world, "tokens": split, "columns": [memory.shard.start, memory.shard.stop],
        "seconds": times, "phases": phases, "wchar": written, "ledger": ledger,
        "values_bytes": tensor_bytes(memory.values),
        "state_bytes": sum(tensor_bytes(v) for v in state.values() if isinstance(v, torch.Tensor)),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "cuda_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    if args.compare:
        torch.save({"values": memory.values.detach().cpu(), "selected": selected},
                   Path(args.compare_dir) / f"world{world}-rank{rank}.pt")
    return result


def run_world(world: int, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        init_file = str(Path(out_dir) / "init")
        mp.spawn(_rank_main, args=(world, args, init_file, out_dir), nprocs=world, join=True)
        return [json.loads((Path(out_dir) / f"rank{rank}.json").read_text()) for rank in range(world)]


def summarise(ranks: list[dict], args: argparse.Namespace) -> dict:
    world = len(ranks)
    layer = byte_model.Layer(slots=args.n_keys ** 2, dim=args.d_model, reads=args.heads * args.topk)
    step_seconds = statistics.median(max(r["seconds"][i] for r in ranks) for i in range(args.steps))
    unsharded = 3 * args.n_keys ** 2 * args.d_model * 4 + args.n_keys ** 2 * 8  # values, 2 moments, row_step
    per_rank = []
    for r in ranks:
        # only the values train: no weight gradient goes back to the lookup, so none crosses ranks
        predicted_read = sum(byte_model.column_read_bytes(layer, r["tokens"], r["rank"], weight_grads=False).values())
        predicted_step = sum(byte_model.smf_step_bytes([layer], world).values())
        per_rank.append({
            "rank": r["rank"],
            "ledger_bytes": statistics.median(sum(entry.values()) for entry in r["ledger"]),
            "predicted_read_bytes": predicted_read,
            "wchar_bytes": statistics.median(r["wchar"]),
            "predicted_step_bytes": predicted_read + predicted_step,
            "values_and_state_bytes": r["values_bytes"] + r["state_bytes"],
            "target_bytes": 1.1 * unsharded / world,
            "peak_rss_bytes": r["peak_rss_bytes"],
            "cuda_peak_bytes": r["cuda_peak_bytes"],
        })
    slowest = [max(range(world), key=lambda r: ranks[r]["seconds"][i]) for i in range(args.steps)]
    phases = {name: statistics.median(ranks[r]["phases"][i][name] for i, r in enumerate(slowest))
              for name in ("forward", "select", "backward", "finish")}
    return {"world": world, "tokens": args.tokens, "step_seconds": step_seconds, "phases": phases,
            "tokens_per_second": args.tokens / step_seconds, "ranks": per_rank}


def print_table(results: list[dict], device: str) -> None:
    print(f"| world | step s | tokens/s | rank | read bytes (ledger / model) | sent per step, wchar / model | "
          f"values + state GiB (<= target) | peak RSS GiB{' | CUDA peak GiB' if device == 'cuda' else ''} |")
    print(f"|---:|---:|---:|---:|---|---|---|---:{'|---:' if device == 'cuda' else ''}|")
    for result in results:
        for row in result["ranks"]:
            ledger, model = row["ledger_bytes"], row["predicted_read_bytes"]
            wchar, step_model = row["wchar_bytes"], row["predicted_step_bytes"]
            read = f"{ledger:,.0f} / {model:,.0f}" + (f" ({ledger / model:.3f})" if model else "")
            sent = (f"{wchar:,.0f} / {step_model:,.0f}" + (f" ({wchar / step_model:.3f})" if step_model else "")
                    if device == "cpu" else f"- / {step_model:,.0f}")
            memory = f"{row['values_and_state_bytes'] / GIB:.3f} (<= {row['target_bytes'] / GIB:.3f})"
            cuda = f" | {row['cuda_peak_bytes'] / GIB:.2f}" if device == "cuda" else ""
            print(f"| {result['world']} | {result['step_seconds']:.3f} | {result['tokens_per_second']:,.0f} | "
                  f"{row['rank']} | {read} | {sent} | {memory} | {row['peak_rss_bytes'] / GIB:.2f}{cuda} |")


def print_phases(results: list[dict]) -> None:
    print("\nWhere the step goes (slowest rank, median; forward = begin_step + forward, select = read counts "
          "summed over ranks + T rows chosen, finish = clipping + optimizer step):\n")
    print("| world | forward ms | select ms | backward ms | finish ms |")
    print("|---:|---:|---:|---:|---:|")
    for result in results:
        p = result["phases"]
        print(f"| {result['world']} | {p['forward'] * 1e3:.1f} | {p['select'] * 1e3:.1f} | "
              f"{p['backward'] * 1e3:.1f} | {p['finish'] * 1e3:.1f} |")


def compare(args: argparse.Namespace) -> None:
    """Each world size's values (columns put together) and selected rows against the first world size's."""
    directory = Path(args.compare_dir)

    def load(world):
        parts = [torch.load(directory / f"world{world}-rank{rank}.pt", weights_only=True) for rank in range(world)]
        return torch.cat([p["values"] for p in parts], dim=1), parts[0]["selected"]

    base_values, base_rows = load(args.world_sizes[0])
    for world in args.world_sizes[1:]:
        values, rows = load(world)
        same_rows = all(torch.equal(a, b) for a, b in zip(rows, base_rows))
        diff = (values.double() - base_values.double())
        relative = float(diff.norm() / base_values.double().norm())
        print(f"world {world} vs {args.world_sizes[0]}: selected rows identical in all {len(rows)} steps: "
              f"{same_rows}; values bit-identical: {torch.equal(values, base_values)}, max |diff| "
              f"{float(diff.abs().max()):.3e}, ||diff|| / ||values|| {relative:.3e}")


def print_model() -> None:
    """The byte model's tables of docs/sharding.md."""
    net = byte_model.H100_NODES
    print("Bytes a rank sends per token it holds, per layer, forward + backward (fp32 values, L = 64, D = 896):\n")
    print("| W | column, SMF (values train) | column, retrofit (lookup trains too) | row | column SMF / row |")
    print("|---:|---:|---:|---:|---:|")
    for world in [2, 4] + byte_model.log2_worlds(8, 1024):
        smf = byte_model.column_bytes_per_token(byte_model.PAPER, world, weight_grads=False)
        retrofit = byte_model.column_bytes_per_token(byte_model.PAPER, world)
        row = byte_model.row_bytes_per_token(byte_model.PAPER, world)
        print(f"| {world} | {smf:,.0f} | {retrofit:,.0f} | {row:,.0f} | {smf / row:.2f} |")
    print(f"\nPredicted communication per layer and SMF step on {net.name}, 4,096 tokens per GPU, one "
          "forward:\n")
    print("| W | layer | reads ms | read counts ms | latency ms | total ms | compute ms | comm / compute |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for layer, name, per_token in ((byte_model.PAPER, "paper (16K slots)", PAPER_SECONDS_PER_TOKEN),
                                   (byte_model.ONE_MILLION, "1M slots", MILLION_SECONDS_PER_TOKEN)):
        for world in byte_model.log2_worlds(8, 1024):
            if world > layer.dim:
                print(f"| {world} | {name} | - | - | - | - | - | fewer than one column per GPU |")
                continue
            parts = byte_model.column_step_seconds(layer, 4096, world, net)
            total, compute = sum(parts.values()), per_token * 4096
            print(f"| {world} | {name} | {parts['reads'] * 1e3:.3f} | {parts['counts'] * 1e3:.3f} | "
                  f"{parts['latency'] * 1e3:.3f} | {total * 1e3:.3f} | {compute * 1e3:.3f} | {total / compute:.2f} |")
    print("\nThe world size from which communication exceeds compute (4,096 tokens per GPU):\n")
    print("| layer | SMF, one forward | SMF + counting forward (accumulation) | retrofit (lookup trains) |")
    print("|---|---:|---:|---:|")
    for layer, name, per_token in ((byte_model.PAPER, "paper", PAPER_SECONDS_PER_TOKEN),
                                   (byte_model.ONE_MILLION, "1M slots", MILLION_SECONDS_PER_TOKEN)):
        worlds = [byte_model.crossover_world(layer, per_token, net, 4096, **step)
                  for step in ({}, {"forwards": 2}, {"weight_grads": True})]
        print(f"| {name} | " + " | ".join(str(w) for w in worlds) + " |")


# The layer's compute per token on one H100 (fp32, forward + backward). Paper layer: measured, bench_lookup
# "layer fwd+bwd" triton, 10.697 ms for 16,384 tokens (benchmarks/RESULTS.md). 1M slots: not measured on a
# GPU; estimated in docs/sharding.md (lookup 8x the paper's, the gather's rows from HBM).
PAPER_SECONDS_PER_TOKEN = 10.697e-3 / 16384
MILLION_SECONDS_PER_TOKEN = 1.2e-6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=None,
                   help="(default: 1 2 4 on CPU; on CUDA 1, 2, 4, 8 up to the GPUs visible)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--tokens", type=int, default=512, help="tokens per step over all ranks (default: 512)")
    p.add_argument("--n-keys", type=int, default=1024)
    p.add_argument("--d-model", type=int, default=896, help="model width = value width D (default: 896)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--key-dim", type=int, default=256)
    p.add_argument("--rows-per-step", type=int, default=512, help="T (default: 512)")
    p.add_argument("--backend", default=None, help="torch, triton, ext (default: automatic)")
    p.add_argument("--steps", type=int, default=2, help="measured steps (default: 2)")
    p.add_argument("--warmup", type=int, default=1, help="steps before them (default: 1; the first allocates "
                   "the optimizer state)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default: 1; on a loaded CPU, "
                   "threads beyond the free cores spin and were measured 5-10x slower)")
    p.add_argument("--compare", action="store_true", help="also compare every world size's weights and "
                   "selected rows with the first one's (writes the tables to a temporary folder)")
    p.add_argument("--model", action="store_true", help="print the byte model's tables and exit")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    if args.model:
        print_model()
        return 0
    if args.world_sizes is None:
        gpus = torch.cuda.device_count() if args.device == "cuda" else 4
        args.world_sizes = [world for world in (1, 2, 4, 8) if world <= max(1, gpus)]
    if args.device == "cuda" and max(args.world_sizes) > torch.cuda.device_count():
        p.error(f"--world-sizes {max(args.world_sizes)} needs as many GPUs; {torch.cuda.device_count()} visible")
    layer = f"n_keys {args.n_keys} ({args.n_keys ** 2:,} slots) x D {args.d_model}, {args.heads} heads, " \
            f"top-{args.topk}, key_dim {args.key_dim}, T {args.rows_per_step}"
    print(f"bench_sharded: {layer}; {args.tokens} tokens per step; {args.device} "
          f"({'nccl' if args.device == 'cuda' else 'gloo'}); torch {torch.__version__}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as compare_dir:
        args.compare_dir = compare_dir
        for world in args.world_sizes:
            results.append(summarise(run_world(world, args), args))
            print(f"world {world}: {results[-1]['step_seconds']:.3f} s per step", file=sys.stderr, flush=True)
        print_table(results, args.device)
        print_phases(results)
        if args.compare:
            compare(args)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"layer": layer, "device": args.device, "results": results}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
