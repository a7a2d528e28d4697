"""SparseMemoryController end to end: no value gradient, per-step selection under gradient accumulation and under
torch.distributed (gloo, 2 processes, against the float64 oracle), misuse refused, and the dense-masked leak."""
import copy
import datetime
import gc
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from smf_kernels.sparse import (BackgroundStats, DenseMaskedUpdate, RowSparseAdamW,
                                SparseMemoryController, StepMisuseError)
from helpers import MemoryLM
from sparse_oracle import dense_reference

VOCAB, WIDTH, SEQ, ROWS = 50, 32, 6, 12


def tiny_model():
    return MemoryLM(VOCAB, WIDTH, n_keys=8, heads=2, topk=4, key_dim=16)


def make_steps(num_steps, sequences, generator_seed=1):
    """Per step: tokens (B, SEQ), targets (B, SEQ), valid (B, SEQ) with right padding."""
    generator = torch.Generator().manual_seed(generator_seed)
    steps = []
    for _ in range(num_steps):
        tokens = torch.randint(0, VOCAB, (sequences, SEQ), generator=generator)
        targets = torch.randint(0, VOCAB, (sequences, SEQ), generator=generator)
        lengths = torch.randint(2, SEQ + 1, (sequences,), generator=generator)
        valid = torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)
        steps.append((tokens, targets, valid))
    return steps


def background_batches(count=10):
    generator = torch.Generator().manual_seed(2)
    return [(torch.randint(0, VOCAB, (1, SEQ), generator=generator), torch.ones(1, SEQ, dtype=torch.bool))
            for _ in range(count)]


def forward_background(model, batch):
    return model(*batch)


def micro_loss(model, tokens, targets, valid, normaliser):
    """Sum of token losses over valid positions / normaliser (padding never enters the loss)."""
    logits = model(tokens, valid)
    losses = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    return (losses * valid.reshape(-1)).sum() / normaliser


def train(model, controller, optimizer, steps, micro_batches, normaliser_scale=1.0):
    """Runs the steps, each split into ``micro_batches`` chunks; returns the selected rows per step."""
    selected = []
    for tokens, targets, valid in steps:
        normaliser = valid.sum() * normaliser_scale
        controller.begin_step()
        for chunk in zip(tokens.chunk(micro_batches), targets.chunk(micro_batches), valid.chunk(micro_batches)):
            micro_loss(model, *chunk, normaliser).backward()
            assert model.memory.values.grad is None  # the backward wrote into the step's sink, no (M, D) buffer
        selected.append(controller.finish_step(optimizer, max_grad_norm=1.0)["memory"])
    return selected


def fresh_setup(rule, update=SparseMemoryController):
    torch.manual_seed(0)
    model = tiny_model()
    controller = update(model, rule=rule, rows_per_step=ROWS)
    controller.collect_background(background_batches(), forward=forward_background)
    return model, controller


def rel_err(out, ref):
    return ((out - ref).norm() / ref.norm()).item()


def test_accumulating_four_micro_batches_equals_one_batch_of_four_times_the_size():
    steps = make_steps(3, sequences=8)
    results = []
    for micro_batches in (1, 4):
        model, controller = fresh_setup("tfidf")
        start = model.memory.values.detach().clone()
        optimizer = RowSparseAdamW([model.memory.values, model.alpha], lr=1e-2)
        selected = train(model, controller, optimizer, steps, micro_batches)
        results.append((selected, model.memory.values.detach().clone(), model.alpha.detach().clone()))
        changed = (model.memory.values.detach() != start).any(dim=1).nonzero().flatten()
        assert changed.tolist() == torch.cat(selected).unique().tolist()  # exactly the selected rows moved
        assert all(rows.numel() == ROWS for rows in selected)
    (rows_one, values_one, alpha_one), (rows_four, values_four, alpha_four) = results
    assert all(torch.equal(a, b) for a, b in zip(rows_one, rows_four))
    assert rel_err(values_four, values_one) < 1e-6
    assert abs(alpha_four.item() - alpha_one.item()) < 1e-6


def test_select_rows_misuse_raises():
    model, controller = fresh_setup("kl")
    optimizer = RowSparseAdamW([model.memory.values], lr=1e-2)
    tokens, targets, valid = make_steps(1, sequences=2)[0]
    with pytest.raises(StepMisuseError, match="without begin_step"):
        controller.select_rows()
    controller.begin_step()
    with pytest.raises(RuntimeError, match="fill='rows_first'"):
        controller.select_rows()
    controller.abort_step()
    controller.begin_step(fill="rows_first")
    loss = micro_loss(model, tokens, targets, valid, valid.sum())
    controller.select_rows()
    with pytest.raises(RuntimeError, match="already called"):
        controller.select_rows()
    loss.backward()
    controller.finish_step(optimizer)


def test_dense_masked_update_leaks_while_the_exact_one_keeps_unselected_rows_bit_identical():
    steps = make_steps(3, sequences=4)
    runs = {}
    for update in (SparseMemoryController, DenseMaskedUpdate):
        model, controller = fresh_setup("kl", update)
        optimizer_type = RowSparseAdamW if update is SparseMemoryController else torch.optim.AdamW
        optimizer = optimizer_type([model.memory.values], lr=1e-2, weight_decay=0.0)
        history, selected = [model.memory.values.detach().clone()], []
        for tokens, targets, valid in steps:
            controller.begin_step()
            micro_loss(model, tokens, targets, valid, valid.sum()).backward()
            assert model.memory.values.grad is None  # both hold the step's gradient apart until its end
            selected.append(controller.finish_step(optimizer)["memory"])
            history.append(model.memory.values.detach().clone())
        runs[update] = history, selected
    sparse_history, sparse_rows = runs[SparseMemoryController]
    masked_history, masked_rows = runs[DenseMaskedUpdate]
    assert rel_err(masked_history[1], sparse_history[1]) < 1e-6  # first step: no momentum yet, no leak
    for step in (1, 2):
        assert torch.equal(masked_rows[step], sparse_rows[step])
        moved = lambda history: (history[step + 1] != history[step]).any(dim=1)  # noqa: E731
        assert moved(sparse_history).nonzero().flatten().tolist() == sparse_rows[step].tolist()
        masked_moved = moved(masked_history)
        leaked = masked_moved.clone()
        leaked[masked_rows[step]] = False
        assert bool(leaked.any()), "dense-masked AdamW should move rows it did not select (momentum)"


def test_controller_misuse_raises():
    model = tiny_model()
    with pytest.raises(RuntimeError, match="no background statistics"):
        SparseMemoryController(model).begin_step()
    controller = SparseMemoryController(model, background=BackgroundStats.for_memories({"memory": model.memory}))
    with pytest.raises(StepMisuseError, match="without begin_step"):
        controller.finish_step(torch.optim.SGD([model.alpha], lr=0.1))
    controller.begin_step()
    with pytest.raises(StepMisuseError, match="twice"):
        controller.begin_step()
    with pytest.raises(TypeError, match="RowSparseAdamW"):  # refused before the step ends: still in it
        controller.finish_step(torch.optim.SGD([model.alpha], lr=0.1))
    assert controller.in_step
    controller.abort_step()
    with pytest.raises(ValueError, match="fill must be one of"):
        controller.begin_step(fill="count_first")
    with pytest.raises(ValueError, match="fill 'rows_first' is the exact update's; DenseMaskedUpdate selects at"):
        DenseMaskedUpdate(model, background=controller.background).begin_step(fill="rows_first")
    assert not controller.in_step
    controller.begin_step()
    gradients = controller.end_step()
    gradients.apply(RowSparseAdamW([model.memory.values], lr=0.1))
    with pytest.raises(StepMisuseError, match="applied already"):
        gradients.apply(RowSparseAdamW([model.memory.values], lr=0.1))
    with pytest.raises(ValueError, match="rule must be one of"):
        SparseMemoryController(model, rule="bm25")
    with pytest.raises(ValueError, match="no ProductKeyMemory"):
        SparseMemoryController(nn.Linear(2, 2))
    assert controller.ddp_ignored_names() == ["memory.values", "memory.read_counts"]


@pytest.mark.parametrize("how", ["selected", "kept"])
def test_abort_step_after_a_forward_that_raised_leaves_the_controller_as_if_the_step_never_began(how):
    """A forward raising inside a step (after a first micro-batch went through, where the step has one):
    abort_step() discards the step (its counts, routing, value gradients, held row gradients), and the next
    steps select and move exactly what they would have without it."""
    begin = {"selected": {"fill": "rows_first"}, "kept": {}}
    steps = make_steps(2, sequences=2)
    results = []
    for fail_first in (False, True):
        model, counting = fresh_setup("kl")
        controller = SparseMemoryController(model, rule="kl", rows_per_step=ROWS, background=counting.background)
        optimizer = RowSparseAdamW([model.memory.values, model.alpha], lr=1e-2)
        if fail_first:
            tokens, targets, valid = steps[0]
            controller.begin_step(**begin[how])
            if how != "selected":  # a first micro-batch's forward and backward
                micro_loss(model, tokens[:1], targets[:1], valid[:1], valid.sum()).backward()
            with pytest.raises(IndexError):  # the memory has counted its reads when the loss raises
                micro_loss(model, tokens[1:], targets[1:] + VOCAB, valid[1:], valid.sum())
            assert int(model.memory.read_counts.sum()) > 0
            with pytest.raises(RuntimeError, match="abort_step"):
                controller.begin_step(**begin[how])
            controller.abort_step()
            optimizer.zero_grad(set_to_none=True)  # the other parameters' gradients (alpha's) are the caller's
            assert not controller.in_step and model.memory.values.grad is None
            assert not model.memory.count_reads and model.memory.grad_sink is None
            assert int(model.memory.read_counts.sum()) == 0
            controller.abort_step()  # nothing in progress: a no-op
        selected = []
        for tokens, targets, valid in steps:
            controller.begin_step(**begin[how])
            loss = micro_loss(model, tokens, targets, valid, valid.sum())
            if how == "selected":
                controller.select_rows()
            loss.backward()
            selected.append(controller.finish_step(optimizer, max_grad_norm=1.0)["memory"])
        results.append((selected, model.memory.values.detach().clone(), model.alpha.detach().clone()))
    (rows_clean, values_clean, alpha_clean), (rows_aborted, values_aborted, alpha_aborted) = results
    assert all(torch.equal(a, b) for a, b in zip(rows_clean, rows_aborted))
    assert torch.equal(values_clean, values_aborted) and torch.equal(alpha_clean, alpha_aborted)


@pytest.mark.parametrize("fill", ["reads_kept", "rows_first"])
def test_a_value_gradient_made_outside_a_step_is_refused_by_name_before_anything_changes(fill):
    """A backward outside any step leaves a dense gradient (refused at begin_step); a forward run before
    begin_step() whose backward runs inside the step (kept reads used to drop it silently, selecting 0 rows; the
    fused update took a dense step on every row and switched the optimizer's state to dense) is refused at the
    step's end: the values, the optimizer's state and the step are as they were."""
    model, controller = fresh_setup("kl")
    optimizer = RowSparseAdamW([model.memory.values, model.alpha], lr=1e-2)
    tokens, targets, valid = make_steps(1, sequences=2)[0]
    micro_loss(model, tokens, targets, valid, valid.sum()).backward()  # outside any step: a dense gradient
    assert model.memory.values.grad.layout == torch.strided
    with pytest.raises(StepMisuseError, match=r"memory\.values has a gradient, made by a backward of a forward run "
                                              r"outside a step"):
        controller.begin_step(fill=fill)
    assert not controller.in_step
    optimizer.zero_grad(set_to_none=True)
    train(model, controller, optimizer, make_steps(1, sequences=2), micro_batches=1)  # a first step: some state
    state = copy.deepcopy(optimizer.state[model.memory.values])
    values = model.memory.values.detach().clone()
    early = micro_loss(model, tokens, targets, valid, valid.sum())  # a forward before the step
    controller.begin_step(fill=fill)
    early.backward()
    for end in (controller.end_step, lambda: controller.finish_step(optimizer, max_grad_norm=1.0)):
        with pytest.raises(StepMisuseError, match=r"memory\.values has a gradient"):
            end()
    assert controller.in_step and torch.equal(model.memory.values.detach(), values)
    assert all(torch.equal(torch.as_tensor(optimizer.state[model.memory.values][key]), torch.as_tensor(value))
               for key, value in state.items())
    controller.abort_step()
    optimizer.zero_grad(set_to_none=True)
    controller.begin_step()
    late = micro_loss(model, tokens, targets, valid, valid.sum())
    controller.abort_step()
    with pytest.raises(RuntimeError, match="a step that has ended"):  # its sink is closed
        late.backward()


NUM_STEPS, WORLD = 2, 2


def _distributed_worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(minutes=3))  # a stuck peer fails, not hangs
    try:
        _train_one_rank(rank, out_dir)
        # DDP's reducer holds the process group. Freed after destroy_process_group (when the
        # worker's locals went), ~ProcessGroupGloo once deadlocked on a mutex (py-spy, 2-core VM):
        # both ranks finish, then the reducer goes, then the group.
        dist.barrier()
        gc.collect()
    finally:
        dist.destroy_process_group()


def _train_one_rank(rank, out_dir):
    torch.manual_seed(0)
    model = tiny_model()
    controller = SparseMemoryController(model, rule="kl", rows_per_step=ROWS)
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, controller.ddp_ignored_names())
    wrapped = nn.parallel.DistributedDataParallel(model)
    # each rank counts half of the background; the controller sums them across ranks
    controller.collect_background(background_batches()[rank::WORLD], forward=forward_background)
    optimizer = RowSparseAdamW([model.memory.values, model.alpha], lr=1e-2)
    selected = []
    for tokens, targets, valid in make_steps(NUM_STEPS, sequences=8):
        normaliser = valid.sum() / WORLD  # DDP averages over ranks: the global token mean results
        half = slice(rank * 4, rank * 4 + 4)
        controller.begin_step()
        for chunk in zip(tokens[half].chunk(2), targets[half].chunk(2), valid[half].chunk(2)):
            micro_loss(wrapped, *chunk, normaliser).backward()
        selected.append(controller.finish_step(optimizer, max_grad_norm=1.0)["memory"])
    torch.save({"selected": selected, "values": model.memory.values.detach(), "alpha": model.alpha.detach(),
                "background": controller.background.reads["memory"]}, f"{out_dir}/rank{rank}.pt")


def test_two_gloo_ranks_make_the_exact_step_of_the_whole_batch(tmp_path):
    """DDP over two gloo ranks, two micro-batches each (kept reads): the same rows on both ranks, and the
    oracle's step on the whole batch (dense float64 gradients, AdamW restricted to the selected rows)."""
    mp.spawn(_distributed_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]

    model, controller = fresh_setup("kl")
    steps = [[(tokens, targets, valid, valid.sum())] for tokens, targets, valid in make_steps(NUM_STEPS, sequences=8)]
    reference = dense_reference(model, steps, lambda m, batch: micro_loss(m, *batch), controller.background,
                                rule="kl", rows_per_step=ROWS, lr=1e-2, weight_decay=1e-2, max_grad_norm=1.0)
    for result in ranks:
        assert torch.equal(result["background"], controller.background.reads["memory"])
        assert all(torch.equal(a, b["memory"]) for a, b in zip(result["selected"], reference["rows"]))
        assert rel_err(result["values"].double(), reference["params"]["memory.values"]) < 1e-6
        assert abs(result["alpha"].item() - reference["params"]["alpha"].item()) < 1e-6
    assert torch.equal(ranks[0]["values"], ranks[1]["values"])
