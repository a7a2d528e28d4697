"""A table's placement (smf_kernels.sharded.placement): what the sparse step, clipping and RowSparseAdamW ask it
instead of asking how the table is laid out: its local gradient, the group its norm is summed over, how its rows'
gradient is averaged over the data-parallel ranks, and whether it holds whole rows (compact optimizer state)."""
import pytest
import torch
from torch import nn

from smf_kernels.sharded.layout import SHARD_ATTRIBUTE, ColumnShard
from smf_kernels.sharded.placement import ColumnSharded, MeshSharded, NormPart, Replicated, placement_of


def table(shard=None):
    param = nn.Parameter(torch.randn(7, 5, generator=torch.Generator().manual_seed(0)))
    if shard is not None:
        setattr(param, SHARD_ATTRIBUTE, shard)
    return param


class SumOver:
    """An all_reduce over ``ranks`` ranks that all hold the same tensor: it multiplies by ``ranks``."""

    def __init__(self, ranks):
        self.ranks, self.calls = ranks, 0

    def __call__(self, tensor):
        self.calls += 1
        tensor.mul_(self.ranks)


def test_a_plain_table_is_replicated_and_averaged_over_every_rank():
    placement = placement_of(table())
    assert isinstance(placement, Replicated) and placement.whole_rows and not placement.saved_apart
    assert placement.norm_part is None and placement.copies(3) == 3
    grad = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    reduce = SumOver(3)
    averaged = placement.average_rows(grad.clone(), 3, reduce)
    assert reduce.calls == 1 and torch.allclose(averaged, grad, rtol=1e-6)  # (3 x grad) / 3
    alone = SumOver(1)
    assert torch.equal(placement.average_rows(grad.clone(), 1, alone), grad) and alone.calls == 0


def test_a_split_table_divides_its_rows_gradient_by_its_group_and_reduces_nothing():
    group = object()
    shard = ColumnShard(5, 1, 2, (0, 3, 5), group)
    placement = placement_of(table(shard))
    assert placement == ColumnSharded(shard) and not placement.whole_rows and placement.saved_apart
    assert placement.norm_part == NormPart(group) and placement.copies(2) == 1
    grad = torch.randn(4, 2, generator=torch.Generator().manual_seed(2))
    reduce = SumOver(2)
    assert torch.equal(placement.average_rows(grad.clone(), 2, reduce), grad / 2) and reduce.calls == 0
    assert torch.equal(placement.average_copies(grad.clone(), 2, reduce), grad) and reduce.calls == 0
    with pytest.raises(ValueError, match="split over 2 ranks but gradients are averaged over 4"):
        placement.average_rows(grad.clone(), 4, reduce)


def test_a_shard_of_a_group_of_one_averages_as_a_replicated_table_but_is_saved_apart():
    placement = placement_of(table(ColumnShard(5, 0, 1, (0, 5))))
    assert placement.norm_part is None and placement.copies(3) == 3 and placement.saved_apart
    assert not placement.whole_rows  # RowSparseAdamW keeps the dense form of a sharded table's state
    grad = torch.randn(4, 5, generator=torch.Generator().manual_seed(3))
    reduce = SumOver(3)
    assert torch.allclose(placement.average_rows(grad.clone(), 3, reduce), grad, rtol=1e-6) and reduce.calls == 1


def test_an_fsdp_table_cannot_step_by_rows():
    placement = MeshSharded(mesh=None, placements=())
    assert not placement.whole_rows and placement.norm_part is None and placement.copies(4) == 1
    with pytest.raises(ValueError, match="keep the memories out of fully_shard"):
        placement.average_rows(torch.ones(2, 3), 2, SumOver(2))
