"""Issue 34, items 2 and 3: a non-finite gradient never writes NaN into a row whose own gradient was finite (the
step raises naming the parameter, or is skipped and counted), and every sparse step path refuses the same misuse
the same way before anything changes. Issue 42, items 1, 2 and 8: a clip norm that would corrupt the step is
refused, a step without a backward moves nothing, and the ablations refuse a forward from before the step."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from smf_kernels import ProductKeyMemory
from smf_kernels.sparse import (AuthorsSparseUpdate, DenseMaskedUpdate, NonFiniteGradientError, RowSparseAdamW,
                                SparseMemoryController, StepMisuseError)
from smf_kernels.sparse.background import BackgroundStats
from smf_kernels.sparse.clipping import clip_sharded_grad_norm_, norm_and_clip_coefficient

VOCAB, WIDTH, SEQ, ROWS = 30, 16, 5, 8
# (update class, begin_step kwargs, whether the optimizer is RowSparseAdamW)
PATHS = {"kept reads": (SparseMemoryController, {}), "selected": (SparseMemoryController, {"fill": "rows_first"}),
         "dense_masked": (DenseMaskedUpdate, {}), "authors": (AuthorsSparseUpdate, {})}


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.memory = ProductKeyMemory(WIDTH, n_keys=6, heads=2, topk=3, key_dim=8)
        self.alpha = nn.Parameter(torch.tensor(0.5))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.requires_grad_(False)
        self.memory.values.requires_grad_(True)
        self.alpha.requires_grad_(True)

    def forward(self, tokens):
        hidden = self.embed(tokens)
        return self.head(hidden + self.alpha * self.memory(hidden))


def setup(path, nonfinite="raise"):
    torch.manual_seed(0)
    model = TinyModel()
    update_type, begin = PATHS[path]
    update = update_type(model, rule="kl", rows_per_step=ROWS, nonfinite=nonfinite)
    stats = BackgroundStats.for_memories(update.memories)
    stats.add_batch("memory", torch.randint(0, 3, (model.memory.num_slots,), generator=torch.Generator().manual_seed(2)))
    update.set_background(stats)
    params = [model.memory.values, model.alpha]
    exact = update_type is SparseMemoryController
    optimizer = RowSparseAdamW(params, lr=1e-2) if exact else torch.optim.AdamW(params, lr=1e-2)
    return model, update, begin, optimizer


def loss_of(model, seed):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    return F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))


def step(model, update, begin, optimizer, seed, poison=None):
    """One step of one micro-batch; ``poison`` ("alpha" or "values") makes that gradient NaN."""
    update.begin_step(**begin)
    loss = loss_of(model, seed)
    if poison == "alpha":
        loss = loss + model.alpha * float("nan")
    elif poison == "values":  # a NaN reaching every row this micro-batch read (a forward before the selection)
        loss = loss + (model.memory(model.embed(torch.tensor([[1, 2]]))).sum() * float("nan"))
    if begin:
        update.select_rows()
    update.after_forward()
    loss.backward()
    return update.finish_step(optimizer, max_grad_norm=1.0)


def snapshot(model, optimizer):
    state = {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for p, s in optimizer.state.items()}
    return model.memory.values.detach().clone(), model.alpha.detach().clone(), state


def assert_unchanged(model, optimizer, before):
    values, alpha, state = before
    assert torch.equal(model.memory.values.detach(), values) and torch.equal(model.alpha.detach(), alpha)
    now = {id(p): s for p, s in optimizer.state.items()}
    assert now.keys() == state.keys()
    for key, entries in state.items():
        for name, value in entries.items():
            assert torch.equal(torch.as_tensor(now[key][name]), torch.as_tensor(value)), name


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("poison, named", [("alpha", "alpha"), ("values", "memory.values")])
def test_a_non_finite_gradient_raises_naming_the_parameter_and_moves_nothing(path, poison, named):
    """With clipping, one NaN in another parameter's gradient made the clip coefficient NaN and every selected
    row NaN, with no error. Now the step raises before the optimizer moves anything, naming the parameter."""
    model, update, begin, optimizer = setup(path)
    step(model, update, begin, optimizer, seed=1)  # a first step, so that there is optimizer state to keep
    before = snapshot(model, optimizer)
    with pytest.raises(NonFiniteGradientError, match=named.replace(".", r"\.")) as raised:
        step(model, update, begin, optimizer, seed=2, poison=poison)
    assert named in raised.value.names
    assert_unchanged(model, optimizer, before)
    assert not update.in_step if hasattr(update, "in_step") else True
    step(model, update, begin, optimizer, seed=3)  # the next step runs
    assert bool(torch.isfinite(model.memory.values).all())


@pytest.mark.parametrize("path", list(PATHS))
def test_nonfinite_skip_drops_the_step_and_counts_it(path):
    model, update, begin, optimizer = setup(path, nonfinite="skip")
    step(model, update, begin, optimizer, seed=1)
    before = snapshot(model, optimizer)
    rows = step(model, update, begin, optimizer, seed=2, poison="alpha")
    assert all(r.numel() == 0 for r in rows.values()) and update.skipped_steps == 1
    assert_unchanged(model, optimizer, before)
    assert model.alpha.grad is None
    step(model, update, begin, optimizer, seed=3)
    assert not torch.equal(model.memory.values.detach(), before[0])


def test_the_nonfinite_option_is_checked():
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        SparseMemoryController(TinyModel(), nonfinite="ignore")
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        AuthorsSparseUpdate(TinyModel(), nonfinite="zero")


@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_refuses_the_same_misuse_the_same_way_before_anything_changes(path):
    model, update, begin, optimizer = setup(path)
    step(model, update, begin, optimizer, seed=1)
    before = snapshot(model, optimizer)
    with pytest.raises(StepMisuseError, match=r"finish_step\(\) called without begin_step\(\)"):
        update.finish_step(optimizer, max_grad_norm=1.0)
    for method in (update.after_forward, update.end_step):
        with pytest.raises(StepMisuseError, match=rf"{method.__name__}\(\) called without begin_step\(\)"):
            method()
    loss_of(model, 4).backward()  # a backward outside any step
    with pytest.raises(StepMisuseError, match=r"memory\.values has a gradient, made by a backward of a forward run "
                                              r"outside a step"):
        update.begin_step(**begin)
    optimizer.zero_grad(set_to_none=True)
    update.begin_step(**begin)
    with pytest.raises(StepMisuseError, match=r"begin_step\(\) called twice"):
        update.begin_step(**begin)
    update.abort_step()
    assert_unchanged(model, optimizer, before)
    step(model, update, begin, optimizer, seed=5)


@pytest.mark.parametrize("path", list(PATHS))
def test_a_forward_before_the_step_whose_backward_runs_inside_it_is_refused_without_a_layout_change(path):
    """Kept reads used to drop its gradient silently (0 rows selected); the fused update took a dense step on
    every row, switched the optimizer's state to dense and raised at every later step; both ablations took it as
    the step's gradient and moved every row (AdamW's momentum). Now the step's end refuses it by name, the
    optimizer's state keeps its layout, and the next step trains."""
    model, update, begin, optimizer = setup(path)
    step(model, update, begin, optimizer, seed=1)
    before = snapshot(model, optimizer)
    early = loss_of(model, 2)
    update.begin_step(**begin)
    if begin:
        loss_of(model, 3)
        update.select_rows()
    early.backward()
    with pytest.raises(StepMisuseError, match=r"memory\.values has a gradient"):
        update.finish_step(optimizer, max_grad_norm=1.0)
    assert_unchanged(model, optimizer, before)
    if isinstance(optimizer, RowSparseAdamW):
        assert "held_rows" in optimizer.state[model.memory.values]  # the compact row state
        assert "step" not in optimizer.state[model.memory.values]
    update.abort_step()
    optimizer.zero_grad(set_to_none=True)
    step(model, update, begin, optimizer, seed=4)


BAD_NORMS = [(math.nan, ValueError), (-1.0, ValueError), (0.0, ValueError), ("1.0", TypeError), (True, TypeError)]


@pytest.mark.parametrize("path", list(PATHS))
def test_a_clip_norm_that_would_corrupt_the_step_is_refused_before_anything_moves(path):
    """NaN made every selected row and alpha NaN; -1 a negative coefficient (rows stepped up their gradient).
    Refused before anything moves, the step still open; inf is no clipping, as in torch."""
    model, update, begin, optimizer = setup(path)
    step(model, update, begin, optimizer, seed=1)
    before = snapshot(model, optimizer)
    update.begin_step(**begin)
    loss = loss_of(model, 2)
    if begin:
        update.select_rows()
    update.after_forward()
    loss.backward()
    for bad, error in BAD_NORMS:
        with pytest.raises(error, match="max_norm must be a number > 0"):
            update.finish_step(optimizer, max_grad_norm=bad)
        assert_unchanged(model, optimizer, before)
        assert update.in_step
    rows = update.finish_step(optimizer, max_grad_norm=math.inf)
    assert rows["memory"].numel() > 0 and bool(torch.isfinite(model.memory.values).all())


def test_the_clipping_functions_refuse_those_norms_before_scaling():
    grad = torch.ones(3)
    for bad, error in BAD_NORMS:
        with pytest.raises(error, match="max_norm must be a number > 0"):
            norm_and_clip_coefficient([grad], bad)
        param = nn.Parameter(torch.zeros(3))
        param.grad = grad.clone()
        with pytest.raises(error, match="max_norm must be a number > 0"):
            clip_sharded_grad_norm_([param], bad)
        assert torch.equal(param.grad, grad)
    model, update, begin, optimizer = setup("kept reads")
    update.begin_step()
    loss_of(model, 2).backward()
    gradients = update.end_step()
    alpha_grad = model.alpha.grad.clone()
    for bad, error in BAD_NORMS:
        with pytest.raises(error, match="max_norm must be a number > 0"):
            gradients.clip_([model.alpha], bad)
        assert torch.equal(model.alpha.grad, alpha_grad)
    assert float(norm_and_clip_coefficient([grad], torch.tensor(0.5))[1]) < 1  # a 0-d tensor, as torch takes it


@pytest.mark.parametrize("path", [*PATHS, "chosen by the backward"])
def test_a_step_with_a_forward_and_no_backward_moves_nothing(path):
    """The exact step used to select from the forward's reads and apply AdamW to a zero gradient (momentum and
    weight decay moved the rows, row_step advanced); the dense-masked ablation moved every row. Like torch.optim
    with a parameter that has no .grad, nothing moves now, and the step reports no rows; the next step trains."""
    model, update, begin, optimizer = setup("selected" if path == "chosen by the backward" else path)
    step(model, update, begin, optimizer, seed=1)  # momentum to leak, if anything stepped
    before = snapshot(model, optimizer)
    update.begin_step(**begin)
    loss_of(model, 2)  # its backward never runs
    if begin and path != "chosen by the backward":
        update.select_rows()
    update.after_forward()
    rows = update.finish_step(optimizer, max_grad_norm=1.0)
    assert all(r.numel() == 0 for r in rows.values())
    assert_unchanged(model, optimizer, before)
    assert not update.in_step
    step(model, update, begin, optimizer, seed=3)
    assert not torch.equal(model.memory.values.detach(), before[0])
