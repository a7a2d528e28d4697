"""plan_fill, the one place that decides how a sparse step fills its rows' gradient (smf train, sharded memories
included, and SparseMemoryTrainer follow it, through MemoryStep.plan)."""
import pytest
from torch import nn

from smf_kernels import ProductKeyMemory
from smf_kernels.sparse import DenseMaskedUpdate, FillPlan, SparseMemoryController, plan_fill
from smf_kernels.sparse.fill_plan import KEPT_READS_PER_SLOT


@pytest.mark.parametrize("micro_batches, compiled, step_tokens, expected", [
    (1, False, None, FillPlan("rows_first", select_after_forward=True)),  # select between forward and backward
    (1, True, None, FillPlan("rows_first")),  # the compiled backward chooses the rows itself
    (3, False, None, FillPlan("reads_kept")),  # reads kept: no second forward
    (3, False, 256 * KEPT_READS_PER_SLOT, FillPlan("reads_kept")),  # as many tokens as slots: still kept
    (3, False, 256 * KEPT_READS_PER_SLOT + 1, FillPlan("rows_first", counting_forward=True)),  # more: count first
    (3, True, None, FillPlan("rows_first", counting_forward=True)),
])
def test_each_situation_has_one_fill(micro_batches, compiled, step_tokens, expected):
    assert plan_fill(micro_batches, compiled=compiled, world=1, step_tokens=step_tokens, slots=256) == expected
    assert (plan_fill(micro_batches, compiled=False, world=4, step_tokens=step_tokens, slots=256).fill == "rows_first"
            ) == (micro_batches == 1 or (step_tokens or 0) > 256 * KEPT_READS_PER_SLOT)


def test_a_step_plans_with_its_smallest_memory_and_an_ablation_keeps_reads():
    model = nn.ModuleDict({"a": ProductKeyMemory(8, n_keys=16, heads=1, topk=2, key_dim=4),
                           "b": ProductKeyMemory(8, n_keys=4, heads=1, topk=2, key_dim=4)})
    exact, masked = SparseMemoryController(model, rows_per_step=4), DenseMaskedUpdate(model, rows_per_step=4)
    assert exact.plan(2, step_tokens=16) == FillPlan("reads_kept")
    assert exact.plan(2, step_tokens=17) == FillPlan("rows_first", counting_forward=True)  # b has 16 slots
    assert masked.plan(1) == masked.plan(2, step_tokens=10 ** 6) == FillPlan("reads_kept")


def test_what_cannot_be_planned_is_refused():
    with pytest.raises(ValueError, match="a compiled sparse step runs in one process"):
        plan_fill(1, compiled=True, world=2)
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        plan_fill(0, compiled=False, world=1)
