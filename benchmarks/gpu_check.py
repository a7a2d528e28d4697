"""One command for a CUDA machine: check every op's Triton path at full paper size and time it.

    python benchmarks/gpu_check.py [--out gpu_check.md]      # CUDA: N = 16,384, paper config
    python benchmarks/gpu_check.py --tiny                    # CPU, Triton interpreter (CI)
    python benchmarks/gpu_check.py --roofline                # the floor table alone, no run
    python benchmarks/gpu_check.py --items "lookup/bf16" --jsonl rows.jsonl   # some items, each row saved at once

For fp32 and bf16, each op (top-k lookup, gather + histogram, dense
backward, the dense backward with a tenth of the reads on 64 hot rows: the row-owned
backward's load balance, the top-k's backward, and the exact sparse update's own path: the
backward into a RowGradSink whose T rows are known before it ("sink bwd"), the backward that
keeps its reads and the step's end that sums them for T rows ("kept fill"), and RowSparseAdamW's
row update ``row_adamw_`` on T rows) runs on the ``triton`` backend and is checked against
the float64 reference: relative error of the outputs and, for the lookup, the
fraction of slot ids equal to the reference's. The bf16 ``row_adamw_`` is checked against the torch backend
on the same bf16 state instead: a bf16 table cannot hold most of one step's float64 change (lr 1e-3 is below
its resolution near 1), so against float64 any correct kernel reads ~0.9. Each op is then timed: the op
(median of CUDA-event timed calls, the host path included), its kernels alone (``torch.profiler``: the GPU
time of every kernel one call launches, summed, and how many it launches) and the torch backend's op in the
same run, against its H100 SXM floor (see :func:`floors`). The backward rows time the backward alone (their
forward runs once, outside the timed call), as their floors count the backward's bytes only. Each item
("op/dtype") is one guarded unit (benchmarks/guarded.py): with ``--jsonl`` its row is saved the moment it
finishes and an item that raises costs that item only. Writes a markdown table.
"""
from __future__ import annotations

import argparse
import os
import sys

PAPER = dict(tokens=16384, n_keys=128, heads=4, topk=16, key_dim=256, dim=896, update_rows=4096)
TINY = dict(tokens=6, n_keys=8, heads=2, topk=4, key_dim=16, dim=20, update_rows=7)
# H100 SXM: HBM3 bandwidth, dense bf16 tensor-core and fp32 (non-tensor) peaks.
HBM_BYTES_S = 3.35e12
PEAK_FLOPS = {"bf16": 989e12, "fp32": 67e12}
# The Triton backward has one path, bit-reproducible by construction: no "deterministic" row.
OPS = ("lookup", "gather+hist", "dense bwd", "hot-row bwd", "topk bwd", "sink bwd", "kept fill", "row adamw")
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
HOT_ROWS = 64  # rows that take every tenth read in the "hot-row bwd" op


def floors(cfg: dict, dtype: str) -> dict:
    """{op: (bytes that must cross HBM, flops, floor seconds)} at ``cfg``.

    Bytes count each input once and each output once (the value table once when
    it is read: its rows are re-read from L2, not HBM); flops count the
    multiply-adds the op cannot avoid. Floor = max(bytes / HBM, flops / peak).
    """
    s = 2 if dtype == "bf16" else 4
    n, h, k, kd, nk, d = cfg["tokens"], cfg["heads"], cfg["topk"], cfg["key_dim"], cfg["n_keys"], cfg["dim"]
    m, reads, t = nk * nk, n * h * k, cfg["update_rows"]
    ids_w = reads * (8 + 4)  # int64 slot ids, fp32 weights
    out = {
        "lookup": (n * h * kd * s + h * nk * kd * s + n * h * k * (4 + 8), 2 * n * h * nk * kd),
        "gather+hist": (m * d * s + ids_w + n * d * s + 2 * m * 8, 2 * reads * d),
        # grad_out, values, ids/weights in; dense fp32 grad values + grad weights out
        "dense bwd": (n * d * s + m * d * s + ids_w + m * d * 4 + reads * 4, 4 * reads * d),
        "hot-row bwd": (n * d * s + m * d * s + ids_w + m * d * 4 + reads * 4, 4 * reads * d),
        # query and keys in, their gradients out (input dtype), fp32 score grads and slot ids in
        "topk bwd": (2 * (n * h * kd + h * nk * kd) * s + reads * (4 + 8), 4 * reads * kd),
        # the sparse backward, adding into the (T, D) fp32 sink (read and written)
        "sink bwd": (n * d * s + m * d * s + ids_w + 2 * t * d * 4 + reads * 4, 4 * reads * d),
        # the backward's weight gradient (the value rows read), then the step's end: kept grad_out and ids again
        "kept fill": (2 * n * d * s + m * d * s + 2 * ids_w + t * d * 4 + reads * 4, 4 * reads * d),
        # T rows of param, exp_avg, exp_avg_sq read and written, the fp32 gradient and the step counts
        "row adamw": (6 * t * d * s + t * d * 4 + 2 * t * 8 + t * 8, 12 * t * d),
    }
    peak = PEAK_FLOPS[dtype]
    return {op: (b, f, max(b / HBM_BYTES_S, f / peak)) for op, (b, f) in out.items()}


def _inputs(cfg, dtype, device):
    import torch

    n, h, kd, nk, d = cfg["tokens"], cfg["heads"], cfg["key_dim"], cfg["n_keys"], cfg["dim"]
    query = torch.randn(n, h, kd, device=device).to(dtype)
    keys = (torch.rand(h, 2, nk, kd // 2, device=device) * 2 - 1).to(dtype)
    values = torch.randn(nk * nk, d, device=device).to(dtype)
    indices = torch.randint(0, nk * nk, (n, h * cfg["topk"]), device=device)
    weights = torch.softmax(torch.randn(n, h * cfg["topk"], device=device), -1)
    grad_out = torch.randn(n, d, device=device).to(dtype)
    rows = torch.randperm(nk * nk, device=device)[: cfg["update_rows"]].sort().values
    return query, keys, values, indices, weights, grad_out, rows


def _hot_indices(indices):
    """indices with every tenth read (in flat order) sent to one of HOT_ROWS rows, round robin: at the
    paper size each hot row is read ~1,600 times, 26x the mean."""
    import torch

    flat = indices.reshape(-1).clone()
    flat[::10] = torch.arange(flat[::10].numel(), device=flat.device) % HOT_ROWS  # both configs have M >= 64
    return flat.view_as(indices)


def _score_grads(cfg, device):
    """A fixed fp32 gradient of the top-k scores (N, H, topk), the same for every backend and the reference."""
    import torch

    gen = torch.Generator(device=device).manual_seed(1)
    return torch.randn(cfg["tokens"], cfg["heads"], cfg["topk"], generator=gen, device=device)


def _rel(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _op_runner(op, backend, inputs, cfg):
    """A zero-argument callable running ``op`` on ``backend``, returning its outputs."""
    import torch

    from smf_kernels.ops import product_key_topk, weighted_gather

    query, keys, values, indices, weights, grad_out, rows = inputs
    if op == "lookup":
        return lambda: product_key_topk(query, keys, cfg["topk"], backend=backend)
    if op == "gather+hist":
        counts = torch.zeros(values.shape[0], dtype=torch.int64, device=values.device)
        return lambda: (weighted_gather(values, indices, weights, counts=counts.zero_(), backend=backend), counts)
    if op == "topk bwd":  # the backward alone: the forward runs once, outside the timed call
        q, k = query.detach().requires_grad_(True), keys.detach().requires_grad_(True)
        scores, _ = product_key_topk(q, k, cfg["topk"], backend=backend)
        grad = _score_grads(cfg, query.device)
        return lambda: torch.autograd.grad(scores, (q, k), grad, retain_graph=True)

    if op == "row adamw":  # fresh state: the first call is the one checked, later (timed) ones keep stepping
        from smf_kernels.ops import row_adamw_

        param, grad = values.detach().clone(), _row_grads(cfg, values)
        start = param[rows].double()
        exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
        row_step = torch.zeros(param.shape[0], dtype=torch.int64, device=param.device)

        def update():  # (the rows' change, their first moment)
            row_adamw_(param, exp_avg, exp_avg_sq, row_step, rows, grad, backend=backend, **ADAMW)
            return param[rows].double() - start, exp_avg[rows]
        return update
    # the backward rows: the forward runs once here, each call is one backward (the graph is retained)
    v = values.detach().requires_grad_(True)
    w = weights.detach().requires_grad_(True)
    if op in ("sink bwd", "kept fill"):
        from smf_kernels.sparse import RowGradSink

        valid = torch.ones(rows.numel(), dtype=torch.bool, device=rows.device)
        sink = RowGradSink(v, rows.numel(), fill="reads_kept" if op == "kept fill" else "rows_first")
        if op == "sink bwd":
            sink.set_rows(rows, valid)
        out = weighted_gather(v, indices, w, grad_sink=sink, backend=backend)

        def sink_backward():  # (the T rows' gradient, the weights'); "sink bwd" adds into one sink call after call
            _, gw = torch.autograd.grad(out, (v, w), grad_out, retain_graph=True, allow_unused=True)
            if op == "kept fill":
                sink.sum_reads(v, rows, valid)
            return sink.grad, gw
        return sink_backward

    out = weighted_gather(v, _hot_indices(indices) if op == "hot-row bwd" else indices, w, backend=backend)
    return lambda: torch.autograd.grad(out, (v, w), grad_out, retain_graph=True)


def _row_grads(cfg, values):
    """(T, D) fp32 row gradients, the same for every backend and the reference."""
    import torch

    generator = torch.Generator(device=values.device).manual_seed(1)
    return torch.randn(cfg["update_rows"], values.shape[1], generator=generator, device=values.device)


def _reference(op, inputs, cfg):
    import torch

    from smf_kernels.reference import product_key_topk_reference, weighted_gather_reference

    if op == "row adamw" and inputs[2].dtype != torch.float32:  # bf16: the torch backend on the same bf16 state
        return _op_runner(op, "torch", inputs, cfg)()
    if op == "row adamw":  # AdamW's first step on rows ``rows``, in float64
        values, rows = inputs[2], inputs[6]
        grad = _row_grads(cfg, values).double()
        beta1, beta2 = ADAMW["betas"]
        exp_avg, exp_avg_sq = (1 - beta1) * grad, (1 - beta2) * grad * grad
        denom = (exp_avg_sq / (1 - beta2)).sqrt() + ADAMW["eps"]
        param = values[rows].double()
        change = -ADAMW["lr"] * ADAMW["weight_decay"] * param - ADAMW["lr"] / (1 - beta1) * exp_avg / denom
        return change, exp_avg
    query, keys, values, indices, weights, grad_out, rows = (x.double() if x.is_floating_point() else x
                                                             for x in inputs)
    if op == "lookup":
        return product_key_topk_reference(query, keys, cfg["topk"])
    if op == "gather+hist":
        counts = torch.zeros(values.shape[0], dtype=torch.int64, device=values.device)
        return weighted_gather_reference(values, indices, weights, counts=counts), counts
    if op == "topk bwd":
        q, k = query.requires_grad_(True), keys.requires_grad_(True)
        scores, _ = product_key_topk_reference(q, k, cfg["topk"])
        return torch.autograd.grad(scores, (q, k), _score_grads(cfg, query.device).double())
    v = values.requires_grad_(True)
    w = weights.requires_grad_(True)
    read = _hot_indices(indices) if op == "hot-row bwd" else indices
    gv, gw = torch.autograd.grad(weighted_gather_reference(v, read, w), (v, w), grad_out)
    if op in ("sink bwd", "kept fill"):
        gv = gv[rows]
    return gv, gw


def _check(op, got, want, bf16_state: bool = False) -> str:
    if op == "lookup":
        return f"scores {_rel(got[0], want[0]):.1e}, slots = ref {float((got[1] == want[1]).float().mean()):.2%}"
    if op == "gather+hist":
        return f"out {_rel(got[0], want[0]):.1e}, counts exact {bool((got[1] == want[1]).all())}"
    if op == "topk bwd":
        return f"dQ {_rel(got[0], want[0]):.1e}, dK {_rel(got[1], want[1]):.1e}"
    if op == "row adamw" and bf16_state:  # both updated the same bf16 rows: equal elements, then the errors
        return (f"vs torch: param equal {float((got[0] == want[0]).float().mean()):.2%}, "
                f"step {_rel(got[0], want[0]):.1e}, m {_rel(got[1], want[1]):.1e}")
    if op == "row adamw":  # the rows' change and first moment against float64
        return f"step {_rel(got[0], want[0]):.1e}, m {_rel(got[1], want[1]):.1e}"
    return f"dV {_rel(got[0], want[0]):.1e}, dW {_rel(got[1], want[1]):.1e}"


def measure(item: str, cfg: dict, device, repeats: int) -> dict:
    """One row: ``item`` = "op/dtype" checked, timed (op and kernels) on the triton backend, op timed on torch."""
    import torch

    from gpu_timing import kernel_time_or_reason, op_time

    op, dtype_name = item.rsplit("/", 1)
    torch.manual_seed(0)
    inputs = _inputs(cfg, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name], device)
    triton_fn = _op_runner(op, "triton", inputs, cfg)
    check = _check(op, triton_fn(), _reference(op, inputs, cfg), bf16_state=dtype_name == "bf16")
    triton_s = op_time(triton_fn, device, repeats)
    kernel_ms, launches, profiler_failed = kernel_time_or_reason(triton_fn, device, min(repeats, 5))
    torch_s = op_time(_op_runner(op, "torch", inputs, cfg), device, repeats)
    floor_ms = floors(cfg, dtype_name)[op][2] * 1e3
    return dict(op=op, dtype=dtype_name, check=check, triton_ms=triton_s * 1e3, kernel_ms=kernel_ms,
                launches=launches, profiler_failed=profiler_failed, torch_ms=torch_s * 1e3, floor_ms=floor_ms)


def table(rows: list[dict]) -> list[str]:
    """The markdown table of :func:`measure` rows and failed items ({"item", "reason"})."""
    lines = ["| op | dtype | check vs float64 reference (bf16 row adamw: vs torch) | triton op ms | kernels ms "
             "| launches | torch op ms | op speed-up | floor ms | kernels x floor |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "reason" in r:
            op, dtype = r["item"].rsplit("/", 1)
            lines.append(f"| {op} | {dtype} | failed: {r['reason']} | - | - | - | - | - | - | - |")
            continue
        kernels = (f"{r['kernel_ms']:.3f} | {r['launches']:.0f}" if r["kernel_ms"] is not None
                   else f"profiler failed: {r['profiler_failed']} | -")
        over = f"{r['kernel_ms'] / r['floor_ms']:.1f}" if r["kernel_ms"] is not None else "-"
        lines.append(f"| {r['op']} | {r['dtype']} | {r['check']} | {r['triton_ms']:.3f} | {kernels} "
                     f"| {r['torch_ms']:.3f} | {r['torch_ms'] / r['triton_ms']:.2f} | {r['floor_ms']:.4f} | {over} |")
    return lines


ITEMS = tuple(f"{op}/{dtype}" for dtype in ("fp32", "bf16") for op in OPS)


def roofline_lines(cfg) -> list[str]:
    lines = ["| op | dtype | bytes (MB) | GFLOP | floor µs | bound |", "|---|---|---:|---:|---:|---|"]
    for dtype in ("fp32", "bf16"):
        for op, (b, f, t) in floors(cfg, dtype).items():
            bound = "memory" if b / HBM_BYTES_S >= f / PEAK_FLOPS[dtype] else "compute"
            lines.append(f"| {op} | {dtype} | {b / 1e6:.1f} | {f / 1e9:.2f} | {t * 1e6:.1f} | {bound} |")
    return lines


def main(argv=None) -> int:
    from guarded import run_items

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny config on CPU under the Triton interpreter")
    p.add_argument("--roofline", action="store_true", help="print the floor table only")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per op (default 20, 1 with --tiny)")
    p.add_argument("--items", nargs="+", choices=ITEMS, default=list(ITEMS), metavar="OP/DTYPE",
                   help=f"the items to run, in order (default: all {len(ITEMS)}: {', '.join(ITEMS)})")
    p.add_argument("--jsonl", help="append each item's row to this file the moment it finishes (benchmarks/guarded.py)")
    p.add_argument("--out", help="also write the markdown table to this path")
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    cfg = TINY if args.tiny else PAPER
    if args.roofline:
        print("\n".join(roofline_lines(cfg)))
        return 0
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before smf_kernels defines its kernels
    import torch

    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --tiny for the CPU interpreter check")
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    repeats = args.repeats or (1 if args.tiny else 20)
    rows = run_items(args.items, lambda item: measure(item, cfg, device, repeats), args.jsonl, device)
    lines = [f"gpu_check on {name}: N={cfg['tokens']}, heads {cfg['heads']}, n_keys {cfg['n_keys']}, "
             f"top-{cfg['topk']}, key_dim {cfg['key_dim']}, D {cfg['dim']}, T {cfg['update_rows']}", ""]
    lines += table([r["result"] if r["event"] == "done" else r for r in rows])
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if all(r["event"] == "done" for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
