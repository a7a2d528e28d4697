"""The GPU run: every figure of the kernels, the layer and the training step in one command, saved as it goes.

    python benchmarks/gpu_run.py --out DIR              # one CUDA GPU (an H100: about 6-7 minutes)
    python benchmarks/gpu_run.py --out DIR --dry-run    # CPU, Triton interpreter, tiny shapes: every stage, every file
    python benchmarks/gpu_run.py --out DIR --stages gpu_check layer   # some stages only

Stages, in order, each in its own processes with its own time limit, all inside ``--budget`` seconds:

  env         versions (Python, torch, Triton, transformers, ...), the device, driver and commit
  gpu_check   benchmarks/gpu_check.py: each op in fp32 and bf16 checked and timed (op, kernels alone, floor)
  layer       benchmarks/gpu_layer.py: the layer's forward + backward at N = 16,384 in bf16 and fp32, triton and
              torch backends against the authors' layer
  train_step  benchmarks/bench_train_step.py: one step of sparse, LoRA and full finetuning, 4 x 4 x 512 tokens, on
              the Qwen-2.5-0.5B shape
  ext_build   SMF_KERNELS_BUILD_EXT=1 python setup.py build_ext --inplace (the CUDA extension)
  ext_tests   SMF_TEST_DEVICE=cuda python -m pytest on the extension's and the kernels' tests, one file at a time
              in the time left of ``--budget`` (about 360 tests; with a cold Triton cache each kernel variant compiles
              on first use, so they may need minutes: a file the budget does not reach is named as not run)

Each stage writes ``DIR/<stage>.jsonl``, one line per item, appended and flushed the moment the item finishes
(benchmarks/guarded.py): an item that raises, runs out of memory, trips a device-side assert (the worker process
is replaced: a poisoned CUDA context stays in its process) or outlasts its limit costs that item only, with a row
saying why. A failure by design (the authors' layer in bf16 on CUDA) is recorded as expected and, like a dry run's
Triton item that meets Triton 3.6's interpreter bug under numpy >= 2.4 (a kernel looping over a runtime integer
raises; fixed in 3.7), leaves the exit status 0: 1 means an unexpected failure. ``DIR/summary.md`` is rewritten
after every stage from whatever finished, with the targets (the layer at N = 16,384 in bf16 <= 2.0 ms, each kernel
<= 2x its floor, the sparse step <= 0.8x full finetuning); ``DIR/gpu_run.log`` holds every process's output.
Eight files in all, one folder deep (what the device tool brings back). The figures come first and the extension's
build last: a build that hangs costs the build and its tests only. ``--dry-run`` runs the same stages on CPU at tiny
shapes; its extension build parses setup.py's extensions and build_ext's options without compiling (no CUDA here),
and its test stage collects the same test files without running them.
"""
from __future__ import annotations

import argparse
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

from guarded import append_line, final_rows, run_guarded  # noqa: E402

STAGES = ("env", "gpu_check", "layer", "train_step", "ext_build", "ext_tests")
# seconds: a stage's whole limit, and one item's (the first gpu_check item compiles Triton kernels)
STAGE_LIMIT_S = {"env": 30, "gpu_check": 150, "layer": 60, "train_step": 150, "ext_build": 150,
                 "ext_tests": math.inf}  # the tests: what is left of --budget
ITEM_LIMIT_S = {"env": 30, "gpu_check": 45, "layer": 40, "train_step": 100}
TRAIN_RECIPES = ("full", "sparse", "lora")  # the two of the target first
TRAIN_SHAPE = dict(micro_batches=4, micro_batch_size=4, seq_len=512)
BUILD = ["setup.py", "build_ext", "--inplace"]
EXT_TESTS = ("tests/test_ext_ops.py", "tests/test_weighted_gather.py", "tests/test_product_key_topk.py",
             "tests/test_triton_topk.py", "tests/test_triton_topk_backward.py", "tests/test_row_adamw.py",
             "tests/test_nonfinite.py", "tests/test_triton_no_host_sync.py")
SUMMARY, LOG = "summary.md", "gpu_run.log"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_run.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, metavar="DIR", help="the folder for the results (created; must be empty)")
    p.add_argument("--dry-run", action="store_true",
                   help="every stage on CPU under the Triton interpreter at tiny shapes (no GPU needed)")
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES), help="the stages to run, in order")
    p.add_argument("--budget", type=float, default=450.0,
                   help="seconds for the whole run (default 450): a stage gets its own limit or what is left")
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        p.error(f"--out {args.out!r}: must be a new or empty folder (the stage files are appended to)")
    blocked = next((parent for parent in out.parents if parent.exists() and not parent.is_dir()), None)
    if blocked is not None:  # else mkdir's traceback after the checks
        p.error(f"--out {args.out!r}: {str(blocked)!r} is a file, not a folder")
    if not 0 < args.budget < math.inf:  # nan compares false: refused too
        p.error(f"--budget must be a finite number > 0 seconds, got {args.budget}")
    repeated = sorted({stage for stage in args.stages if args.stages.count(stage) > 1})
    if repeated:
        p.error(f"--stages {' '.join(repeated)}: given twice; name each stage once (its file is appended to)")
    try:  # last: nothing is created for a run refused above
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".gpu_run_probe"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        p.error(f"--out {args.out!r}: cannot write there ({err.strerror or type(err).__name__})")
    return args


def child_env(dry_run: bool) -> dict:
    """The stages' environment: this repository first on the path, unbuffered output, no hub, and the Triton
    interpreter on CPU for a dry run (off otherwise: kernels compile for the GPU)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if dry_run:
        env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


# what Triton 3.6's interpreter raises under numpy >= 2.4 where a kernel loops over a runtime integer (its tensors'
# __index__ calls int() on a 1-element array; Triton 3.7 squeezes it first)
INTERPRETER_BUG = "only 0-dimensional arrays can be converted to Python scalars"


def interpreter_bug() -> str | None:
    """Why a dry run's Triton item failing with :data:`INTERPRETER_BUG` is expected under this Python's packages
    (Triton before 3.7 with numpy 2.4 or later: the stock CUDA image's Triton 3.6 under a newer numpy), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        triton, numpy = (tuple(int(part) for part in version(name).split(".")[:2]) for name in ("triton", "numpy"))
    except (PackageNotFoundError, ValueError):
        return None
    if triton < (3, 7) and numpy >= (2, 4):
        return (f"Triton {version('triton')}'s interpreter bug under numpy {version('numpy')}, fixed in Triton 3.7: "
                "install numpy<2.4 to dry-run this item (the GPU run compiles it: unaffected)")
    return None


def interpreted(stage: str, item: str) -> bool:
    """Whether ``item`` of ``stage`` runs Triton kernels (under the interpreter in a dry run): every op of
    gpu_check, the triton rows of layer; the training step runs on CPU's backends."""
    return stage == "gpu_check" or stage == "layer" and item.startswith("triton/")


def _python(script: str, *args: str) -> list[str]:
    return [sys.executable, str(BENCH / script), *args]


def worker_command(stage: str, dry_run: bool, jsonl: Path):
    """(items, command_for(items left) -> argv) of a stage run by benchmarks/guarded.py's workers, rows to ``jsonl``."""
    import gpu_check
    import gpu_layer

    rows = ["--jsonl", str(jsonl)] + (["--tiny"] if dry_run else [])
    if stage == "env":
        return ["versions"], lambda left: _python("gpu_env.py", "--jsonl", str(jsonl))
    if stage == "gpu_check":
        return list(gpu_check.ITEMS), lambda left: _python("gpu_check.py", *rows, "--items", *left)
    if stage == "layer":
        return list(gpu_layer.ITEMS), lambda left: _python("gpu_layer.py", *rows, "--items", *left)
    shape = dict(micro_batches=2, micro_batch_size=2, seq_len=32) if dry_run else TRAIN_SHAPE
    sizes = [f"--{key.replace('_', '-')}={value}" for key, value in shape.items()]
    steps = ["--warmup=0", "--repeats=1", "--rows=8", "--device=cpu"] if dry_run else ["--warmup=2", "--repeats=3"]
    return list(TRAIN_RECIPES), lambda left: _python("bench_train_step.py", *rows, *sizes, *steps, "--recipes", *left)


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_command(argv: list[str], env: dict, timeout: float, log: Path) -> tuple[int | None, float, str]:
    """(exit status or None when killed at ``timeout``, seconds, the output) of ``argv`` run in the repository root,
    its output appended to ``log``."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=max(timeout, 1))
        status = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        status = None
    text = output.decode(errors="replace")
    with open(log, "a") as f:
        f.write(f"$ {' '.join(argv)}\n{text}\n")
    return status, time.monotonic() - start, text


def ext_build(env: dict, timeout: float, log: Path, dry_run: bool) -> dict:
    """The CUDA extension built in place (a dry run: setup.py's extensions defined and build_ext's options parsed,
    nothing compiled)."""
    argv = [sys.executable, *BUILD] if not dry_run else [sys.executable, "setup.py", "build_ext", "--help"]
    status, seconds, text = run_command(argv, dict(env, SMF_KERNELS_BUILD_EXT="1"), timeout, log)
    built = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "smf_kernels").glob("_ext*.so"))
    result = dict(command="SMF_KERNELS_BUILD_EXT=1 python " + " ".join(argv[1:]), seconds=round(seconds, 1),
                  built=built, nvcc_ran="nvcc" in text, tail=_tail(text))
    if dry_run:
        result["note"] = "dry run: nothing compiled (no CUDA here); setup.py defined its extensions"
    if status != 0:
        raise StageFailed("timed out after %.0f s" % seconds if status is None else f"exit status {status}", result)
    return result


def ext_tests(env: dict, timeout: float, log: Path, dry_run: bool) -> dict:
    """The extension's and kernels' tests on the GPU (a dry run: the same files collected on CPU), one pytest per
    file of :data:`EXT_TESTS` in order, each in the time left of ``timeout``: a cold Triton cache that makes the
    first files slow costs the files the time does not reach, each named, not the results of the others."""
    device = "cpu" if dry_run else "cuda"
    start, outcomes, tails, failed = time.monotonic(), {}, [], []
    for path in EXT_TESTS:
        left = timeout - (time.monotonic() - start)
        if left < 1:
            outcomes[path] = "not run: the run's --budget ran out"
            failed.append(path)
            continue
        argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE",
                *(["--collect-only"] if dry_run else []), path]
        status, seconds, text = run_command(argv, dict(env, SMF_TEST_DEVICE=device), left, log)
        tail = _tail(text)
        last = tail.splitlines()[-1] if tail else ""
        outcomes[path] = f"timed out after {seconds:.0f} s" if status is None else f"{last} ({seconds:.0f} s)"
        if status != 0:
            failed.append(path)
            tails.append(f"{path}:\n{tail}")
    seconds = time.monotonic() - start
    result = dict(command=("" if dry_run else "SMF_TEST_DEVICE=cuda ") + "python -m pytest -p no:cacheprovider -q "
                  f"-rfE{' --collect-only' if dry_run else ''} FILE, for each of {len(EXT_TESTS)} files",
                  seconds=round(seconds, 1), files=outcomes,
                  outcome=f"{len(EXT_TESTS) - len(failed)} of {len(EXT_TESTS)} files passed",
                  tail="\n".join(tails)[-4000:])
    if dry_run:
        result["note"] = "dry run: collected only (the CPU suite runs these tests)"
    if failed:
        raise StageFailed(f"{len(failed)} of {len(EXT_TESTS)} test files did not pass: {', '.join(failed)}", result)
    return result


class StageFailed(Exception):
    """A command stage that ended badly: why, and what it produced."""

    def __init__(self, reason: str, result: dict):
        super().__init__(reason)
        self.result = result


def run_stage(stage: str, out: Path, env: dict, deadline: float, dry_run: bool) -> None:
    """One stage, its rows in ``out``/<stage>.jsonl."""
    path, log = out / f"{stage}.jsonl", out / LOG
    if stage in ("ext_build", "ext_tests"):
        if deadline - time.monotonic() < 1:
            append_line(path, {"item": stage, "event": "failed", "reason": "not started: the run's --budget ran out"})
            return
        append_line(path, {"item": stage, "event": "start"})
        try:
            row = {"item": stage, "event": "done",
                   "result": (ext_build if stage == "ext_build" else ext_tests)(env, deadline - time.monotonic(), log,
                                                                                 dry_run)}
        except StageFailed as failed:
            row = {"item": stage, "event": "failed", "reason": str(failed), "result": failed.result}
        except Exception as exc:  # noqa: BLE001 - the run goes on to the summary
            row = {"item": stage, "event": "failed", "reason": f"{type(exc).__name__}: {exc}"}
        append_line(path, row)
        return
    items, command_for = worker_command(stage, dry_run, path)
    run_guarded(command_for, items, path, log, ITEM_LIMIT_S[stage], deadline, env=env, cwd=ROOT)
    bug = interpreter_bug() if dry_run else None
    if bug is not None:  # the item's row again, marked expected: the items it spares ran and were checked
        for row in final_rows(path).values():
            if row["event"] == "failed" and interpreted(stage, row["item"]) and INTERPRETER_BUG in row["reason"]:
                append_line(path, dict(row, expected=bug))


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's finished children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv=None) -> int:
    from gpu_summary import expected_failure, write_summary

    args = parse_args(argv)
    out = Path(args.out)
    env = child_env(args.dry_run)
    start = time.monotonic()
    end = start + args.budget
    for stage in args.stages:
        stage_start, cpu_start = time.monotonic(), _children_cpu_s()
        deadline = min(end, stage_start + STAGE_LIMIT_S[stage])
        try:
            run_stage(stage, out, env, deadline, args.dry_run)
        except Exception as exc:  # noqa: BLE001 - a broken stage runner costs that stage only
            append_line(out / f"{stage}.jsonl", {"item": stage, "event": "failed",
                                                  "reason": f"the stage's runner raised {type(exc).__name__}: {exc}"})
        rows = final_rows(out / f"{stage}.jsonl")
        failed = [row for row in rows.values() if row["event"] == "failed"]
        expected = sum(expected_failure(stage, row) is not None for row in failed)
        print(f"gpu_run: {stage}: {len(rows) - len(failed)} done, {len(failed)} failed"
              f"{f' ({expected} expected)' if expected else ''} in {time.monotonic() - stage_start:.0f} s "
              f"({_children_cpu_s() - cpu_start:.0f} CPU-s)", flush=True)
        write_summary(out, args.stages, dry_run=args.dry_run, seconds=time.monotonic() - start)
    print(f"gpu_run: summary in {out / SUMMARY} ({time.monotonic() - start:.0f} s)", flush=True)
    return 0 if all(row["event"] == "done" or expected_failure(stage, row) is not None for stage in args.stages
                    for row in final_rows(out / f"{stage}.jsonl").values()) else 1


if __name__ == "__main__":
    sys.exit(main())
