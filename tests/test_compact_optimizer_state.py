"""RowSparseAdamW's compact state (moments only for the rows it has updated, by slot) against the dense form (state
for every row): the same bits over many steps on every backend; state_dict round trips and conversions between the
forms; malformed states refused with nothing loaded; touched_rows; row_adamw_'s state_slots checked."""
import copy

import pytest
import torch

from smf_kernels.backends import unavailable_reason
from smf_kernels.ops import row_adamw_
from smf_kernels.sparse import RowSparseAdamW
from smf_kernels.sparse.compact_row_state import slot_capacity

DEVICE = torch.get_default_device()
BACKENDS = [b for b in ("torch", "ext", "triton") if unavailable_reason(b, DEVICE) is None]
HYPER = dict(lr=2e-2, betas=(0.85, 0.97), eps=1e-6, weight_decay=0.05)
STATE_KEYS = ("exp_avg", "exp_avg_sq", "row_step")


def schedule(num_rows, dim, steps, per_step, dtype, seed=0):
    """Steps of (rows ascending, grad, valid, grad_scale, lr): half of each step's rows come back every step,
    the rest are new draws; every other step masks a quarter of its rows; the lr changes every step (a tensor on
    every third)."""
    gen = torch.Generator().manual_seed(seed)
    hot = torch.randperm(num_rows, generator=gen)[:per_step // 2]
    grad_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    plan = []
    for step in range(steps):
        rows = torch.cat([hot, torch.randint(0, num_rows, (per_step,), generator=gen)]).unique()[:per_step]
        grad = torch.randn(rows.numel(), dim, generator=gen, dtype=grad_dtype)
        valid = torch.rand(rows.numel(), generator=gen) > 0.25 if step % 2 else None
        scale = torch.tensor(0.3 + 0.2 * step) if step % 3 != 1 else None
        lr = HYPER["lr"] / (1 + step)
        plan.append((rows, grad, valid, scale, torch.tensor(lr) if step % 3 == 2 else lr))
    return plan


def run(optimizer, param, plan):
    for rows, grad, valid, scale, lr in plan:
        optimizer.param_groups[0]["lr"] = lr
        optimizer.step_rows(param, rows, grad, grad_scale=scale, valid=valid)


def assert_same_state(compact, compact_param, dense, dense_param):
    assert torch.equal(compact_param, dense_param)
    got, want = compact.row_state(compact_param), dense.row_state(dense_param)
    for key in STATE_KEYS:
        assert torch.equal(got[key], want[key]), key
    assert torch.equal(compact.touched_rows(compact_param), dense.touched_rows(dense_param))


def pair(num_rows, dim, dtype, seed=1):
    start = torch.randn(num_rows, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
    compact_param, dense_param = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    return (RowSparseAdamW([compact_param], **HYPER), compact_param,
            RowSparseAdamW([dense_param], **HYPER, state="dense"), dense_param)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_compact_state_gives_the_dense_forms_bits_step_after_step(backend, dtype, monkeypatch):
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the triton backend takes no float64")
    monkeypatch.setenv("SMF_KERNELS_BACKEND", backend)
    # the Triton interpreter runs a program per row slowly: smaller shapes there
    num_rows, dim, steps, per_step = (1000, 96, 8, 40) if backend != "triton" else (300, 40, 5, 12)
    compact, compact_param, dense, dense_param = pair(num_rows, dim, dtype)
    plan = schedule(num_rows, dim, steps, per_step, dtype)
    for step in range(steps):  # equal after every step, not only at the end
        run(compact, compact_param, plan[step:step + 1])
        run(dense, dense_param, plan[step:step + 1])
        assert_same_state(compact, compact_param, dense, dense_param)
    touched = compact.touched_rows(compact_param)
    updated = torch.cat([rows if valid is None else rows[valid] for rows, _, valid, _, _ in plan]).unique()
    assert torch.equal(touched, updated)  # a row valid left alone has no state
    state = compact.state[compact_param]
    assert torch.equal(state["held_rows"], touched) and state["held_slots"].sort()[0].tolist() == list(
        range(touched.numel()))
    assert touched.numel() < num_rows // 2 and state["exp_avg"].shape[0] <= slot_capacity(touched.numel() + per_step,
                                                                                           num_rows)


def test_storage_grows_with_the_rows_updated_in_small_chunks():
    param = torch.nn.Parameter(torch.randn(20_000, 8))
    optimizer = RowSparseAdamW([param], lr=1e-3)
    optimizer.step_rows(param, torch.arange(0, 1024, 2), torch.randn(512, 8))
    state = optimizer.state[param]
    assert state["held_rows"].shape == (512,) and state["exp_avg"].shape == (544, 8)  # 512 + 512 / 16
    assert sum(t.numel() * t.element_size() for t in state.values()) == 512 * 16 + 544 * (8 + 2 * 8 * 4)  # no (M,)
    optimizer.step_rows(param, torch.arange(0, 1024, 2), torch.randn(512, 8))  # the same rows: no growth
    assert state["exp_avg"].shape == (544, 8) and state["held_rows"].shape == (512,)
    optimizer.step_rows(param, torch.arange(1, 101, 2), torch.randn(50, 8))
    assert state["held_rows"].shape == (562,) and state["exp_avg"].shape[0] == slot_capacity(562, 20_000) == 598
    assert torch.equal(state["held_rows"], torch.cat([torch.arange(0, 100), torch.arange(100, 1024, 2)]))
    assert slot_capacity(3, 20_000) == 35 and slot_capacity(20_000, 20_000) == 20_000


@pytest.mark.parametrize("saved_form, loaded_form", [("compact", "compact"), ("dense", "compact"),
                                                      ("compact", "dense"), ("dense", "dense")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_state_dict_of_either_form_loads_into_either_and_continues_bit_identically(saved_form, loaded_form,
                                                                                    dtype):
    """A dense state (what the optimizer saved before the compact form existed) becomes compact and back. bf16: the
    slot map and the counts keep their values past 256 (the base class casts state to the table's dtype)."""
    num_rows, dim = 700, 24
    plan = schedule(num_rows, dim, 6, 300, dtype)
    start = torch.randn(num_rows, dim).to(dtype)
    original = torch.nn.Parameter(start.clone())
    optimizer = RowSparseAdamW([original], **HYPER, state=saved_form)
    run(optimizer, original, plan[:3])
    saved = copy.deepcopy(optimizer.state_dict())  # as if read back from a file
    resumed_param = torch.nn.Parameter(original.detach().clone())
    resumed = RowSparseAdamW([resumed_param], **HYPER, state=loaded_form)
    resumed.load_state_dict(saved)
    held = resumed.state[resumed_param]
    assert ("held_rows" in held) == (loaded_form == "compact") and ("row_step" in held) == (loaded_form == "dense")
    assert all(value.dtype == torch.int64 for key, value in held.items()
               if key in ("held_rows", "held_slots", "slot_step", "row_step"))
    assert_same_state(resumed, resumed_param, optimizer, original)
    run(optimizer, original, plan[3:])
    run(resumed, resumed_param, plan[3:])
    assert_same_state(resumed, resumed_param, optimizer, original)


def _compact_state_dict():
    table = torch.nn.Parameter(torch.randn(9, 4))
    optimizer = RowSparseAdamW([table], lr=1e-3)
    optimizer.step_rows(table, torch.tensor([1, 4, 6]), torch.randn(3, 4))
    return table, copy.deepcopy(optimizer.state_dict())


def _set(key, make):
    return lambda state: state.update({key: make(state)})


@pytest.mark.parametrize("change, message", [
    (lambda state: state.pop("slot_step"), "lacks slot_step"),
    (_set("held_rows", lambda s: s["held_rows"].int()), "held_rows must be a 1-D int64 tensor"),
    (_set("held_rows", lambda s: s["held_rows"][:2]), "one entry per row with state"),
    (_set("held_rows", lambda s: s["held_rows"].flip(0)), r"held_rows must be strictly ascending rows in \[0, 9\)"),
    (_set("held_rows", lambda s: s["held_rows"] + 5), r"held_rows must be strictly ascending rows in \[0, 9\)"),
    (_set("held_slots", lambda s: s["held_slots"].index_fill(0, torch.tensor([0]), 1)), "slots 0..2"),
    (_set("held_slots", lambda s: s["held_slots"] + 1), "slots 0..2"),
    (_set("held_slots", lambda s: [0, 1, 2]), "held_slots must be a tensor, got list"),
    (_set("slot_step", lambda s: s["slot_step"][:2]), r"one entry per row with state \(K <= C = 2 slots\)"),
    (_set("slot_step", lambda s: s["slot_step"].float()), "slot_step must be a 1-D int64"),
    (_set("slot_step", lambda s: s["slot_step"].index_fill(0, torch.tensor([1]), -1)), "slot_step holds negative"),
    (_set("exp_avg", lambda s: s["exp_avg"][:, :3]), r"exp_avg must be a floating tensor of shape \(9, 4\)"),
    (_set("exp_avg_sq", lambda s: -s["exp_avg_sq"] - 1), "exp_avg_sq holds negative"),
    (_set("exp_avg", lambda s: s["exp_avg"].index_fill(0, torch.tensor([3]), 1.0)), "exp_avg is not zero past"),
    (_set("row_step", lambda s: torch.zeros(9, dtype=torch.int64)), "holds both held_rows and row_step"),
])
def test_a_malformed_compact_state_is_refused_before_anything_loads(change, message):
    table, saved = _compact_state_dict()
    change(saved["state"][0])
    fresh = RowSparseAdamW([table], lr=1e-3)
    with pytest.raises(ValueError, match="parameter 0 of group 0.*" + message):
        fresh.load_state_dict(saved)
    assert not fresh.state  # nothing was loaded


def test_touched_rows_in_each_form():
    table, dense_table = torch.nn.Parameter(torch.randn(12, 5)), torch.nn.Parameter(torch.randn(12, 5))
    scale = torch.nn.Parameter(torch.ones(1))
    optimizer = RowSparseAdamW([table, scale], lr=1e-3)
    dense = RowSparseAdamW([dense_table], lr=1e-3, state="dense")
    for opt, param in ((optimizer, table), (dense, dense_table)):
        assert opt.touched_rows(param).tolist() == []  # no state yet
        opt.step_rows(param, torch.tensor([2, 7, 9]), torch.randn(3, 5), valid=torch.tensor([True, False, True]))
        opt.step_rows(param, torch.tensor([0, 9]), torch.randn(2, 5))
        touched = opt.touched_rows(param)
        assert touched.dtype == torch.int64 and touched.tolist() == [0, 2, 9]
        assert opt.row_state(param, torch.tensor([9, 7]))["row_step"].tolist() == [2, 0]
    scale.grad = torch.ones(1)
    optimizer.step()
    with pytest.raises(ValueError, match="dense gradients"):
        optimizer.touched_rows(scale)
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        optimizer.touched_rows(dense_table)


def test_the_form_is_checked_and_survives_a_copy():
    table = torch.nn.Parameter(torch.randn(4, 3))
    with pytest.raises(ValueError, match="state must be one of"):
        RowSparseAdamW([table], state="sparse")
    assert copy.deepcopy(RowSparseAdamW([table], state="dense")).state_form == "dense"


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_adamw_checks_state_slots_before_a_row_moves(backend):
    param, grad, rows = torch.randn(10, 6), torch.randn(3, 6), torch.tensor([1, 4, 8])
    exp_avg, exp_avg_sq, slot_step = torch.randn(5, 6), torch.rand(5, 6), torch.randint(0, 3, (5,))
    before = [t.clone() for t in (param, exp_avg, exp_avg_sq, slot_step)]
    cases = [(torch.tensor([0, 5, 2]), IndexError, r"state_slots must lie in \[0, 5\)"),
             (torch.tensor([0, 3, 0]), ValueError, "state_slots .*distinct"),
             (torch.tensor([0, 1]), ValueError, r"state_slots must have shape \(T,\) = \(3,\)"),
             (torch.tensor([0, 1, 2], dtype=torch.int32), (TypeError, ValueError), "state_slots")]
    for slots, error, message in cases:
        with pytest.raises(error, match=message):
            row_adamw_(param, exp_avg, exp_avg_sq, slot_step, rows, grad, **HYPER, state_slots=slots,
                       backend=backend)
    with pytest.raises(ValueError, match=r"exp_avg must have shape \(S, D\) = \(5, 6\)"):
        row_adamw_(param, exp_avg[:, :4], exp_avg_sq, slot_step, rows, grad, **HYPER,
                   state_slots=torch.tensor([0, 1, 2]), backend=backend)
    assert all(torch.equal(a, b) for a, b in zip((param, exp_avg, exp_avg_sq, slot_step), before))
    row_adamw_(param, exp_avg, exp_avg_sq, slot_step, rows, grad, **HYPER, state_slots=torch.tensor([4, 0, 2]),
               backend=backend)
    assert torch.equal(slot_step - before[3], torch.tensor([1, 0, 1, 0, 1]))  # the slots moved, not the rows
    assert torch.equal(exp_avg[[1, 3]], before[1][[1, 3]])


@pytest.mark.skipif("ext" not in BACKENDS, reason="the compiled extension is not built")
def test_the_extension_checks_state_slots_itself():
    """The extension never trusts its inputs: called directly (no op checks first), it refuses slots out of range
    or repeated (threads own slots) before a row moves."""
    from smf_kernels.backends.ext_impl import _ext
    param, grad, rows = torch.randn(10, 6), torch.randn(3, 6), torch.tensor([1, 4, 8])
    exp_avg, exp_avg_sq, slot_step = torch.randn(5, 6), torch.rand(5, 6), torch.zeros(5, dtype=torch.int64)
    before = [t.clone() for t in (param, exp_avg, exp_avg_sq, slot_step)]
    for slots, message in ((torch.tensor([0, 5, 2]), r"state_slots must lie in \[0, 5\)"),
                           (torch.tensor([-1, 3, 2]), r"state_slots must lie in \[0, 5\)"),
                           (torch.tensor([2, 3, 2]), "state_slots must be distinct"),
                           (torch.tensor([0, 1]), r"state_slots must have shape \(T,\) = \(3\)")):
        with pytest.raises(RuntimeError, match=message):
            _ext.row_adamw(param, exp_avg, exp_avg_sq, slot_step, rows, grad, None, 0.01, 1.0, 0.9, 0.99, 1e-8, 0.0,
                           slots)
    with pytest.raises(RuntimeError, match=r"exp_avg_sq must have shape \(5, 6\)"):
        _ext.row_adamw(param, exp_avg, exp_avg_sq[:4], slot_step, rows, grad, None, 0.01, 1.0, 0.9, 0.99, 1e-8, 0.0,
                       torch.tensor([0, 1, 2]))
    assert all(torch.equal(a, b) for a, b in zip((param, exp_avg, exp_avg_sq, slot_step), before))


@pytest.mark.parametrize("form", ["compact", "dense"])
def test_set_row_state_writes_what_row_state_reads_in_either_form(form):
    torch.manual_seed(3)
    source_param = torch.nn.Parameter(torch.randn(101, 7))
    source = RowSparseAdamW([source_param], **HYPER)
    run(source, source_param, schedule(101, 7, 4, 12, torch.float32, seed=5))
    rows = source.touched_rows(source_param)
    param = torch.nn.Parameter(source_param.detach().clone())
    target = RowSparseAdamW([param], **HYPER, state=form)
    target.set_row_state(param, rows, source.row_state(source_param, rows))
    for key, value in source.row_state(source_param).items():
        assert torch.equal(target.row_state(param)[key], value), key
    assert torch.equal(target.touched_rows(param), rows)
    plan = schedule(101, 7, 3, 12, torch.float32, seed=6)
    run(source, source_param, plan)
    run(target, param, plan)
    assert torch.equal(param, source_param)


def test_set_row_state_refuses_bad_rows_or_state_with_nothing_written():
    param = torch.nn.Parameter(torch.randn(50, 4))
    optimizer = RowSparseAdamW([param], **HYPER)
    good = {"exp_avg": torch.randn(2, 4), "exp_avg_sq": torch.rand(2, 4), "row_step": torch.tensor([1, 2])}
    cases = [(torch.tensor([4, 2]), good, "ascending"), (torch.tensor([2, 50]), good, "lie in"),
             (torch.tensor([2, 4]), {**good, "exp_avg_sq": -good["exp_avg_sq"]}, "negative"),
             (torch.tensor([2, 4]), {**good, "row_step": torch.tensor([1.0, 2.0])}, "row_step"),
             (torch.tensor([2, 4]), {"exp_avg": good["exp_avg"]}, "exactly")]
    for rows, state, match in cases:
        with pytest.raises((ValueError, IndexError), match=match):
            optimizer.set_row_state(param, rows, state)
        assert optimizer.touched_rows(param).numel() == 0
