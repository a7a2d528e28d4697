"""benchmarks/gpu_run.py, the one GPU command: its dry run (every stage on CPU under the Triton interpreter, with
pydantic blocked as on a stock CUDA image) writes every file and a summary, and a stage or worker that fails costs
its own rows only (benchmarks/guarded.py)."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_check  # noqa: E402
import gpu_layer  # noqa: E402
import gpu_run  # noqa: E402
from guarded import final_rows, run_guarded  # noqa: E402

ITEMS = {"env": 1, "gpu_check": len(gpu_check.ITEMS), "layer": len(gpu_layer.ITEMS),
         "train_step": len(gpu_run.TRAIN_RECIPES), "ext_build": 1, "ext_tests": 1}


def _blocked_pydantic(folder: Path) -> Path:
    """A folder whose pydantic and pydantic_core raise ImportError, to put first on PYTHONPATH."""
    for name in ("pydantic", "pydantic_core"):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(f"raise ImportError('{name} is blocked')\n")
    return folder


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The dry run's folder, run once for this module with pydantic blocked in every process."""
    block = _blocked_pydantic(tmp_path_factory.mktemp("block"))
    out = tmp_path_factory.mktemp("gpu_run") / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(block), str(ROOT)]))
    assert subprocess.run([sys.executable, "-c", "import pydantic"], env=env, capture_output=True).returncode != 0
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_run.py"), "--out", str(out), "--dry-run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + (out / "gpu_run.log").read_text()[-3000:]
    return out


def test_dry_run_writes_every_stage_file_and_the_summary(dry_run):
    files = sorted(p.name for p in dry_run.iterdir())
    assert files == sorted([f"{stage}.jsonl" for stage in gpu_run.STAGES] + ["summary.md", "gpu_run.log"])
    # what the device tool brings back: at most 8 files, named in letters, digits, '.', '_' and '-'
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in files)
    for stage, count in ITEMS.items():
        rows = final_rows(dry_run / f"{stage}.jsonl")
        assert len(rows) == count and all(r["event"] == "done" for r in rows.values()), (stage, rows)
    summary = (dry_run / "summary.md").read_text()
    assert summary.startswith("# GPU run (dry run") and "failed:" not in summary
    for stage in gpu_run.STAGES:
        assert f"## {stage}\n" in summary and f"| {stage} | {ITEMS[stage]} | 0 |" in summary
    env = final_rows(dry_run / "env.jsonl")["versions"]["result"]
    assert env["pydantic_importable"] is False and env["triton_interpret"] == "1"


def test_dry_run_checks_every_op_against_the_reference(dry_run):
    rows = [r["result"] for r in final_rows(dry_run / "gpu_check.jsonl").values()]
    assert [f"{r['op']}/{r['dtype']}" for r in rows] == list(gpu_check.ITEMS)
    assert all("slots = ref 100.00%" in r["check"] for r in rows if r["op"] == "lookup")
    assert all("counts exact True" in r["check"] for r in rows if r["op"] == "gather+hist")
    for r in rows:
        errors = [float(x) for x in re.findall(r"\d\.\de[+-]\d+", r["check"])]
        if r["dtype"] == "fp32":  # row adamw: the change of ~1 rows by ~1e-3, fp32-rounded
            assert errors and max(errors) < 1e-4, r
        elif r["op"] != "row adamw":  # bf16 row adamw: the interpreter truncates where the torch backend rounds
            assert errors and max(errors) < 1e-2, r
        assert r["kernel_ms"] > 0 and r["launches"] > 0 and r["floor_ms"] > 0
    layer = {f"{r['backend']}/{r['dtype']}": r for r in map(lambda row: row["result"],
                                                              final_rows(dry_run / "layer.jsonl").values())}
    assert set(layer) == set(gpu_layer.ITEMS)
    out_err, dx_err = map(float, re.findall(r"\d\.\de[+-]\d+", layer["triton/fp32"]["check"]))
    assert out_err < 1e-5 and dx_err < 1e-5


def _fake_worker(tmp_path: Path) -> Path:
    """A worker script: item "raise" raises, "die" kills its process, "hang" sleeps, "poison" reports a poisoned
    device; any other item returns {"item": name}. Each worker appends its pid to workers.txt."""
    script = tmp_path / "worker.py"
    script.write_text(f"""
import os, sys, time
sys.path.insert(0, {str(BENCH)!r})
import guarded

poisoned = []
guarded._device_usable = lambda device: not poisoned  # the device check a CUDA worker makes after a failure

def run_one(item):
    if item == "raise":
        raise ValueError("bad item")
    if item == "die":
        os.kill(os.getpid(), 9)
    if item == "hang":
        time.sleep(120)
    if item == "poison":
        poisoned.append(item)
        raise RuntimeError("device-side assert triggered")
    return {{"item": item}}

with open({str(tmp_path / 'workers.txt')!r}, "a") as f:
    f.write(f"{{os.getpid()}}\\n")
guarded.run_items(sys.argv[2:], run_one, sys.argv[1])
""")
    return script


def test_a_failing_item_costs_that_item_only(tmp_path):
    script, path = _fake_worker(tmp_path), tmp_path / "stage.jsonl"
    items = ["a", "raise", "die", "b", "poison", "c", "hang", "d"]
    rows = run_guarded(lambda left: [sys.executable, str(script), str(path), *left], items, path, tmp_path / "log",
                       item_timeout_s=3, deadline=time.monotonic() + 120)
    assert list(rows) == ["a", "raise", "die", "b", "poison", "c", "hang", "d"]
    assert {item: row["event"] for item, row in rows.items()} == {
        "a": "done", "raise": "failed", "die": "failed", "b": "done", "poison": "failed", "c": "done",
        "hang": "failed", "d": "done"}
    assert rows["raise"]["reason"] == "ValueError: bad item"
    assert rows["die"]["reason"].startswith("worker died (signal 9)")
    assert rows["poison"]["reason"] == "RuntimeError: device-side assert triggered"
    assert rows["hang"]["reason"] == "timed out after 3 s"
    # a fresh worker after the death, the poisoned device and the hang: four in all
    assert len((tmp_path / "workers.txt").read_text().split()) == 4
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_items_left_when_the_stage_runs_out_of_time_say_so(tmp_path):
    script, path = _fake_worker(tmp_path), tmp_path / "stage.jsonl"
    rows = run_guarded(lambda left: [sys.executable, str(script), str(path), *left], ["a", "hang", "b"], path,
                       tmp_path / "log", item_timeout_s=60, deadline=time.monotonic() + 4)
    assert rows["a"]["event"] == "done"
    assert rows["hang"]["reason"].startswith("timed out after") and "the stage's time ran out" in rows["hang"]["reason"]
    assert rows["b"]["reason"] == "not started: the stage's time ran out"


def test_workers_that_die_before_any_item_fail_the_stage_after_two(tmp_path):
    """No device or a broken import: the second worker in a row that dies before its first item fails every item
    left with its reason, instead of one worker per item."""
    starts = tmp_path / "starts"
    script = f"import sys; open({str(starts)!r}, 'a').write('x'); print('no CUDA device'); sys.exit(2)"
    rows = run_guarded(lambda left: [sys.executable, "-c", script], ["a", "b", "c", "d"], tmp_path / "stage.jsonl",
                       tmp_path / "log", item_timeout_s=30, deadline=time.monotonic() + 60)
    assert [row["reason"] for row in rows.values()] == ["worker died (exit status 2): no CUDA device"] * 4
    assert starts.read_text() == "xx"


def test_a_failed_stage_leaves_the_other_stages_and_a_summary_row(tmp_path, monkeypatch, capsys):
    """A stage whose workers die and one whose runner raises each get rows saying why; the stage before them keeps
    its file, and the summary lists both failures."""
    real = gpu_run.worker_command

    def worker_command(stage, dry_run, jsonl):
        if stage == "layer":
            return ["triton/bf16", "authors/bf16"], lambda left: [sys.executable, "-c",
                                                                  "import sys; print('boom'); sys.exit(5)"]
        if stage == "train_step":
            raise RuntimeError("no recipes")
        return real(stage, dry_run, jsonl)
    monkeypatch.setattr(gpu_run, "worker_command", worker_command)
    out = tmp_path / "out"
    assert gpu_run.main(["--out", str(out), "--dry-run", "--stages", "env", "layer", "train_step"]) == 1
    assert final_rows(out / "env.jsonl")["versions"]["event"] == "done"
    layer = final_rows(out / "layer.jsonl")
    assert [r["reason"] for r in layer.values()] == ["worker died (exit status 5): boom"] * 2
    (train,) = final_rows(out / "train_step.jsonl").values()
    assert train["reason"] == "the stage's runner raised RuntimeError: no recipes"
    summary = (out / "summary.md").read_text()
    assert "- layer / triton/bf16: failed: worker died (exit status 5): boom" in summary
    assert "- train_step / train_step: failed: the stage's runner raised RuntimeError: no recipes" in summary
    assert "| env | 1 | 0 | env.jsonl |" in summary and "| layer | 0 | 2 | layer.jsonl |" in summary
    assert "| triton | bf16 | - | - | - | - | - | failed: worker died (exit status 5): boom |" in summary
    assert "layer forward + backward, triton, bf16: not measured" in summary


def test_out_must_be_new_or_empty(tmp_path, capsys):
    (tmp_path / "old.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit) as exit_info:
        gpu_run.parse_args(["--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "gpu_run.py: error: --out" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.jsonl"]
