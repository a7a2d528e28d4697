"""benchmarks/gpu_check.py: its floors, the bf16 row_adamw check and backward-only timing. Its whole run (every op and
dtype at the tiny config, Triton interpreter on CPU) is tests/test_gpu_run.py's dry run, so that it cannot rot."""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def test_paper_floors_match_the_hand_numbers():
    fp32, bf16 = gpu_check.floors(gpu_check.PAPER, "fp32"), gpu_check.floors(gpu_check.PAPER, "bf16")
    # lookup: 2 * N * H * n_keys * key_dim = 4.29 GFLOP; bf16 is memory-bound at ~14 us, fp32 FMA ~64 us
    assert abs(fp32["lookup"][1] - 2 * 16384 * 4 * 128 * 256) == 0
    assert 13e-6 < bf16["lookup"][2] < 15e-6 and 63e-6 < fp32["lookup"][2] < 65e-6


def test_bf16_row_adamw_is_checked_against_the_torch_backend_on_the_same_state():
    """A bf16 table cannot hold one step's float64 change: the reference is the torch backend's bf16 step."""
    torch.manual_seed(0)
    inputs = gpu_check._inputs(gpu_check.TINY, torch.bfloat16, torch.device("cpu"))
    reference = gpu_check._reference("row adamw", inputs, gpu_check.TINY)
    torch_step = gpu_check._op_runner("row adamw", "torch", inputs, gpu_check.TINY)()
    assert all(torch.equal(a, b) for a, b in zip(reference, torch_step))
    assert reference[0].abs().sum() > 0  # some rows moved by a bf16 step
    check = gpu_check._check("row adamw", torch_step, reference, bf16_state=True)
    assert check == "vs torch: param equal 100.00%, step 0.0e+00, m 0.0e+00"
    changed = (torch_step[0] + 1e-2, torch_step[1])  # every element off: the check says so
    assert gpu_check._check("row adamw", changed, reference, bf16_state=True).startswith("vs torch: param equal 0.00%")


def test_backward_rows_time_the_backward_alone(monkeypatch):
    """The forward of a backward row runs once when its runner is built, never in the timed call."""
    import smf_kernels.ops

    forwards = []
    real = smf_kernels.ops.weighted_gather
    monkeypatch.setattr(smf_kernels.ops, "weighted_gather", lambda *a, **k: forwards.append(1) or real(*a, **k))
    torch.manual_seed(0)
    inputs = gpu_check._inputs(gpu_check.TINY, torch.float32, torch.device("cpu"))
    for op in ("dense bwd", "hot-row bwd", "sink bwd", "kept fill"):
        forwards.clear()
        run = gpu_check._op_runner(op, "torch", inputs, gpu_check.TINY)
        first = [g.clone() for g in run()]
        second = run()
        assert len(forwards) == 1, op
        if op != "sink bwd":  # the sink adds each backward into its rows' gradient
            assert all(torch.equal(a, b) for a, b in zip(first, second)), op
        else:
            assert torch.allclose(second[0], 2 * first[0]) and torch.equal(first[1], second[1])
