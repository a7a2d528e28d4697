"""benchmarks/gpu_check.py runs end to end (tiny config, Triton interpreter on CPU) so it cannot rot."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def test_tiny_run_checks_every_op_against_the_reference(tmp_path):
    out = tmp_path / "check.md"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--tiny", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 2 * len(gpu_check.OPS)
    assert all("slots = ref 100.00%" in r for r in rows if r.startswith("| lookup"))
    assert all("counts exact True" in r for r in rows if r.startswith("| gather+hist"))


def test_paper_floors_match_the_hand_numbers():
    fp32, bf16 = gpu_check.floors(gpu_check.PAPER, "fp32"), gpu_check.floors(gpu_check.PAPER, "bf16")
    # lookup: 2 * N * H * n_keys * key_dim = 4.29 GFLOP; bf16 is memory-bound at ~14 us, fp32 FMA ~64 us
    assert abs(fp32["lookup"][1] - 2 * 16384 * 4 * 128 * 256) == 0
    assert 13e-6 < bf16["lookup"][2] < 15e-6 and 63e-6 < fp32["lookup"][2] < 65e-6
