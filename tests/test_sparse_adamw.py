"""RowSparseAdamW against torch.optim.AdamW; the dense-masked leak; the sharded-aware clipping on one process."""
import copy

import pytest
import torch

from smf_kernels.sparse import RowSparseAdamW, clip_sharded_grad_norm_

HYPER = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


def rel_err(out, ref):
    return ((out - ref).norm() / ref.norm()).item()


def test_selected_rows_follow_adamw_on_just_those_rows_and_others_stay_bit_identical():
    table = torch.nn.Parameter(torch.randn(20, 7))
    rows = torch.tensor([3, 11, 17, 4])
    only_rows = torch.nn.Parameter(table.detach()[rows].clone())
    start = table.detach().clone()
    sparse_opt, dense_opt = RowSparseAdamW([table], **HYPER), torch.optim.AdamW([only_rows], **HYPER, foreach=False)
    for _ in range(6):
        grad_rows = torch.randn(4, 7)
        only_rows.grad = grad_rows.clone()
        order = rows.argsort()
        sparse_opt.step_rows(table, rows[order], grad_rows[order])
        dense_opt.step()
    assert rel_err(table.detach()[rows], only_rows.detach()) < 1e-6
    others = torch.ones(20, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(table.detach()[others], start[others])
    state = sparse_opt.row_state(table)  # dense-equivalent, whatever form holds it
    assert torch.equal(state["exp_avg"][others], torch.zeros(16, 7))
    assert state["row_step"].tolist() == [6 if r in (3, 4, 11, 17) else 0 for r in range(20)]
    assert sparse_opt.touched_rows(table).tolist() == [3, 4, 11, 17]


def test_each_row_has_its_own_step_count_and_lr_follows_the_scheduler():
    """A row updated in steps {1, 3, 4} is AdamW on that row's own 3 updates (bias correction 1, 2, 3)."""
    table = torch.nn.Parameter(torch.randn(10, 5))
    schedule = [[0, 2], [2], [0, 7], [0, 2, 7]]
    grads = [torch.randn(len(rows), 5) for rows in schedule]
    lr_factor = lambda step: 1.0 / (1 + step)  # noqa: E731
    optimizer = RowSparseAdamW([table], **HYPER)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    start = table.detach().clone()
    for rows, grad_rows in zip(schedule, grads):
        optimizer.step_rows(table, torch.tensor(rows), grad_rows)
        scheduler.step()
    for row in (0, 2, 7):
        single = torch.nn.Parameter(start[row].clone())
        reference = torch.optim.AdamW([single], **HYPER, foreach=False)
        for step, (rows, grad_rows) in enumerate(zip(schedule, grads)):
            if row in rows:
                for group in reference.param_groups:
                    group["lr"] = HYPER["lr"] * lr_factor(step)
                single.grad = grad_rows[rows.index(row)].clone()
                reference.step()
        assert rel_err(table.detach()[row], single.detach()) < 1e-6, row
    assert torch.equal(table.detach()[[1, 3, 4, 5, 6, 8, 9]], start[[1, 3, 4, 5, 6, 8, 9]])


def test_dense_parameters_match_torch_adamw_exactly():
    scale, reference_scale = torch.nn.Parameter(torch.tensor([0.01])), torch.nn.Parameter(torch.tensor([0.01]))
    matrix = torch.nn.Parameter(torch.randn(4, 3))
    reference_matrix = torch.nn.Parameter(matrix.detach().clone())
    ours = RowSparseAdamW([scale, matrix], **HYPER)
    theirs = torch.optim.AdamW([reference_scale, reference_matrix], **HYPER, foreach=False)
    for _ in range(5):
        for a, b in ((scale, reference_scale), (matrix, reference_matrix)):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        ours.step()
        theirs.step()
    assert torch.equal(scale, reference_scale) and torch.equal(matrix, reference_matrix)


def test_state_dict_resume_continues_identically():
    table = torch.nn.Parameter(torch.randn(12, 4))
    grads = [(torch.randint(0, 12, (5,)).unique(), None) for _ in range(4)]
    grads = [(rows, torch.randn(rows.numel(), 4)) for rows, _ in grads]

    def run(optimizer, param, steps):
        for rows, grad_rows in steps:
            optimizer.step_rows(param, rows, grad_rows)

    optimizer = RowSparseAdamW([table], **HYPER)
    run(optimizer, table, grads[:2])
    resumed_table = torch.nn.Parameter(table.detach().clone())
    resumed = RowSparseAdamW([resumed_table], **HYPER)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # as if read back from a file
    assert resumed.state[resumed_table]["slot_step"].dtype == torch.int64
    run(optimizer, table, grads[2:])
    run(resumed, resumed_table, grads[2:])
    assert torch.equal(table, resumed_table)


def test_row_step_counts_of_a_bf16_table_survive_a_state_dict_round_trip():
    table = torch.nn.Parameter(torch.randn(4, 3).bfloat16())
    optimizer = RowSparseAdamW([table], lr=1e-3)
    for _ in range(301):  # beyond 256, the largest integer bf16 holds exactly in a run of them
        optimizer.step_rows(table, torch.tensor([1]), torch.randn(1, 3))
    resumed = RowSparseAdamW([table], lr=1e-3)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    row_step = resumed.row_state(table)["row_step"]
    assert resumed.state[table]["slot_step"].dtype == torch.int64 and row_step.tolist() == [0, 301, 0, 0]


@pytest.mark.parametrize("form", ["compact", "dense"])
def test_state_dicts_load_through_torch_distributed_checkpoint_after_init_state(form):
    """set_optimizer_state_dict (accelerate's FSDP2 resume) fills an optimizer without state by a dense zero-gradient
    step, then merges the saved state in: a table would hold both row_step and step. A sharded load reads only the
    entries the optimizer already has. init_state first gives every parameter the entries the saved state holds."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    full = StateDictOptions(full_state_dict=True)
    model = torch.nn.ModuleDict({"table": torch.nn.Embedding(6, 3), "scale": torch.nn.Linear(1, 1, bias=False)})
    table, scale = model["table"].weight, model["scale"].weight

    def optimizer():
        return RowSparseAdamW(model.parameters(), **HYPER, state=form)

    trained = optimizer()
    trained.step_rows(table, torch.tensor([1, 4]), torch.randn(2, 3))
    scale.grad = torch.randn(1, 1)
    trained.step()
    scale.grad = None
    saved = get_optimizer_state_dict(model, trained, options=full)
    # without init_state, the table's saved row state meets the dense zero step's step
    with pytest.raises(ValueError, match=f"holds both {'row_step' if form == 'dense' else 'held_rows'} and step"):
        set_optimizer_state_dict(model, optimizer(), saved, options=full)
    resumed = optimizer()
    resumed.init_state([table])
    assert set(get_optimizer_state_dict(model, resumed)["state"]) == {"table.weight", "scale.weight"}  # a template
    set_optimizer_state_dict(model, resumed, saved, options=full)
    for param in (table, scale):
        for key, value in trained.state[param].items():
            assert torch.equal(torch.as_tensor(resumed.state[param][key]), torch.as_tensor(value)), key
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        optimizer().init_state([torch.nn.Parameter(torch.zeros(6, 3))])
    with pytest.raises(ValueError, match="row update's state but is not in row_params"):
        resumed.init_state([])


def _state_after_one_step(table, dense):
    optimizer = RowSparseAdamW([table], lr=1e-3, state="dense")  # the compact form: test_compact_optimizer_state
    if dense:
        table.grad = torch.randn(table.shape)
        optimizer.step()
    else:
        optimizer.step_rows(table, torch.tensor([1, 3]), torch.randn(2, 3))
    return copy.deepcopy(optimizer.state_dict())


@pytest.mark.parametrize("change, message", [
    (lambda state: state.update(exp_avg=torch.zeros(6, 3)), r"exp_avg .* \(6, 3\) .* \(4, 3\)"),
    (lambda state: state.update(exp_avg_sq=torch.zeros(4)), r"exp_avg_sq .* \(4,\) .* \(4, 3\)"),
    (lambda state: state.update(row_step=torch.zeros(5, dtype=torch.int64)), r"row_step .* \(5,\) .* \(4,\)"),
    (lambda state: state.pop("exp_avg"), "lacks exp_avg"),
    (lambda state: state.update(row_step=torch.tensor([0, 1, -1, 1])), "row_step .* negative"),
    (lambda state: state.update(exp_avg_sq=-torch.ones(4, 3)), "exp_avg_sq .* negative"),
    (lambda state: state.update(exp_avg=[1.0]), "exp_avg .* list"),
])
def test_load_state_dict_refuses_state_of_another_shape_before_changing_anything(change, message):
    table = torch.nn.Parameter(torch.randn(4, 3))
    saved = _state_after_one_step(table, dense=False)
    change(saved["state"][0])
    fresh = RowSparseAdamW([table], lr=1e-3, state="dense")
    with pytest.raises(ValueError, match="parameter 0 of group 0.*" + message):
        fresh.load_state_dict(saved)
    assert not fresh.state  # nothing was loaded


def test_load_state_dict_refuses_dense_state_of_another_shape():
    table = torch.nn.Parameter(torch.randn(4, 3))
    saved = _state_after_one_step(table, dense=True)
    saved["state"][0]["exp_avg"] = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"exp_avg .* \(3, 4\)"):
        RowSparseAdamW([table], lr=1e-3).load_state_dict(saved)
    saved["state"][0]["exp_avg"], saved["state"][0]["step"] = torch.zeros(4, 3), torch.tensor(-2.0)
    with pytest.raises(ValueError, match="step .* negative"):
        RowSparseAdamW([table], lr=1e-3).load_state_dict(saved)


def test_dense_masked_adamw_leaks_into_unselected_rows_row_sparse_does_not():
    """Rows selected in step 1 only: masked-gradient AdamW keeps moving them afterwards
    (docs/method.md#what-sparse-means)."""
    start = torch.randn(16, 6)
    masked, lazy = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    masked_opt, lazy_opt = torch.optim.AdamW([masked], **HYPER), RowSparseAdamW([lazy], **HYPER)
    first, later = torch.tensor([1, 5, 9]), torch.tensor([2, 12])
    for step in range(8):
        rows = first if step == 0 else later
        full_grad = torch.randn(16, 6)
        keep = torch.zeros(16, 1)
        keep[rows] = 1.0
        masked.grad = full_grad * keep  # the dense-masked update's gradient
        masked_opt.step()
        lazy_opt.step_rows(lazy, rows, full_grad[rows])
        if step == 0:
            after_first_masked, after_first_lazy = masked.detach().clone(), lazy.detach().clone()
    assert torch.equal(lazy.detach()[first], after_first_lazy[first])
    assert torch.equal(lazy.detach()[[0, 3, 15]], start[[0, 3, 15]])
    leak = (masked.detach()[first] - after_first_masked[first]).abs().max()
    assert leak > 1e-3, "dense-masked AdamW should keep moving rows selected only earlier"
    assert not torch.equal(masked.detach()[[0, 3, 15]], start[[0, 3, 15]])  # weight decay touches every row


def test_clip_sharded_grad_norm_on_unsharded_parameters_is_torchs_clip():
    table, bias = torch.nn.Parameter(torch.randn(9, 4)), torch.nn.Parameter(torch.randn(4))
    table.grad, bias.grad = torch.randn(9, 4), torch.randn(4)
    dense_table, dense_bias = torch.nn.Parameter(table.detach().clone()), torch.nn.Parameter(bias.detach().clone())
    dense_table.grad, dense_bias.grad = table.grad.clone(), bias.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_([dense_table, dense_bias], 0.5)
    total = clip_sharded_grad_norm_([table, bias], 0.5)
    assert abs(total.item() - expected.item()) < 1e-5 * expected.item()
    assert rel_err(table.grad, dense_table.grad) < 1e-6 and rel_err(bias.grad, dense_bias.grad) < 1e-6
    with pytest.raises(ValueError, match="max_norm"):
        clip_sharded_grad_norm_([table], 0.0)
    table.grad = table.grad.to_sparse()
    with pytest.raises(ValueError, match="dense gradients; a sparse .grad"):
        clip_sharded_grad_norm_([table], 0.5)


def test_clip_sharded_grad_norm_of_float64_gradients_is_float64():
    """fp64 gradients keep fp64 in the norm (as torch's clip_grad_norm_ does); bf16 ones still sum in fp32."""
    table, bias = torch.nn.Parameter(torch.randn(9, 4, dtype=torch.float64)), torch.nn.Parameter(torch.randn(4))
    table.grad, bias.grad = torch.randn(9, 4, dtype=torch.float64) / 3, torch.randn(4)
    want = torch.cat([table.grad.flatten(), bias.grad.double()]).norm()
    total = clip_sharded_grad_norm_([table, bias], 0.5)
    assert total.dtype == torch.float64
    assert abs(total.item() - want.item()) < 1e-15 * want.item()
    assert abs(torch.cat([table.grad.flatten(), bias.grad.double()]).norm().item() - 0.5) < 1e-6


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="betas"):
        RowSparseAdamW([torch.nn.Parameter(torch.randn(2, 2))], betas=(1.0, 0.9))
    for name in ("lr", "eps", "weight_decay"):  # finite: an inf lr made every row NaN at its first step
        for value in (float("inf"), float("nan"), -1.0):
            with pytest.raises(ValueError, match=f"{name} must be a finite number >= 0"):
                RowSparseAdamW([torch.nn.Parameter(torch.randn(2, 2))], **{name: value})
    vector = torch.nn.Parameter(torch.randn(5))
    with pytest.raises(ValueError, match=r"must be 2-D \(M, D\)"):
        RowSparseAdamW([vector]).step_rows(vector, torch.tensor([1]), torch.ones(1, 1))
    table, scale = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.ones(1))
    table.grad, scale.grad = torch.randn(4, 3).to_sparse(), torch.ones(1)
    with pytest.raises(ValueError, match="through step_rows\\(\\), not a sparse .grad"):
        RowSparseAdamW([scale, table]).step()
    assert torch.equal(scale, torch.ones(1))  # refused before anything moved
