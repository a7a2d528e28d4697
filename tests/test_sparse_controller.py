"""SparseMemoryController end to end: sparse gradients only, per-step selection under gradient
accumulation and under torch.distributed (gloo, 2 processes), and the dense-masked leak."""
import datetime
import gc
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from smf_kernels import ProductKeyMemory
from smf_kernels.sparse import BackgroundStats, RowSparseAdamW, SparseMemoryController

VOCAB, WIDTH, SEQ, ROWS = 50, 32, 6, 12


class TinyModel(nn.Module):
    """embed -> h + alpha * memory(h) -> head; only the memory values and alpha train (stage 2, +S)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.memory = ProductKeyMemory(WIDTH, n_keys=8, heads=2, topk=4, key_dim=16)
        self.alpha = nn.Parameter(torch.tensor(0.5))
        self.head = nn.Linear(WIDTH, VOCAB)
        for param in self.parameters():
            param.requires_grad_(False)
        self.memory.values.requires_grad_(True)
        self.alpha.requires_grad_(True)

    def forward(self, tokens, valid):
        hidden = self.embed(tokens)
        return self.head(hidden + self.alpha * self.memory(hidden, valid_mask=valid))


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
        read_so_far = []
        for chunk in zip(tokens.chunk(micro_batches), targets.chunk(micro_batches), valid.chunk(micro_batches)):
            micro_loss(model, *chunk, normaliser).backward()
            with torch.no_grad():  # every slot this micro-batch read, padding included
                read_so_far.append(model.memory.lookup(model.embed(chunk[0]).reshape(-1, WIDTH))[1].flatten())
            grad = model.memory.values.grad  # compact: exactly the rows read so far, no dense (M, D) buffer
            assert grad.is_sparse and grad.is_coalesced()
            assert grad.indices()[0].tolist() == torch.cat(read_so_far).unique().tolist()
        selected.append(controller.finish_step(optimizer, max_grad_norm=1.0)["memory"])
    return selected


def fresh_setup(rule, mode="row_sparse"):
    torch.manual_seed(0)
    model = TinyModel()
    controller = SparseMemoryController(model, rule=rule, rows_per_step=ROWS, mode=mode)
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


def test_select_before_backward_writes_only_selected_rows_and_matches_compact_accumulation():
    steps = make_steps(3, sequences=4)
    results = []
    for early in (False, True):
        model, controller = fresh_setup("kl")
        optimizer = RowSparseAdamW([model.memory.values, model.alpha], lr=1e-2)
        selected = []
        for tokens, targets, valid in steps:
            controller.begin_step(select_before_backward=early)
            loss = micro_loss(model, tokens, targets, valid, valid.sum())
            if early:
                rows = controller.select_rows()["memory"]
            loss.backward()
            if early:  # the backward itself wrote exactly the T selected rows
                assert torch.equal(model.memory.values.grad.indices()[0], rows)
            selected.append(controller.finish_step(optimizer, max_grad_norm=1.0)["memory"])
        results.append((selected, model.memory.values.detach().clone()))
    (rows_late, values_late), (rows_early, values_early) = results
    assert all(torch.equal(a, b) for a, b in zip(rows_late, rows_early))
    assert rel_err(values_early, values_late) < 1e-6


def test_select_before_backward_misuse_raises():
    model, controller = fresh_setup("kl")
    optimizer = RowSparseAdamW([model.memory.values], lr=1e-2)
    tokens, targets, valid = make_steps(1, sequences=2)[0]
    controller.begin_step()
    with pytest.raises(RuntimeError, match="select_before_backward=True"):
        controller.select_rows()
    controller.finish_step(optimizer)
    controller.begin_step(select_before_backward=True)
    loss = micro_loss(model, tokens, targets, valid, valid.sum())
    with pytest.raises(RuntimeError, match="were not set before the backward"):
        loss.backward()
    with pytest.raises(RuntimeError, match="needs select_rows"):
        controller.finish_step(optimizer)


def test_dense_masked_mode_leaks_while_row_sparse_keeps_unselected_rows_bit_identical():
    steps = make_steps(3, sequences=4)
    runs = {}
    for mode in ("row_sparse", "dense_masked"):
        model, controller = fresh_setup("kl", mode)
        optimizer_type = RowSparseAdamW if mode == "row_sparse" else torch.optim.AdamW
        optimizer = optimizer_type([model.memory.values], lr=1e-2, weight_decay=0.0)
        history, selected = [model.memory.values.detach().clone()], []
        for tokens, targets, valid in steps:
            controller.begin_step()
            micro_loss(model, tokens, targets, valid, valid.sum()).backward()
            assert model.memory.values.grad.is_sparse == (mode == "row_sparse")
            selected.append(controller.finish_step(optimizer)["memory"])
            history.append(model.memory.values.detach().clone())
        runs[mode] = history, selected
    sparse_history, sparse_rows = runs["row_sparse"]
    masked_history, masked_rows = runs["dense_masked"]
    assert rel_err(masked_history[1], sparse_history[1]) < 1e-6  # first step: no momentum yet, no leak
    for step in (1, 2):
        moved = lambda history: (history[step + 1] != history[step]).any(dim=1)  # noqa: E731
        assert moved(sparse_history).nonzero().flatten().tolist() == sparse_rows[step].tolist()
        masked_moved = moved(masked_history)
        leaked = masked_moved.clone()
        leaked[masked_rows[step]] = False
        assert bool(leaked.any()), "dense-masked AdamW should move rows it did not select (momentum)"


def test_controller_misuse_raises():
    model = TinyModel()
    with pytest.raises(RuntimeError, match="no background statistics"):
        SparseMemoryController(model).begin_step()
    controller = SparseMemoryController(model, background=BackgroundStats.for_memories({"memory": model.memory}))
    with pytest.raises(RuntimeError, match="without begin_step"):
        controller.finish_step(torch.optim.SGD([model.alpha], lr=0.1))
    controller.begin_step()
    with pytest.raises(RuntimeError, match="twice"):
        controller.begin_step()
    with pytest.raises(ValueError, match="rule must be one of"):
        SparseMemoryController(model, rule="bm25")
    with pytest.raises(ValueError, match="no ProductKeyMemory"):
        SparseMemoryController(nn.Linear(2, 2))
    assert controller.ddp_ignored_names() == ["memory.values", "memory.read_counts"]


@pytest.mark.parametrize("fused, how", [(False, "selected"), (True, "selected"), (False, "read"), (True, "deferred")])
def test_abort_step_after_a_forward_that_raised_leaves_the_controller_as_if_the_step_never_began(fused, how):
    """A forward raising inside a step (after a first micro-batch went through, where the step has one):
    abort_step() discards the step (its counts, routing, value gradients, held row gradients), and the next
    steps select and move exactly what they would have without it."""
    begin = {"selected": {"select_before_backward": True}, "read": {}, "deferred": {"defer_value_gradients": True}}
    steps = make_steps(2, sequences=2)
    results = []
    for fail_first in (False, True):
        model, counting = fresh_setup("kl")
        controller = SparseMemoryController(model, rule="kl", rows_per_step=ROWS, background=counting.background,
                                            fused=fused)
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
            assert not controller.in_step and model.memory.values.grad is None and not controller.row_gradients
            assert not model.memory.count_reads and model.memory.update_rows is None
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


def test_a_dense_gradient_made_outside_a_step_is_refused_by_name():
    model, controller = fresh_setup("kl")
    tokens, targets, valid = make_steps(1, sequences=2)[0]
    micro_loss(model, tokens, targets, valid, valid.sum()).backward()  # outside any step: a dense gradient
    assert model.memory.values.grad.layout == torch.strided
    with pytest.raises(RuntimeError, match=r"memory\.values has a dense gradient, made by a backward outside a step"):
        controller.begin_step()
    assert not controller.in_step
    model.memory.values.grad = None
    controller.begin_step()
    model.memory.values.grad = torch.zeros_like(model.memory.values)  # appears mid-step: the hook names it too
    with pytest.raises(RuntimeError, match=r"memory\.values has a dense gradient"):
        micro_loss(model, tokens, targets, valid, valid.sum()).backward()


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
    model = TinyModel()
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


def test_two_gloo_ranks_select_the_same_rows_and_match_one_process_with_the_whole_batch(tmp_path):
    mp.spawn(_distributed_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]

    model, controller = fresh_setup("kl")
    optimizer = RowSparseAdamW([model.memory.values, model.alpha], lr=1e-2)
    selected = train(model, controller, optimizer, make_steps(NUM_STEPS, sequences=8), micro_batches=1)

    for result in ranks:
        assert torch.equal(result["background"], controller.background.reads["memory"])
        assert all(torch.equal(a, b) for a, b in zip(result["selected"], selected))
        assert rel_err(result["values"], model.memory.values.detach()) < 1e-6
        assert abs(result["alpha"].item() - model.alpha.item()) < 1e-6
    assert torch.equal(ranks[0]["values"], ranks[1]["values"])


# ------------------------------------------------------------------ fused update, deferred value gradients
def _run_steps(fused, how, max_grad_norm, steps, micro_batches=2):
    """Trains ``steps`` with the controller in ``how`` ("read": ROWS_READ, "selected": rows chosen before the
    backward after a counting pass, "deferred": the kept reads, "in-backward": fused, applied by the backward);
    returns (selected rows per step, values, alpha, optimizer state of the values)."""
    torch.manual_seed(0)
    model = TinyModel()
    controller = SparseMemoryController(model, rule="kl", rows_per_step=ROWS, fused=fused)
    controller.collect_background(background_batches(), forward=forward_background)
    optimizer = RowSparseAdamW([model.memory.values, model.alpha], lr=1e-2, weight_decay=0.1)
    selected = []
    for tokens, targets, valid in steps:
        chunks = list(zip(tokens.chunk(micro_batches), targets.chunk(micro_batches), valid.chunk(micro_batches)))
        controller.begin_step(select_before_backward=how in ("selected", "in-backward"),
                              defer_value_gradients=how == "deferred",
                              optimizer=optimizer if how == "in-backward" else None)
        if how in ("selected", "in-backward"):
            with torch.no_grad():
                for chunk in chunks:
                    model(chunk[0], chunk[2])
            controller.select_rows()
        for chunk in chunks:
            micro_loss(model, *chunk, valid.sum()).backward()
            if how == "deferred" or (fused and how != "read"):
                assert model.memory.values.grad is None  # no value gradient written by a backward
        selected.append(controller.finish_step(optimizer, max_grad_norm=max_grad_norm)["memory"])
    state = optimizer.state[model.memory.values]
    return selected, model.memory.values.detach().clone(), model.alpha.detach().clone(), state


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
@pytest.mark.parametrize("fused, how", [(True, "read"), (True, "selected"), (True, "deferred"),
                                        (False, "deferred"), (False, "selected")])
def test_fused_update_and_deferred_gradients_equal_the_plain_sparse_step(fused, how, max_grad_norm):
    """Every way of getting the rows' gradient, and the fused update, make the plain step's update within fp32
    rounding (clipping at 0.05 clips every step); unselected rows keep their bits, selections are identical."""
    steps = make_steps(3, sequences=4)
    rows_ref, values_ref, alpha_ref, state_ref = _run_steps(False, "read", max_grad_norm, steps)
    rows, values, alpha, state = _run_steps(fused, how, max_grad_norm, steps)
    assert all(torch.equal(a, b) for a, b in zip(rows, rows_ref))
    moved = torch.cat(rows).unique()
    still = torch.ones(values.shape[0], dtype=torch.bool)
    still[moved] = False
    start = _run_steps(False, "read", max_grad_norm, [])[1]
    assert torch.equal(values[still], start[still]) and torch.equal(values_ref[still], start[still])
    assert rel_err(values, values_ref) < 1e-6 and abs(alpha.item() - alpha_ref.item()) < 1e-6
    assert torch.equal(state["row_step"], state_ref["row_step"])
    assert rel_err(state["exp_avg_sq"], state_ref["exp_avg_sq"]) < 1e-5


def test_the_backward_applies_the_fused_update_when_rows_come_first_and_nothing_clips():
    steps = make_steps(3, sequences=4)
    reference = _run_steps(False, "read", None, steps, micro_batches=1)
    updated = _run_steps(True, "in-backward", None, steps, micro_batches=1)
    assert all(torch.equal(a, b) for a, b in zip(updated[0], reference[0]))
    assert rel_err(updated[1], reference[1]) < 1e-6
    model, controller = fresh_setup("kl")
    controller.fused = True
    optimizer = RowSparseAdamW([model.memory.values], lr=1e-2)
    controller.begin_step(select_before_backward=True, optimizer=optimizer)
    tokens, targets, valid = steps[0]
    loss = micro_loss(model, tokens, targets, valid, valid.sum())
    controller.select_rows()
    loss.backward()
    with pytest.raises(RuntimeError, match="one micro-batch"):
        micro_loss(model, tokens, targets, valid, valid.sum()).backward()
    with pytest.raises(RuntimeError, match="cannot clip"):
        controller.finish_step(optimizer, max_grad_norm=1.0)


def test_fused_options_that_cannot_work_are_refused():
    model, _ = fresh_setup("kl")
    with pytest.raises(ValueError, match="row_sparse"):
        SparseMemoryController(model, mode="dense_masked", fused=True)
    controller = SparseMemoryController(model, rows_per_step=ROWS)
    controller.collect_background(background_batches(), forward=forward_background)
    optimizer = RowSparseAdamW([model.memory.values], lr=1e-2)
    with pytest.raises(ValueError, match="fused=True"):
        controller.begin_step(select_before_backward=True, optimizer=optimizer)
    with pytest.raises(ValueError, match="choose one"):
        controller.begin_step(select_before_backward=True, defer_value_gradients=True)
