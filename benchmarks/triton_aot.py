"""Compile every Triton kernel the ops launch, ahead of time, for sm_90 and sm_80, with no GPU.

Each launch comes from the op's own ``plan_*`` function (same kernel, grid,
constexprs and num_warps as the launcher picks) at the paper configuration:
N = 16,384 tokens, 4 heads, n_keys 128, top-16, key_dim 256, D 896, fp32 and
bf16. Triton's compiler and the ptxas bundled in its wheel build each kernel;
ptxas's report gives registers and spills, the compiled kernel its shared
memory; occupancy is estimated from them (see :func:`estimated_occupancy`).

    python benchmarks/triton_aot.py [--json PATH] [--jobs 2] [--tokens 16384]

Prints a markdown table. Kernels compile in a fresh Triton cache (times are
honest cold compiles), in a pool of worker processes. Each compile reports its wall
time and its CPU time (the worker's and ptxas's, which runs as a child process):
the wall time is what a user waits for on an idle machine and grows with the
machine's load; the CPU time hardly does, so tests/test_triton_aot.py holds the
compile budget on it.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import os
import re
import resource
import sys
import tempfile
import time

TARGETS = {"sm_90": 90, "sm_80": 80}
DTYPES = ("fp32", "bf16")
# Per-SM limits: registers, max resident warps, max resident blocks, shared memory per SM
# and per block (bytes); the driver reserves 1 KiB of shared memory per block.
SM_LIMITS = {
    90: dict(regs=65536, warps=64, blocks=32, smem=233472, smem_block=232448),
    80: dict(regs=65536, warps=64, blocks=32, smem=167936, smem_block=166912),
}
PAPER = dict(tokens=16384, heads=4, n_keys=128, topk=16, key_dim=256, dim=896, selected_rows=4096)


def estimated_occupancy(capability: int, registers: int, shared_bytes: int, num_warps: int) -> float:
    """Fraction of the SM's maximum resident warps one kernel reaches, limited by registers
    (allocated per warp in units of 256, per thread rounded up to 8), shared memory (per block,
    128-byte granules plus the 1 KiB reserve), warps and blocks."""
    lim = SM_LIMITS[capability]
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = (lim["regs"] // regs_per_warp) // num_warps
    smem = -(-(shared_bytes + 1024) // 128) * 128
    by_smem = lim["smem"] // smem if shared_bytes <= lim["smem_block"] else 0
    blocks = min(by_regs, by_smem, lim["warps"] // num_warps, lim["blocks"])
    return blocks * num_warps / lim["warps"]


def launch_plans(dtype_name: str, config: dict) -> dict:
    """{name: LaunchPlan} for every kernel the ops launch at ``config``, on meta tensors."""
    import torch

    from smf_kernels.triton_kernels import gather as triton_gather
    from smf_kernels.triton_kernels import row_adamw as triton_row_adamw
    from smf_kernels.triton_kernels import row_backward as triton_row_backward
    from smf_kernels.triton_kernels import topk as triton_topk
    from smf_kernels.triton_kernels import topk_backward as triton_topk_backward

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    meta = dict(device="meta")
    n, heads, n_keys, topk = config["tokens"], config["heads"], config["n_keys"], config["topk"]
    rows, per_token, dim = n_keys * n_keys, heads * topk, config["dim"]
    query = torch.empty(n, heads, config["key_dim"], dtype=dtype, **meta)
    keys = torch.empty(heads, 2, n_keys, config["key_dim"] // 2, dtype=dtype, **meta)
    values = torch.empty(rows, dim, dtype=dtype, **meta)
    indices = torch.empty(n, per_token, dtype=torch.int64, **meta)
    weights = torch.empty(n, per_token, dtype=dtype, **meta)
    counts = torch.empty(rows, dtype=torch.int64, **meta)
    valid = torch.empty(n, dtype=torch.bool, **meta)
    grad_out = torch.empty(n, dim, dtype=dtype, **meta)
    update_rows = torch.empty(config["selected_rows"], dtype=torch.int64, **meta)
    selected = update_rows.numel()
    row_step = torch.empty(rows, dtype=torch.int64, **meta)
    grad_rows = torch.empty(selected, dim, dtype=torch.float32, **meta)
    row_valid = torch.empty(selected, dtype=torch.bool, **meta)
    lr, clip = torch.empty((), dtype=torch.float64, **meta), torch.empty((), dtype=torch.float32, **meta)
    flag = torch.empty(1, dtype=torch.int32, **meta)
    work = triton_row_backward.new_work_buffer(rows, torch.device("meta"))
    keys_plan, read_keys = triton_row_backward.plan_read_keys(indices, rows, work)
    order = torch.sort(read_keys, stable=True)[1]
    dense_items, dense_rows, _ = triton_row_backward.plan_row_backward(grad_out, values, weights, order, None, True,
                                                                       True, work)
    sparse_items, sparse_rows, _ = triton_row_backward.plan_row_backward(grad_out, values, weights, order,
                                                                         update_rows, True, True, work)
    sink_rows = triton_row_backward.plan_row_backward(grad_out, values, weights, order, update_rows, True, True,
                                                      work, into=grad_rows)[1]
    grad_scores = torch.empty(n, heads, topk, dtype=torch.float32, **meta)
    topk_slots = torch.empty(n, heads, topk, dtype=torch.int64, **meta)
    key_partials = triton_topk_backward.plan_topk_key_grad(grad_scores, query, topk_slots, n_keys, flag)
    return {
        "product_key_topk": triton_topk.plan_product_key_topk(query, keys, topk)[0],
        "topk_backward (query grad)": triton_topk_backward.plan_topk_query_grad(grad_scores, keys, topk_slots,
                                                                                           flag)[0],
        "topk_backward (key grad partials)": key_partials[0],
        "topk_backward (sum of key partials)": triton_topk_backward.plan_sum_partials(key_partials[1])[0],
        "gather_forward (counts, valid)": triton_gather.plan_gather_forward(values, indices, weights, counts,
                                                                            valid)[0],
        "read_keys": keys_plan,
        "plan_items (dense)": dense_items,
        "plan_items (T rows)": sparse_items,
        "row_backward (dense)": dense_rows,
        "row_backward (T rows)": sparse_rows,
        "row_backward (T rows, into a sink)": sink_rows,
        "row_adamw (T rows, clipped)": triton_row_adamw.plan_row_adamw(
            values, torch.empty_like(values), torch.empty_like(values), row_step, update_rows, grad_rows, row_valid,
            lr, clip, 0.9, 0.999, 1e-8, 0.01)[0],
        "row_adamw (T rows, clipped, compact state)": triton_row_adamw.plan_row_adamw(
            values, grad_rows.to(dtype), grad_rows.to(dtype), row_step[:selected], update_rows, grad_rows, row_valid,
            lr, clip, 0.9, 0.999, 1e-8, 0.01, state_slots=update_rows)[0],
    }


def _ptxas_numbers(log: str) -> tuple[int, int]:
    """(registers, spill bytes = stores + loads) from ptxas -v output."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise RuntimeError(f"unexpected ptxas report:\n{log}")
    return int(regs.group(1)), int(spills.group(1)) + int(spills.group(2))


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's finished children (ptxas runs as one)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def compile_one(job: tuple[str, str, str, dict]) -> dict:
    """Compile one (kernel, target, dtype) exactly as its launcher would specialise it."""
    name, target_name, dtype_name, config = job
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    plan = launch_plans(dtype_name, config)[name]
    capability = TARGETS[target_name]
    record = dict(kernel=name, target=target_name, dtype=dtype_name,
                  config={k: v for k, v in plan.meta.items()}, ok=False, registers=None, spill_bytes=None,
                  shared_bytes=None, num_warps=plan.meta.get("num_warps", 4), occupancy=None, compile_s=None,
                  compile_cpu_s=None)
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    fn = plan.kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)  # the launcher's own binder
    bound, specialization, options = binder(*plan.args, **plan.meta)
    options, signature, constexprs, attrs = fn._pack_args(backend, plan.meta, bound, specialization, options)
    # A fresh cache per job: two jobs with one specialisation (a kernel whose arguments do not depend on
    # the dtype) would otherwise hit the cache, and ptxas would not run for the second.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="job-", dir=os.environ.get("TRITON_CACHE_DIR"))
    log = io.StringIO()
    start, cpu_start, children_start = time.perf_counter(), time.process_time(), _children_cpu_s()
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                    options=options.__dict__)
    except Exception as exc:  # reported in the table, not raised: one failure must not hide the others
        record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return record
    record["compile_s"] = round(time.perf_counter() - start, 2)
    record["compile_cpu_s"] = round(time.process_time() - cpu_start + _children_cpu_s() - children_start, 2)
    registers, spills = _ptxas_numbers(log.getvalue())
    record.update(ok=True, registers=registers, spill_bytes=spills, shared_bytes=int(kernel.metadata.shared),
                  num_warps=int(kernel.metadata.num_warps))
    record["occupancy"] = estimated_occupancy(capability, registers, record["shared_bytes"], record["num_warps"])
    return record


def triton_version() -> str:
    import triton

    return triton.__version__


def ptxas_unavailable_reason() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        path = get_ptxas(90).path
    except Exception as exc:  # no nvidia backend in this triton build
        return f"triton's nvidia backend is unavailable: {exc}"
    if not path or not os.path.exists(path):
        return "triton's bundled ptxas is absent"
    return None


def run(config: dict, jobs: int, kernels: list[str] | None = None, targets: list[str] | None = None) -> list[dict]:
    names = kernels or list(launch_plans("fp32", config))
    work = [(name, target, dtype, config) for name in names for target in targets or TARGETS for dtype in DTYPES]
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # cold compiles; the workers inherit it
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(compile_one, work))


MAX_COMPILE_CPU_S = 60.0  # per kernel, target and dtype: CPU seconds of the compiler and ptxas
MIN_OCCUPANCY = 0.25  # on sm_90


def budget_failures(records: list[dict]) -> list[str]:
    """One line per record outside the budgets: it failed to compile, took more than MAX_COMPILE_CPU_S CPU
    seconds, or (sm_90) spills or reaches less than MIN_OCCUPANCY estimated occupancy."""
    failures = []
    for r in records:
        what = f"{r['kernel']} {r['target']} {r['dtype']}"
        if not r["ok"]:
            failures.append(f"{what}: did not compile: {r.get('error')}")
            continue
        if r["compile_cpu_s"] > MAX_COMPILE_CPU_S:
            failures.append(f"{what}: {r['compile_cpu_s']} CPU s to compile (wall {r['compile_s']} s)")
        if r["target"] == "sm_90" and r["spill_bytes"] != 0:
            failures.append(f"{what}: spills {r['spill_bytes']} B")
        if r["target"] == "sm_90" and r["occupancy"] < MIN_OCCUPANCY:
            failures.append(f"{what}: occupancy {r['occupancy']:.0%}")
    return failures


def table(records: list[dict]) -> str:
    lines = ["| kernel | target | dtype | ok | regs | spill B | smem B | warps | occupancy | compile s (wall) "
             "| compile s (CPU) |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        occ = "-" if r["occupancy"] is None else f"{r['occupancy']:.0%}"
        lines.append(f"| {r['kernel']} | {r['target']} | {r['dtype']} | {'yes' if r['ok'] else r.get('error', 'no')} "
                     f"| {r['registers']} | {r['spill_bytes']} | {r['shared_bytes']} | {r['num_warps']} | {occ} "
                     f"| {r['compile_s']} | {r['compile_cpu_s']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the records to this path")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler worker processes")
    parser.add_argument("--tokens", type=int, default=PAPER["tokens"])
    parser.add_argument("--kernel", action="append", help="only this kernel (repeatable)")
    parser.add_argument("--target", action="append", choices=sorted(TARGETS), help="only this target (repeatable)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless every record holds the budgets (see budget_failures)")
    args = parser.parse_args(argv)
    if "smf_kernels" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("run as a script: smf_kernels was imported with the Triton interpreter on")
    # The kernels must be compiled, not interpreted: set before triton.jit decorators run
    # (smf_kernels is imported only in the compile workers, which inherit this environment).
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    reason = ptxas_unavailable_reason()
    if reason:
        print(f"skipped: {reason}")
        return 2
    config = dict(PAPER, tokens=args.tokens)
    records = run(config, args.jobs, args.kernel, args.target)
    print(f"Triton AOT report (Triton {triton_version()}): N={config['tokens']}, heads {config['heads']}, n_keys {config['n_keys']}, "
          f"top-{config['topk']}, key_dim {config['key_dim']}, D {config['dim']}, "
          f"T {config['selected_rows']} selected rows\n")
    print(table(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if args.check:
        failures = budget_failures(records)
        print("\n".join(["", "budgets: " + ("held" if not failures else f"{len(failures)} outside"), *failures]))
        return 1 if failures else 0
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
