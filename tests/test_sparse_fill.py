"""plan_fill, the one place that decides how a sparse step fills its rows' gradient (smf train, sharded memories
included, and SparseMemoryTrainer follow it)."""
import pytest

from smf_kernels.sparse.fill import KEPT_READS_PER_SLOT, Fill, plan_fill


@pytest.mark.parametrize("micro_batches, compiled, step_tokens, expected", [
    (1, False, None, Fill(rows_first=True, select_after_forward=True)),  # select between forward and backward
    (1, True, None, Fill(rows_first=True)),  # the compiled backward chooses the rows itself
    (3, False, None, Fill(rows_first=False)),  # reads kept: no second forward
    (3, False, 256 * KEPT_READS_PER_SLOT, Fill(rows_first=False)),  # as many tokens as slots: still kept
    (3, False, 256 * KEPT_READS_PER_SLOT + 1, Fill(rows_first=True, counting_forward=True)),  # more: count first
    (3, True, None, Fill(rows_first=True, counting_forward=True)),
])
def test_each_situation_has_one_fill(micro_batches, compiled, step_tokens, expected):
    assert plan_fill(micro_batches, compiled=compiled, world=1, step_tokens=step_tokens, slots=256) == expected
    assert plan_fill(micro_batches, compiled=False, world=4, step_tokens=step_tokens, slots=256).rows_first == (
        micro_batches == 1 or (step_tokens or 0) > 256 * KEPT_READS_PER_SLOT)


def test_what_cannot_be_planned_is_refused():
    with pytest.raises(ValueError, match="a compiled sparse step runs in one process"):
        plan_fill(1, compiled=True, world=2)
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        plan_fill(0, compiled=False, world=1)
