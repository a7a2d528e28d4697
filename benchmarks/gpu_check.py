"""One command for a CUDA machine: check every op's Triton path at full paper size and time it.

    python benchmarks/gpu_check.py [--out gpu_check.md]      # CUDA: N = 16,384, paper config
    python benchmarks/gpu_check.py --tiny                    # CPU, Triton interpreter (CI)
    python benchmarks/gpu_check.py --roofline                # the floor table alone, no run

For fp32 and bf16, each op (top-k lookup, gather + histogram, dense
backward, the dense backward with a tenth of the reads on 64 hot rows: the row-owned
backward's load balance, the top-k's backward, and the exact sparse update's own path: the
backward into a RowGradSink whose T rows are known before it ("sink bwd"), the backward that
keeps its reads and the step's end that sums them for T rows ("kept fill"), and RowSparseAdamW's
row update ``row_adamw_`` on T rows) runs on the ``triton`` backend and is checked against
the float64 reference: relative error of the outputs and, for the lookup, the
fraction of slot ids equal to the reference's. Each op is then timed (median of
CUDA-event timed runs) against the ``torch`` backend in the same run and against
its H100 SXM floor (see :func:`floors`). Writes a markdown table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

PAPER = dict(tokens=16384, n_keys=128, heads=4, topk=16, key_dim=256, dim=896, update_rows=4096)
TINY = dict(tokens=20, n_keys=8, heads=2, topk=4, key_dim=32, dim=48, update_rows=12)
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
    if op in ("sink bwd", "kept fill"):
        from smf_kernels.sparse import RowGradSink

        valid = torch.ones(rows.numel(), dtype=torch.bool, device=rows.device)

        def sink_backward():
            v = values.detach().requires_grad_(True)
            w = weights.detach().requires_grad_(True)
            sink = RowGradSink(v, rows.numel(), fill="reads_kept" if op == "kept fill" else "rows_first")
            if op == "sink bwd":
                sink.set_rows(rows, valid)
            out = weighted_gather(v, indices, w, grad_sink=sink, backend=backend)
            _, gw = torch.autograd.grad(out, (v, w), grad_out, allow_unused=True)
            if op == "kept fill":
                sink.sum_reads(v, rows, valid)
            return sink.grad, gw
        return sink_backward

    read = _hot_indices(indices) if op == "hot-row bwd" else indices

    def backward():
        v = values.detach().requires_grad_(True)
        w = weights.detach().requires_grad_(True)
        out = weighted_gather(v, read, w, backend=backend)
        return torch.autograd.grad(out, (v, w), grad_out)

    return backward


def _row_grads(cfg, values):
    """(T, D) fp32 row gradients, the same for every backend and the reference."""
    import torch

    generator = torch.Generator(device=values.device).manual_seed(1)
    return torch.randn(cfg["update_rows"], values.shape[1], generator=generator, device=values.device)


def _reference(op, inputs, cfg):
    import torch

    from smf_kernels.reference import product_key_topk_reference, weighted_gather_reference

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


def _check(op, got, want) -> str:
    if op == "lookup":
        return f"scores {_rel(got[0], want[0]):.1e}, slots = ref {float((got[1] == want[1]).float().mean()):.2%}"
    if op == "gather+hist":
        return f"out {_rel(got[0], want[0]):.1e}, counts exact {bool((got[1] == want[1]).all())}"
    if op == "topk bwd":
        return f"dQ {_rel(got[0], want[0]):.1e}, dK {_rel(got[1], want[1]):.1e}"
    if op == "row adamw":  # the rows' change (a bf16 table rounds the updated rows to bf16) and first moment
        return f"step {_rel(got[0], want[0]):.1e}, m {_rel(got[1], want[1]):.1e}"
    return f"dV {_rel(got[0], want[0]):.1e}, dW {_rel(got[1], want[1]):.1e}"


def _time(fn, device, repeats) -> float:
    import torch

    if device.type == "cuda":
        fn()  # warm-up (and compile)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(cfg, device, repeats) -> list[str]:
    import torch

    lines = ["| op | dtype | check vs float64 reference | triton ms | torch ms | speed-up | floor ms | x floor |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        torch.manual_seed(0)
        inputs = _inputs(cfg, dtype, device)
        bounds = floors(cfg, dtype_name)
        for op in OPS:
            triton_fn = _op_runner(op, "triton", inputs, cfg)
            check = _check(op, triton_fn(), _reference(op, inputs, cfg))
            t_triton = _time(triton_fn, device, repeats)
            t_torch = _time(_op_runner(op, "torch", inputs, cfg), device, repeats)
            floor = bounds[op][2]
            lines.append(f"| {op} | {dtype_name} | {check} | {t_triton * 1e3:.3f} | {t_torch * 1e3:.3f} "
                         f"| {t_torch / t_triton:.2f} | {floor * 1e3:.4f} | {t_triton / floor:.1f} |")
    return lines


def roofline_lines(cfg) -> list[str]:
    lines = ["| op | dtype | bytes (MB) | GFLOP | floor µs | bound |", "|---|---|---:|---:|---:|---|"]
    for dtype in ("fp32", "bf16"):
        for op, (b, f, t) in floors(cfg, dtype).items():
            bound = "memory" if b / HBM_BYTES_S >= f / PEAK_FLOPS[dtype] else "compute"
            lines.append(f"| {op} | {dtype} | {b / 1e6:.1f} | {f / 1e9:.2f} | {t * 1e6:.1f} | {bound} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny config on CPU under the Triton interpreter")
    p.add_argument("--roofline", action="store_true", help="print the floor table only")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per op (default 20, 1 with --tiny)")
    p.add_argument("--out", help="also write the markdown table to this path")
    args = p.parse_args(argv)
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
    lines = [f"gpu_check on {name}: N={cfg['tokens']}, heads {cfg['heads']}, n_keys {cfg['n_keys']}, "
             f"top-{cfg['topk']}, key_dim {cfg['key_dim']}, D {cfg['dim']}, T {cfg['update_rows']}", ""]
    lines += run(cfg, device, args.repeats or (1 if args.tiny else 20))
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
