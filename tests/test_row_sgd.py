"""RowSparseSGD on its own: the dense step is torch.optim.SGD's, the row step moves only the valid selected rows
(bit-identical elsewhere), bad hyper-parameters and arguments are refused before anything moves. The step inside
the sparse update, against the float64 oracle: tests/test_sparse_exact.py; sharded: tests/test_sharded_memory.py."""
import math

import pytest
import torch

from smf_kernels.sparse import RowSparseSGD


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_dense_step_is_torch_sgd_bit_for_bit(weight_decay):
    torch.manual_seed(0)
    ours = torch.randn(3, 5, requires_grad=True)
    theirs = ours.detach().clone().requires_grad_(True)
    mine = RowSparseSGD([ours], lr=0.3, weight_decay=weight_decay)
    torch_sgd = torch.optim.SGD([theirs], lr=0.3, weight_decay=weight_decay, foreach=False)
    schedules = [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (step + 1)) for opt in (mine, torch_sgd)]
    for _ in range(3):
        grad = torch.randn(3, 5)
        for param, optimizer, schedule in zip((ours, theirs), (mine, torch_sgd), schedules):
            param.grad = grad.clone()
            optimizer.step()
            schedule.step()
        assert torch.equal(ours, theirs)
    assert not mine.state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_rows_moves_only_the_valid_selected_rows(dtype):
    torch.manual_seed(0)
    table = torch.nn.Parameter(torch.randn(8, 4).to(dtype))
    start = table.detach().clone()
    optimizer = RowSparseSGD([table], lr=0.5, weight_decay=0.2)
    rows, grad = torch.tensor([1, 4, 6]), torch.randn(3, 4)
    valid = torch.tensor([True, False, True])
    optimizer.step_rows(table, rows, grad, grad_scale=torch.tensor(0.5), valid=valid)
    wide = start.float()
    for t, row in enumerate(rows.tolist()):
        expected = (wide[row] - 0.5 * (0.5 * grad[t] + 0.2 * wide[row])).to(dtype) if valid[t] else start[row]
        assert torch.equal(table.detach()[row], expected), row
    untouched = [0, 2, 3, 5, 7]
    assert torch.equal(table.detach()[untouched], start[untouched])
    assert table.grad is None and not optimizer.state


@pytest.mark.parametrize("lr, weight_decay, message", [(-1e-3, 0.0, "lr must be a finite number >= 0"),
                                                       (math.nan, 0.0, "lr must be a finite number >= 0"),
                                                       (1e-3, math.inf, "weight_decay must be a finite")])
def test_bad_hyper_parameters_are_refused(lr, weight_decay, message):
    with pytest.raises(ValueError, match=message):
        RowSparseSGD([torch.nn.Parameter(torch.zeros(2, 2))], lr=lr, weight_decay=weight_decay)


def test_a_bad_rate_set_later_is_refused_before_anything_moves():
    """A scheduler or a user may write the groups' lr after construction: both steps check it first."""
    table, scale = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.ones(()))
    optimizer = RowSparseSGD([{"params": [scale]}, {"params": [table]}], lr=0.1)
    before = table.detach().clone()
    optimizer.param_groups[1]["lr"] = math.nan
    scale.grad = torch.ones(())
    with pytest.raises(ValueError, match="lr must be a finite number >= 0"):
        optimizer.step()
    assert scale.item() == 1.0  # the first group's good rate did not move it either
    with pytest.raises(ValueError, match="lr must be a finite number >= 0"):
        optimizer.step_rows(table, torch.tensor([0]), torch.ones(1, 3))
    assert torch.equal(table.detach(), before)
    with pytest.raises(TypeError, match="lr must be a real number"):
        RowSparseSGD([table], lr=True)


def test_bad_row_arguments_are_refused():
    table = torch.nn.Parameter(torch.zeros(4, 3))
    optimizer = RowSparseSGD([table], lr=0.1)
    with pytest.raises(ValueError, match="strictly ascending"):
        optimizer.step_rows(table, torch.tensor([2, 1]), torch.ones(2, 3))
    with pytest.raises(IndexError, match=r"rows must lie in \[0, 4\)"):
        optimizer.step_rows(table, torch.tensor([4]), torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"grad must have shape \(T, D\)"):
        optimizer.step_rows(table, torch.tensor([1]), torch.ones(2, 3))
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        optimizer.step_rows(torch.nn.Parameter(torch.zeros(4, 3)), torch.tensor([1]), torch.ones(1, 3))
    table.grad = torch.ones(4, 3).to_sparse()
    with pytest.raises(ValueError, match="through step_rows"):
        optimizer.step()
    assert not table.detach().any()


def test_the_state_of_the_other_row_optimizer_is_refused_on_load():
    """Resuming with the other --row-optimizer would silently change the optimizer (SGD ignoring AdamW's moments;
    AdamW starting fresh moments from SGD's groups, then failing on their missing betas)."""
    from smf_kernels.sparse import RowSparseAdamW

    table = torch.nn.Parameter(torch.randn(4, 3))
    adamw = RowSparseAdamW([table], lr=0.1)
    adamw.step_rows(table, torch.tensor([1]), torch.ones(1, 3))
    with pytest.raises(ValueError, match="saved by another optimizer .*exp_avg"):
        RowSparseSGD([table], lr=0.1).load_state_dict(adamw.state_dict())
    with pytest.raises(ValueError, match="lacks betas, eps: it was saved by another optimizer"):
        RowSparseAdamW([table], lr=0.1).load_state_dict(RowSparseSGD([table], lr=0.1).state_dict())
    sgd = RowSparseSGD([table], lr=0.5)
    sgd.load_state_dict(RowSparseSGD([table], lr=0.1).state_dict())  # its own state loads
    assert sgd.param_groups[0]["lr"] == 0.1


def test_a_tensor_rate_is_read_as_a_tensor_and_agrees_with_the_number(monkeypatch):
    """A learning rate and weight decay held in tensors (a scheduler's, on an accelerator) are used as tensors,
    never read back on the host (float() of them raises here, past the range checks, which read a CPU tensor and
    check an accelerator's on its device), moving the rows and a dense parameter as the same numbers do, to
    float32 rounding."""
    from smf_kernels.sparse import row_sparse_sgd

    class NoHostRead(torch.Tensor):
        def __float__(self):
            raise AssertionError("read on the host")

    results = []
    for as_tensor in (False, True):
        table = torch.nn.Parameter(torch.randn(9, 5, generator=torch.Generator().manual_seed(1)))
        scale = torch.nn.Parameter(torch.full((), 1.5))
        optimizer = RowSparseSGD([table, scale], lr=0.3, weight_decay=0.1)
        if as_tensor:  # after construction, as a capturable scheduler writes them
            optimizer.param_groups[0].update(lr=torch.tensor(0.3).as_subclass(NoHostRead),
                                             weight_decay=torch.tensor(0.1).as_subclass(NoHostRead))
            monkeypatch.setattr(row_sparse_sgd, "check_sgd_hyper_parameters", lambda lr, weight_decay: None)
        rows, grad = torch.tensor([0, 4, 7]), torch.randn(3, 5, generator=torch.Generator().manual_seed(2))
        optimizer.step_rows(table, rows, grad, grad_scale=torch.tensor(0.5), valid=torch.tensor([True, True, False]))
        scale.grad = torch.full((), 0.7)
        optimizer.step()
        results.append((table.detach().clone(), scale.detach().clone()))
    (table_number, scale_number), (table_tensor, scale_tensor) = results
    torch.testing.assert_close(table_tensor, table_number, rtol=2e-7, atol=0)
    torch.testing.assert_close(scale_tensor, scale_number, rtol=2e-7, atol=0)
    assert torch.equal(table_tensor[7], table_number[7])  # the padding row keeps its bits
