"""benchmarks/bench_scale.py: a row per size with the issue's targets beside them, its JSON, the bytes it counts, and
the model run's setup (tiny sizes; no timing is asserted)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_scale")


def test_tiny_sizes_print_a_row_each_and_the_targets(tmp_path):
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_scale.py"), "--sizes", "1024,256",
                           "--tokens", "64", "--rows", "32", "--warmup", "0", "--repeats", "1", "--pairs", "2",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 256 |") or line.startswith("| 1,024 |")]
    assert [row.split("|")[1].strip() for row in rows] == ["256", "1,024"]  # smallest first, the ratios' base
    assert all(" MiB (" in row.split("|")[16] and "rows)" in row.split("|")[16] for row in rows)  # a real patch
    assert all(" at " in row.split("|")[9] for row in rows)  # a floor per size
    assert "1,024 slots: step" in proc.stderr and "pair 2 of 2" in proc.stderr  # a line per size as it finishes
    report = json.loads(out.read_text())
    assert [r["slots"] for r in report["results"]] == [256, 1024]
    small, big = report["results"]
    assert set(big["phases_ms"]) == {"begin", "forward", "selection", "backward", "optimizer", "step"}
    assert small["pair_ratios"] == [] and len(big["pair_ratios"]) == len(big["cpu_pair_ratios"]) == 2
    assert set(big["cpu_phases_ms"]) == set(big["phases_ms"]) and big["cpu_phases_ms"]["step"] > 0
    for floor in (small["floor"], big["floor"], big["base_floor"]):  # FLOPs at the sgemm rate + rows at the probe's
        assert floor["ms"] > 0 and floor["gflops"] > 0 and floor["gbs"] > 0
        assert floor["ms"] == pytest.approx(floor["gflop"] / floor["gflops"] * 1e3 + floor["mb"] / floor["gbs"])
    assert big["floor"]["gflop"] > small["floor"]["gflop"]  # the sub-key scores grow with n_keys
    assert set(big["held_bytes"]) == {"layer", "background", "optimizer", "sinks"}
    assert big["held_total_bytes"] == sum(big["held_bytes"].values())
    assert big["peak_rss_gib"] > 0 and big["checkpoint_bytes"] > big["held_bytes"]["optimizer"]
    assert [t["target"].split()[0] for t in report["targets"]] == ["step", "the", "selection", "held", "first"]
    assert all(t["verdict"] in ("pass", "FAIL") for t in report["targets"])
    assert report["model"] == []
    assert small["huge_pages"] is False and big["huge_pages"] is False  # tables far below 512 MiB
    assert "value tables on transparent huge pages" in proc.stdout


def test_the_floor_ratio_adds_the_floors_extra_work_to_the_base_step(bench):
    big = dict(gflop=20.0, gflops=100.0, mb=500.0, gbs=10.0)  # 200 ms of FLOPs + 50 ms of rows
    slow_base = dict(gflop=10.0, gflops=50.0, mb=500.0, gbs=20.0)  # its sgemm measured at half the rate (load)
    result = dict(floor=big, base_floor=slow_base, base_cpu_step_ms=500.0)
    assert bench.floor_ratio(result) == pytest.approx((500.0 + 250.0 - (100.0 + 25.0)) / 500.0)  # at 100 GFLOP/s
    own = dict(floor=dict(slow_base, gflops=80.0, gbs=25.0))  # the base's own process read its table faster
    assert bench.floor_ratio(result, own) == pytest.approx((500.0 + 250.0 - (100.0 + 20.0)) / 500.0)
    assert bench.floor_ratio(dict(result, floor=None)) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_huge_pages_reach_the_children_and_the_layers(bench):
    args = bench.parse_args(["--huge-pages", "--tokens", "40", "--rows", "24"])
    assert "--huge-pages" in bench.common_options(args)
    assert "--no-huge-pages" in bench.common_options(bench.parse_args(["--no-huge-pages"]))
    assert not {"--huge-pages", "--no-huge-pages"} & set(bench.common_options(bench.parse_args([])))  # the default
    layer = bench.build_layer(400, args, seed=0)
    assert layer["memory"].huge_pages
    plain = bench.build_layer(400, bench.parse_args(["--tokens", "40", "--rows", "24"]), seed=0)
    assert torch.equal(layer["memory"].values, plain["memory"].values)


def test_held_bytes_count_each_storage_once(bench):
    args = bench.parse_args(["--tokens", "40", "--rows", "24"])
    layer = bench.build_layer(400, args, seed=0)
    bench.timed_step(layer)
    held = {}
    bench.timed_step(layer, held)
    memory = layer["memory"]
    tensors = list(memory.parameters()) + list(memory.buffers())
    assert held["layer"] == sum(t.numel() * t.element_size() for t in tensors)
    values = memory.values
    state = [t for entry in layer["optimizer"].state_dict()["state"].values() for t in entry.values()
             if isinstance(t, torch.Tensor)]
    assert held["optimizer"] == sum(t.untyped_storage().nbytes() for t in state) > 0
    assert held["background"] >= 2 * 400 * 4 and held["sinks"] >= 24 * values.shape[1] * 4
    assert bench.touched_bytes(layer) == 24 * (values.shape[1] * 12 + 8)
    assert bench.checkpoint_bytes(layer) > values.numel() * 4 + held["optimizer"]  # what it saves, and framing
    # a view of a counted tensor, held in a plain object's slots, counts nothing more
    alias = type("Alias", (), {"__slots__": ("rows",)})()
    alias.rows = values.detach()[:5]
    layer["optimizer"].state[values]["alias"] = [alias]
    again = {}
    bench.timed_step(layer, again)
    assert again == held
    alias.rows = torch.zeros(7, dtype=torch.float64)
    bench.timed_step(layer, again)
    assert again["optimizer"] == held["optimizer"] + 56  # a storage of its own, found through the slots


@pytest.mark.parametrize("bf16", [False, True])
def test_model_run_trains_only_values_and_alpha_of_additive_s_memories(bench, bf16):
    sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_train_step, which the model run steps with
    args = bench.parse_args(["--model-tiny", "--model-slots", "324", "--rows", "16"])
    model, setup, _ = bench.build_model_step(args, bf16)
    memories = setup.step.update.memories
    assert len(memories) == 3 and all(m.num_slots == 324 for m in memories.values())
    trained = {name.rsplit(".", 1)[-1] for name, p in model.named_parameters() if p.requires_grad}
    assert trained == {"values", "alpha"}  # mode additive+s
    assert all(m.values.dtype == (torch.bfloat16 if bf16 else torch.float32) for m in memories.values())


def test_bad_sizes_are_refused_in_one_line(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--sizes", "1000"])
    assert "each size must be n_keys ** 2 with n_keys >= 16 (top-16), got 1000" in capsys.readouterr().err


def test_model_run_reports_the_build_and_the_steps_peaks(bench, monkeypatch, one_thread):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    resets = []
    monkeypatch.setattr(bench, "reset_peak_rss", lambda: resets.append(True) or True)  # this process's mark stays
    args = bench.parse_args(["--model-tiny", "--model-slots", "324", "--rows", "16", "--model-tokens", "24"])
    run = bench.measure_model(args, bf16=False)
    assert resets == [True]  # once, between the build and the steps
    assert run["dtype"] == "fp32" and run["slots"] == 324 and run["rss_target_gib"] == 16
    assert run["build_peak_rss_gib"] > 0 and run["steps_peak_rss_gib"] > 0
    row = bench.format_model_table([run]).splitlines()[-1]
    assert row.startswith("| tiny fp32 | 324 | 24 |") and row.endswith("| <= 16 | pass |")


def test_a_process_that_fails_is_a_row_not_a_crash(bench, capfd):
    args = bench.parse_args(["--tokens", "16"])
    failed = bench.run_child(["--child", "layer", "--slots", "225", "--base", "225"], args, "225 slots")  # top-16 > 15
    assert failed == {"failed": "exit status 1"}
    assert "topk must be <= n_keys" in capfd.readouterr().err  # the child's own error, as it happened
    table = bench.format_table([dict(failed, slots=225)])
    assert "| 225 | failed: exit status 1 |" in table and len(table.splitlines()) == 3  # no size ran: no targets
    assert table.splitlines()[2].count("|") == table.splitlines()[0].count("|")
