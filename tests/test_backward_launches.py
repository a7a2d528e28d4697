"""benchmarks/backward_launches.py: the triton backward ops launch what RESULTS.md says (issue 49, item 3).

Each weighted_gather backward: three Triton kernels (read keys, plan items, row pass) and four ATen ops with
device work (the one fill of counts, tickets and flag; the one sort; the flag's check); none of the cumsum,
argsort or slot-map ops it made before.
"""
import sys
from pathlib import Path

import pytest

from helpers import backends_under_test

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import backward_launches  # noqa: E402

pytestmark = pytest.mark.skipif("triton" not in backends_under_test(), reason="the triton backend cannot run here")


def test_each_gather_backward_is_three_kernels_and_four_aten_launches():
    cases = backward_launches._cases()
    for name in ("weighted_gather backward (dense)", "weighted_gather backward (T rows)",
                 "weighted_gather backward (T rows, no dW)", "weighted_gather backward into a sink (T rows)"):
        entry, args = cases[name]
        got = backward_launches.count(entry, args)
        assert got["triton"] == ["read_keys_kernel", "plan_items_kernel", "row_backward_kernel"], name
        assert sorted(got["aten"]) == ["_assert_async", "eq", "sort", "zeros"], (name, got["aten"])


def test_recorder_keeps_ops_with_device_work_and_drops_views():
    import torch

    def entry(x):
        return (x.cumsum(0) + 1).view(-1)

    got = backward_launches.count(entry, (torch.arange(6),))
    assert got == {"triton": [], "aten": ["cumsum", "add"]}
