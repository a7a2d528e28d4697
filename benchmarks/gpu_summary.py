"""summary.md of a GPU run (benchmarks/gpu_run.py): the machine, each stage's state, the targets and every table,
from whatever rows the stage files hold (a stage that failed or never ran says so)."""
from __future__ import annotations

from pathlib import Path

from guarded import final_rows

# issue 49's targets
LAYER_TARGET_MS, FLOOR_TARGET, STEP_TARGET = 2.0, 2.0, 0.8


def _results(out: Path, stage: str) -> tuple[list[dict], list[dict]]:
    """(the results of the done items, the failed rows) of a stage file, in the order they finished."""
    rows = list(final_rows(out / f"{stage}.jsonl").values())
    return [r["result"] for r in rows if r["event"] == "done"], [r for r in rows if r["event"] == "failed"]


def _machine(out: Path) -> str:
    done, _ = _results(out, "env")
    if not done:
        return "machine: not recorded (the env stage did not finish)"
    env = done[0]
    device = env["device"]["name"] if env.get("device") else "no CUDA device"
    versions = ", ".join(f"{name} {version}" for name, version in env["packages"].items())
    return (f"{env['date']} on {device} (driver {env.get('driver') or '-'}, CUDA {env.get('torch_cuda') or '-'}, "
            f"{env.get('nvcc') or 'no nvcc'}); Python {env['python']}, {versions} (pydantic importable: "
            f"{'yes' if env.get('pydantic_importable') else 'no'}); commit {env.get('commit') or '-'}")


def _met(ok: bool, dry_run: bool) -> str:
    return "(a dry run's figure: the targets are a GPU's)" if dry_run else "met" if ok else "NOT met"


def _targets(out: Path, dry_run: bool) -> list[str]:
    lines = []
    layer, _ = _results(out, "layer")
    bf16 = next((r for r in layer if r["backend"] == "triton" and r["dtype"] == "bf16"), None)
    if bf16 is None:
        lines.append(f"- layer forward + backward, triton, bf16: not measured (target <= {LAYER_TARGET_MS} ms)")
    else:
        kernels = f"{bf16['kernel_ms']:.3f} ms" if bf16["kernel_ms"] is not None else "not measured"
        lines.append(f"- layer forward + backward, triton, bf16, N = {bf16['tokens']:,}: {bf16['step_ms']:.3f} ms "
                     f"(kernels {kernels}); target <= {LAYER_TARGET_MS} ms: "
                     f"{_met(bf16['step_ms'] <= LAYER_TARGET_MS, dry_run)}")
    checks = [r for r in _results(out, "gpu_check")[0] if r["kernel_ms"] is not None]
    if checks:
        over = [r for r in checks if r["kernel_ms"] > FLOOR_TARGET * r["floor_ms"]]
        worst = max(checks, key=lambda r: r["kernel_ms"] / r["floor_ms"])
        lines.append(f"- kernels <= {FLOOR_TARGET}x their floor: {len(checks) - len(over)} of {len(checks)} measured "
                     f"rows within; worst {worst['op']} {worst['dtype']} at "
                     f"{worst['kernel_ms'] / worst['floor_ms']:.1f}x: {_met(not over, dry_run)}")
    else:
        lines.append(f"- kernels <= {FLOOR_TARGET}x their floor: not measured")
    steps, _ = _results(out, "train_step")
    by_recipe = {r["recipe"]: r["step_ms"] for r in steps}
    if "sparse" in by_recipe and "full" in by_recipe:
        ratio = by_recipe["sparse"] / by_recipe["full"]
        lines.append(f"- sparse step / full finetuning step: {ratio:.2f}x; target <= {STEP_TARGET}x: "
                     f"{_met(ratio <= STEP_TARGET, dry_run)}")
    else:
        lines.append(f"- sparse step / full finetuning step: not measured (target <= {STEP_TARGET}x)")
    return lines


def expected_failure(stage: str, row: dict) -> str | None:
    """Why the failed ``row`` of ``stage`` was expected (a row marked so: a dry run's Triton item that met Triton
    3.6's interpreter bug, see gpu_run.interpreter_bug; or a failure by design: :data:`gpu_layer.EXPECTED_FAILURES`),
    or None: a failure that counts."""
    import gpu_layer

    if row.get("expected"):
        return row["expected"]
    text, why = gpu_layer.EXPECTED_FAILURES.get(row["item"], (None, None)) if stage == "layer" else (None, None)
    return why if text is not None and text in row.get("reason", "") else None


def _command_stage(out: Path, stage: str) -> list[str]:
    rows = list(final_rows(out / f"{stage}.jsonl").values())
    if not rows:
        return ["not run"]
    row = rows[-1]
    result = row.get("result") or {}
    state = "done" if row["event"] == "done" else f"failed: {row['reason']}"
    lines = [f"{state}; `{result['command']}` in {result['seconds']} s" if result else state]
    for key in ("note", "outcome"):
        if result.get(key):
            lines.append(f"{key}: {result[key]}")
    if result.get("built"):
        lines.append(f"built: {', '.join(result['built'])} ({'with' if result.get('nvcc_ran') else 'WITHOUT'} nvcc: "
                     f"{'CUDA' if result.get('nvcc_ran') else 'CPU'} kernels)")
    if row["event"] == "failed" and result.get("tail"):
        lines += ["", "```", result["tail"], "```"]
    return lines


def summary_text(out: Path, stages: list[str], dry_run: bool, seconds: float) -> str:
    """The summary's markdown (see the module docstring)."""
    import bench_train_step
    import gpu_check
    import gpu_layer

    lines = ["# GPU run" + (" (dry run: CPU, Triton interpreter, tiny shapes; no figure here is a GPU's)"
                            if dry_run else ""), "", _machine(out), f"{seconds:.0f} s so far.", "",
             "| stage | done | failed | file |", "|---|---:|---:|---|"]
    failures = []
    for stage in stages:
        path = out / f"{stage}.jsonl"
        rows = final_rows(path).values()
        done = sum(r["event"] == "done" for r in rows)
        failed = [r for r in rows if r["event"] == "failed"]
        failures += [f"- {stage} / {r['item']}: failed: {r['reason']}" if expected_failure(stage, r) is None
                     else f"- {stage} / {r['item']}: failed as expected ({expected_failure(stage, r)}): {r['reason']}"
                     for r in failed]
        state = "" if path.is_file() else " (not run)"
        lines.append(f"| {stage}{state} | {done} | {len(failed)} | {path.name} |")
    lines += ["", "## Targets", ""] + _targets(out, dry_run)
    if failures:
        lines += ["", "## Failures", ""] + failures
    tables = {"gpu_check": gpu_check.table, "layer": gpu_layer.table,
              "train_step": lambda rows: bench_train_step.table(rows).splitlines()}
    for stage in stages:
        lines += ["", f"## {stage}", ""]
        if stage in tables:
            rows = list(final_rows(out / f"{stage}.jsonl").values())
            lines += tables[stage]([r["result"] if r["event"] == "done" else r for r in rows]) if rows else ["not run"]
        elif stage != "env":
            lines += _command_stage(out, stage)
        else:
            lines.append(_machine(out))
    return "\n".join(lines) + "\n"


def write_summary(out: Path, stages: list[str], dry_run: bool, seconds: float) -> None:
    """Rewrite ``out``/summary.md (through a temporary file: a run killed while writing keeps the last one)."""
    tmp = out / "summary.md.tmp"
    tmp.write_text(summary_text(out, stages, dry_run, seconds))
    tmp.replace(out / "summary.md")
