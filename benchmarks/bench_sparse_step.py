"""One SMF training step of a paper-sized memory layer: the exact update's two fills vs dense-masked AdamW.

The layer is ProductKeyMemory(896) with its defaults (16,384 x 896 values); only
the values train, as in stage 2. A step is: begin_step, forward + backward of
``--tokens`` tokens, finish_step (count all-reduce, selection of T rows,
clipping, optimizer step). Paths:

  rows_first    fill "rows_first": rows selected between forward and backward (a step
                of one micro-batch): the backward adds only the T selected rows'
                gradient into the (T, D) sink; RowSparseAdamW
  reads_kept    fill "reads_kept": the backward keeps its reads, the step's end computes
                the T selected rows' gradient from them (gradient accumulation);
                RowSparseAdamW
  dense_masked  dense (M, D) value gradient masked to the selected rows +
                torch.optim.AdamW (the original SMF code)

Reported per path: median wall time of the whole step and of finish_step alone;
bytes the backward left for the values' gradient (the sink, the kept reads, or the
dense gradient) plus optimizer state
(exact tensor sizes, any device); on CUDA also the peak memory allocated during
a step above what was allocated before it (torch.cuda.max_memory_allocated).

    python benchmarks/bench_sparse_step.py [--device cuda] [--tokens 512] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from smf_kernels import ProductKeyMemory  # noqa: E402
from smf_kernels.sparse import DenseMaskedUpdate, RowSparseAdamW, SparseMemoryController  # noqa: E402

MIB = 2 ** 20


def tensor_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    if tensor.is_sparse:
        tensor = tensor.coalesce()
        return tensor_bytes(tensor.indices()) + tensor_bytes(tensor.values())
    return tensor.numel() * tensor.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(value) for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# path -> (update, fill)
PATHS = {"rows_first": ("exact", "rows_first"), "reads_kept": ("exact", "reads_kept"),
         "dense_masked": ("dense_masked", "reads_kept")}


def held_gradient_bytes(controller, memory) -> int:
    """Bytes the step's backwards left for the value gradient: the sink's (T, D) buffer and kept reads, or the
    dense ``.grad``."""
    sink = controller.sinks.get("")
    if sink is None:
        return tensor_bytes(memory.values.grad)
    kept = sum(tensor_bytes(t) for read in getattr(sink, "reads", ()) for t in read[:3])  # dense_masked's keeps none
    return kept + tensor_bytes(sink.grad)


def run_path(path: str, args: argparse.Namespace, device: torch.device) -> dict:
    mode, fill = PATHS[path]
    torch.manual_seed(0)
    memory = ProductKeyMemory(896, backend=args.backend).to(device)
    for param in memory.parameters():
        param.requires_grad_(False)
    memory.values.requires_grad_(True)
    update = SparseMemoryController if mode == "exact" else DenseMaskedUpdate
    controller = update(memory, rule="kl", rows_per_step=args.rows)
    documents = [torch.randn(1, 64, 896, device=device) for _ in range(16)]
    controller.collect_background(documents, forward=lambda model, x: model(x))
    if mode == "exact":
        optimizer = RowSparseAdamW([memory.values], lr=5e-4)
    else:
        optimizer = torch.optim.AdamW([memory.values], lr=5e-4)
    inputs = torch.randn(args.tokens, 896, device=device)
    target = torch.randn(args.tokens, 896, device=device)

    step_times, finish_times, grad_bytes, peaks = [], [], 0, []
    for step in range(args.warmup + args.repeats):
        synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        controller.begin_step(fill)
        loss = (memory(inputs) - target).square().mean()
        if fill == "rows_first":
            controller.select_rows()
        loss.backward()
        synchronize(device)
        grad_bytes = held_gradient_bytes(controller, memory)
        finish_start = time.perf_counter()
        rows = controller.finish_step(optimizer, max_grad_norm=1.0)[""]
        synchronize(device)
        end = time.perf_counter()
        if step >= args.warmup:
            step_times.append(end - start)
            finish_times.append(end - finish_start)
            if device.type == "cuda":
                peaks.append(torch.cuda.max_memory_allocated(device) - before)
    result = {
        "step_ms": 1e3 * statistics.median(step_times),
        "finish_step_ms": 1e3 * statistics.median(finish_times),
        "grad_mib": grad_bytes / MIB,
        "optimizer_state_mib": optimizer_state_bytes(optimizer) / MIB,
        "rows_selected": int(rows.numel()),
    }
    result["grad_plus_state_mib"] = result["grad_mib"] + result["optimizer_state_mib"]
    if peaks:
        result["cuda_peak_extra_mib"] = max(peaks) / MIB
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument("--backend", default=None, help="kernel backend: torch, triton or ext; None picks automatically")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per step")
    parser.add_argument("--rows", type=int, default=512, help="T, rows selected per step")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps (the median is reported)")
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    args = parser.parse_args()
    device = torch.device(args.device)

    results = {path: run_path(path, args, device) for path in PATHS}
    rows = [("step time (ms)", "step_ms"), ("finish_step time (ms)", "finish_step_ms"),
            ("values grad held (MiB)", "grad_mib"), ("optimizer state (MiB)", "optimizer_state_mib"),
            ("grad + state (MiB)", "grad_plus_state_mib")]
    if "cuda_peak_extra_mib" in results["reads_kept"]:
        rows.append(("CUDA peak above start (MiB)", "cuda_peak_extra_mib"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"ProductKeyMemory(896): 16384 x 896 values, {args.tokens} tokens, T={args.rows}, device {name}, "
          f"median of {args.repeats}")
    print(f"{'':30s}" + "".join(f"{path:>14s}" for path in PATHS)
          + f"{'dense/select':>14s}{'dense/kept':>14s}")
    for label, key in rows:
        values = [results[path][key] for path in PATHS]
        dense = results["dense_masked"][key]
        ratios = [dense / results[path][key] if results[path][key] else float("nan")
                  for path in ("rows_first", "reads_kept")]
        print(f"{label:30s}" + "".join(f"{v:14.2f}" for v in values) + "".join(f"{r:14.2f}" for r in ratios))
    if args.json:
        payload = {"device": name, "tokens": args.tokens, "rows": args.rows, "repeats": args.repeats,
                   "results": results}
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)


if __name__ == "__main__":
    main()
