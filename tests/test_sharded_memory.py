"""ShardedProductKeyMemory over 2 and 4 gloo processes against one unsharded process on the same tokens:
initialisation, outputs, read counts and gradients on every backend; several accumulated SMF steps (the same
rows selected, the same weights after, clipping active); a dense step; checkpoints written by 4 ranks and
loaded on 2 and on 1; the paper's layer at world size 4 against world size 1."""
from __future__ import annotations

import datetime
import gc

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from helpers import backends_under_test, random_background, rel_err
from smf_kernels import ProductKeyMemory
from smf_kernels.sharded import (LEDGER, ColumnShard, ShardedProductKeyMemory, column_bounds, ddp_ignored_names,
                                 shard_memories)
from smf_kernels.sharded.placement import placement_of
from smf_kernels.sharded import byte_model
from smf_kernels.sharded.checkpoint import load_shards, replicated_optimizer_state, save_shard
from smf_kernels.sparse import RowGradSink, RowSparseAdamW, RowSparseSGD, SparseMemoryController, clip_sharded_grad_norm_
from sparse_oracle import dense_reference

pytestmark = pytest.mark.usefixtures("one_thread")

# A small layer with a value width no world size divides evenly (30 columns over 4 ranks: 8, 8, 7, 7).
LAYER = {"d_model": 24, "n_keys": 8, "heads": 2, "topk": 4, "key_dim": 8, "value_dim": 30}
TOKENS = {2: [3, 7], 4: [1, 2, 3, 4]}  # tokens per rank: uneven on purpose
MODEL_LAYER = byte_model.Layer(slots=LAYER["n_keys"] ** 2, dim=LAYER["value_dim"], reads=LAYER["heads"] * LAYER["topk"])


def spawn(function, world: int, tmp_path, *args) -> None:
    """Run ``function(rank, world, tmp_path, *args)`` in ``world`` gloo processes."""
    init = tmp_path / f"init-{function.__name__}-{world}"
    mp.spawn(_entry, args=(function, world, str(init), tmp_path, args), nprocs=world, join=True)


def _entry(rank, function, world, init, tmp_path, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=3))  # a stuck peer fails, not hangs
    try:
        function(rank, world, tmp_path, *args)
        dist.barrier()
        gc.collect()  # DDP reducers before their process group (see test_sparse_controller.py)
    finally:
        dist.destroy_process_group()


def _all_jobs(rank, world, tmp_path, backends, checkpoint_dir):
    """Every job of one world size in one spawn (starting processes costs more than the jobs)."""
    _layer_job(rank, world, tmp_path, backends)
    _smf_job(rank, world, tmp_path)
    if world == 4:
        _save_job(rank, world, tmp_path)
        _paper_job(rank, world, tmp_path)
    else:
        _dense_job(rank, world, tmp_path)
        _load_job(rank, world, checkpoint_dir)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("four-ranks")
    spawn(_all_jobs, 4, path, backends_under_test(), None)
    return path


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, four_ranks):
    path = tmp_path_factory.mktemp("two-ranks")
    spawn(_all_jobs, 2, path, backends_under_test(), four_ranks)  # also loads the 4 ranks' checkpoint
    return path


@pytest.fixture
def ranks_dir(request, world):
    return request.getfixturevalue("two_ranks" if world == 2 else "four_ranks")


def my_rows(world: int, rank: int) -> slice:
    sizes = TOKENS[world]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def layer_inputs():
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(sum(TOKENS[2]), LAYER["d_model"], generator=generator)
    probe = torch.randn(x.shape, generator=generator)  # loss = <out, probe>
    valid = torch.rand(x.shape[0], generator=generator) > 0.3
    return x, probe, valid


# ------------------------------------------------------------------------------- the layer
def cases(backend):
    """(name, rows): dense gradients with read counting, or the gradient of given rows (ascending) into a
    RowGradSink. The sharding around the local gather is the same for every backend: the slow Triton
    interpreter runs the first case only."""
    all_cases = (("dense", None), ("rows", torch.tensor([0, 5, 17, 40, 63])))
    return all_cases[:1] if backend == "triton" else all_cases


def _layer_job(rank, world, tmp_path, backends):
    x, probe, valid = layer_inputs()
    mine = my_rows(world, rank)
    results = {}
    for backend in backends:
        torch.manual_seed(0)
        memory = ShardedProductKeyMemory(**LAYER, backend=backend)
        after_init = torch.rand(3)  # the RNG must end where the unsharded constructor leaves it
        runs = {"init": memory.values.detach().clone(), "after_init": after_init,
                "columns": (memory.shard.start, memory.shard.stop)}
        for case, rows in cases(backend):
            memory.zero_grad(set_to_none=True)
            memory.reset_read_counts()
            memory.set_read_counting(case == "dense")
            sink = None if rows is None else RowGradSink(memory.values, rows.numel(), fill="rows_first")
            if sink is not None:
                sink.set_rows(rows, torch.ones(rows.shape, dtype=torch.bool))
            memory.set_grad_sink(sink)
            LEDGER.reset()
            out = memory(x[mine], valid_mask=valid[mine])
            (out * probe[mine]).sum().mul(world).backward()  # x world: the value gradient is averaged over ranks
            # a sink's gradient is not averaged: a column shard's read sums every rank's tokens (the controller
            # divides it by the group's size)
            grad = memory.values.grad if sink is None else sink.grad / world
            runs[case] = {"out": out.detach(), "counts": memory.read_counts.clone(), "bytes": dict(LEDGER.sent),
                          "values": grad,
                          **{name: p.grad.clone() for name, p in memory.named_parameters() if name != "values"}}
        results[backend] = runs
    torch.save(results, tmp_path / f"layer-{world}-{rank}.pt")


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_layer_equals_the_unsharded_layer_on_every_backend(ranks_dir, world):
    backends = backends_under_test()
    x, probe, valid = layer_inputs()
    ranks = [torch.load(ranks_dir / f"layer-{world}-{rank}.pt") for rank in range(world)]
    bounds = column_bounds(LAYER["value_dim"], world)
    for backend in backends:
        torch.manual_seed(0)
        reference = ProductKeyMemory(**LAYER, backend=backend)
        after_init = torch.rand(3)
        for rank, result in enumerate(ranks):
            runs = result[backend]
            start, stop = bounds[rank], bounds[rank + 1]
            assert runs["columns"] == (start, stop)
            assert torch.equal(runs["init"], reference.values.detach()[:, start:stop]), "same draws, its columns"
            assert torch.equal(runs["after_init"], after_init)
        for case, rows in cases(backend):
            reference.zero_grad(set_to_none=True)
            reference.reset_read_counts()
            reference.set_read_counting(case == "dense")
            out = reference(x, valid_mask=valid)
            (out * probe).sum().backward()
            expected_grad = reference.values.grad if rows is None else reference.values.grad[rows]
            counts = sum(r[backend][case]["counts"] for r in ranks)
            assert torch.equal(counts, reference.read_counts), (backend, case)
            if case == "dense":
                assert int(counts.sum()) == int(valid.sum()) * LAYER["heads"] * LAYER["topk"] > 0
            for rank, result in enumerate(ranks):
                got = result[backend][case]
                start, stop = bounds[rank], bounds[rank + 1]
                assert rel_err(got["out"], out.detach()[my_rows(world, rank)]) < 1e-6, (backend, case, rank)
                assert rel_err(got["values"], expected_grad[:, start:stop]) < 1e-6, (backend, case, rank)
                # the byte model predicts what the collectives were handed, to the byte
                assert got["bytes"] == byte_model.column_read_bytes(MODEL_LAYER, TOKENS[world], rank)
            for name, param in reference.named_parameters():
                if name == "values":
                    continue
                averaged = sum(r[backend][case][name] for r in ranks) / world  # what DDP would do
                assert rel_err(averaged, param.grad) < 1e-5, (backend, case, name)


# ------------------------------------------------------------------------------- SMF steps
VOCAB, WIDTH, SEQ, ROWS = 40, 24, 5, 10


PAPER_LAYER = {"n_keys": 128, "heads": 4, "topk": 16, "key_dim": 256}  # d_model = value_dim = 896


class TinyModel(nn.Module):
    """embed -> h + alpha * memory(h) -> head; the memory values and alpha train (stage 2, +S)."""

    def __init__(self, width=WIDTH, **layer):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.memory = ProductKeyMemory(width, **(layer or {"n_keys": 8, "heads": 2, "topk": 4, "key_dim": 8,
                                                           "value_dim": 30}))
        self.alpha = nn.Parameter(torch.tensor(0.5))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens, valid):
        hidden = self.embed(tokens)
        return self.head(hidden + self.alpha * self.memory(hidden, valid_mask=valid))


def sparse_model(width=WIDTH, **layer):
    torch.manual_seed(0)
    model = TinyModel(width, **layer)
    model.requires_grad_(False)
    model.memory.values.requires_grad_(True)
    model.alpha.requires_grad_(True)
    return model


def smf_steps(num_steps=3, sequences=8):
    generator = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(num_steps):
        tokens = torch.randint(0, VOCAB, (sequences, SEQ), generator=generator)
        targets = torch.randint(0, VOCAB, (sequences, SEQ), generator=generator)
        lengths = torch.randint(2, SEQ + 1, (sequences,), generator=generator)
        steps.append((tokens, targets, torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)))
    return steps


def background(model):
    return random_background(model, documents=4, seed=2)


def summed_loss(model, tokens, targets, valid):
    logits = model(tokens, valid)
    losses = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    return (losses * valid.reshape(-1)).sum()


# how the rows' gradient is filled: rows selected before one micro-batch's backward; reads kept over two (and
# those rows updated by RowSparseSGD, at a rate that moves them as much as AdamW's 1e-2 does)
VARIANTS = ("early", "kept", "sgd")
ROW_OPTIMIZERS = {"early": ("adamw", 1e-2), "kept": ("adamw", 1e-2), "sgd": ("sgd", 3.0)}


def run_smf(model, wrapped, steps, ranks_slice, scale, *, variant, rows=ROWS):
    """SMF steps over this process's sequences, 2 micro-batches each unless the variant is "early" (one
    micro-batch, rows selected before the backward); clipping at a norm small enough to act. Returns the
    selected rows per step."""
    early = variant == "early"
    controller = SparseMemoryController(model, rule="kl", rows_per_step=rows, background=background(model))
    name, lr = ROW_OPTIMIZERS[variant]
    optimizer = {"adamw": RowSparseAdamW, "sgd": RowSparseSGD}[name]([model.memory.values, model.alpha], lr=lr,
                                                                    weight_decay=1e-2)
    selected = []
    for tokens, targets, valid in steps:
        tokens, targets, valid = tokens[ranks_slice], targets[ranks_slice], valid[ranks_slice]
        normaliser = int(valid.sum()) if scale is None else scale(valid)
        controller.begin_step(fill="rows_first" if early else "reads_kept")
        chunks = 1 if early else 2
        for chunk in zip(tokens.chunk(chunks), targets.chunk(chunks), valid.chunk(chunks)):
            loss = summed_loss(wrapped, *chunk) / normaliser
            if early:
                controller.select_rows()
            loss.backward()
        selected.append(controller.finish_step(optimizer, max_grad_norm=0.05)["memory"])
    return selected


def _smf_job(rank, world, tmp_path):
    steps = smf_steps()
    results = {}
    for variant in VARIANTS:
        model = sparse_model()
        assert shard_memories(model) == ["memory"]
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ddp_ignored_names(model))
        wrapped = nn.parallel.DistributedDataParallel(model)
        per_rank = 8 // world
        totals = [int(valid.sum()) for _, _, valid in steps]
        step_index = iter(range(len(steps)))
        # every rank divides by the global token count / world (DDP averages): the global token mean results
        selected = run_smf(model, wrapped, steps, slice(rank * per_rank, (rank + 1) * per_rank),
                           lambda valid: totals[next(step_index)] / world, variant=variant)
        results[variant] = {"selected": selected, "values": model.memory.values.detach().clone(),
                          "alpha": model.alpha.detach().clone()}
        del wrapped
    torch.save(results, tmp_path / f"smf-{world}-{rank}.pt")


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_smf_steps_select_the_same_rows_and_end_with_the_same_weights(ranks_dir, world):
    ranks = [torch.load(ranks_dir / f"smf-{world}-{rank}.pt") for rank in range(world)]
    bounds = column_bounds(30, world)
    for variant in VARIANTS:
        model = sparse_model()
        start = model.memory.values.detach().clone()
        chunks = 1 if variant == "early" else 2
        steps = [[(*chunk, int(valid.sum())) for chunk in zip(tokens.chunk(chunks), targets.chunk(chunks),
                                                               valid.chunk(chunks))]
                 for tokens, targets, valid in smf_steps()]
        name, lr = ROW_OPTIMIZERS[variant]
        reference = dense_reference(model, steps, lambda m, b: summed_loss(m, *b[:3]) / b[3], background(model),
                                    rule="kl", rows_per_step=ROWS, lr=lr, weight_decay=1e-2, max_grad_norm=0.05,
                                    optimizer=name)
        selected = run_smf(model, model, smf_steps(), slice(None), None, variant=variant)
        assert all(torch.equal(a, b["memory"]) for a, b in zip(selected, reference["rows"]))
        assert rel_err(model.memory.values.detach().double(), reference["params"]["memory.values"]) < 1e-5
        assert all(rows.numel() == ROWS for rows in selected)
        moved = (model.memory.values.detach() != start).any(1).nonzero().flatten()
        assert moved.tolist() == torch.cat(selected).unique().tolist()  # only the selected rows moved
        unselected = torch.ones(model.memory.num_slots, dtype=torch.bool)
        unselected[torch.cat(selected)] = False
        for rank, result in enumerate(ranks):
            got = result[variant]
            assert all(torch.equal(a, b) for a, b in zip(got["selected"], selected)), (variant, rank)
            columns = slice(bounds[rank], bounds[rank + 1])
            assert rel_err(got["values"], model.memory.values.detach()[:, columns]) < 1e-6, (variant, rank)
            assert torch.equal(got["values"][unselected], start[:, columns][unselected])  # bit-identical
            assert abs(got["alpha"].item() - model.alpha.item()) < 1e-6


def _dense_job(rank, world, tmp_path):
    """Every memory parameter trains with dense gradients and torch AdamW (the retrofit's update)."""
    torch.manual_seed(0)
    model = TinyModel()
    shard_memories(model)
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ddp_ignored_names(model))
    wrapped = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for tokens, targets, valid in smf_steps(2):
        per_rank = 8 // world
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        (summed_loss(wrapped, tokens[mine], targets[mine], valid[mine]) / (int(valid.sum()) / world)).backward()
        clip_sharded_grad_norm_(list(model.parameters()), 0.05)
        optimizer.step()
        optimizer.zero_grad()
    torch.save({name: p.detach() for name, p in model.named_parameters()}, tmp_path / f"dense-{rank}.pt")


def test_sharded_dense_steps_match_one_process(two_ranks):
    """The retrofit's path: dense value gradients on the shards, DDP on everything else, global-norm clipping."""
    world = 2
    ranks = [torch.load(two_ranks / f"dense-{rank}.pt") for rank in range(world)]
    torch.manual_seed(0)
    model = TinyModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for tokens, targets, valid in smf_steps(2):
        (summed_loss(model, tokens, targets, valid) / int(valid.sum())).backward()
        clip_sharded_grad_norm_(list(model.parameters()), 0.05)
        optimizer.step()
        optimizer.zero_grad()
    bounds = column_bounds(30, world)
    for name, param in model.named_parameters():
        for rank, result in enumerate(ranks):
            expected = param.detach()[:, bounds[rank]:bounds[rank + 1]] if name == "memory.values" else param.detach()
            assert rel_err(result[name], expected) < 1e-5, (name, rank)


# ------------------------------------------------------------------------------- checkpoints
def _save_job(rank, world, tmp_path):
    model = sparse_model()
    shard_memories(model)
    controller = SparseMemoryController(model, rule="kl", rows_per_step=ROWS, background=background(model))
    optimizer = RowSparseAdamW([model.memory.values, model.alpha], lr=1e-2)
    steps = smf_steps(2)
    per_rank = 8 // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for tokens, targets, valid in steps:
        controller.begin_step(fill="rows_first")
        loss = summed_loss(model, tokens[mine], targets[mine], valid[mine]) / (int(valid.sum()) / world)
        controller.select_rows()
        loss.backward()
        controller.finish_step(optimizer)
    save_shard(tmp_path / "shards" / f"rank-{rank}.pt", model, optimizer)
    full = model.memory.gather_values(0)
    if rank == 0:
        state = optimizer.state[model.memory.values]
        torch.save({"optimizer": replicated_optimizer_state(model, optimizer), "values": full,
                    "row_step": state["row_step"].clone()}, tmp_path / "replicated.pt")
    torch.save({key: value.clone() for key, value in optimizer.state[model.memory.values].items()},
               tmp_path / f"state-{world}-{rank}.pt")


def _load_job(rank, world, tmp_path):
    model = sparse_model()
    shard_memories(model)
    optimizer = RowSparseAdamW([model.memory.values, model.alpha], lr=1e-2)
    saved = torch.load(tmp_path / "replicated.pt")
    paths = sorted((tmp_path / "shards").glob("rank-*.pt"))
    load_shards(paths, model, optimizer, saved["optimizer"])
    torch.save({"values": model.memory.values.detach().clone(),
                "state": {key: value.clone() for key, value in optimizer.state[model.memory.values].items()}},
               tmp_path / f"loaded-{world}-{rank}.pt")


def test_a_checkpoint_written_by_four_ranks_loads_on_two_and_on_one(four_ranks, two_ranks):
    tmp_path = four_ranks  # the 4 ranks wrote the checkpoint there, the 2 ranks of two_ranks loaded it
    saved = torch.load(tmp_path / "replicated.pt")
    full_state = {key: torch.cat([torch.load(tmp_path / f"state-4-{rank}.pt")[key] for rank in range(4)], dim=1)
                  for key in ("exp_avg", "exp_avg_sq")}
    assert float(full_state["exp_avg"].abs().sum()) > 0  # the steps left state behind
    bounds = column_bounds(30, 2)
    for rank in range(2):
        loaded = torch.load(tmp_path / f"loaded-2-{rank}.pt")
        columns = slice(bounds[rank], bounds[rank + 1])
        assert torch.equal(loaded["values"], saved["values"][:, columns])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["state"][key], full_state[key][:, columns])
        assert torch.equal(loaded["state"]["row_step"], saved["row_step"])
    # one process, no process group: the sharded memory holds every column
    _load_job(0, 1, tmp_path)
    loaded = torch.load(tmp_path / "loaded-1-0.pt")
    assert torch.equal(loaded["values"], saved["values"])
    assert all(torch.equal(loaded["state"][key], full_state[key]) for key in ("exp_avg", "exp_avg_sq"))
    with pytest.raises(ValueError, match="ranks 0..W-1"):
        load_shards(sorted((tmp_path / "shards").glob("rank-*.pt"))[:3], sparse_model(), None, None)


# ------------------------------------------------------------------------------- the paper's layer, 4 ranks vs 1
def _paper_job(rank, world, tmp_path):
    model = sparse_model(896, **PAPER_LAYER)
    shard_memories(model)
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ddp_ignored_names(model))
    wrapped = nn.parallel.DistributedDataParallel(model)
    steps = smf_steps()
    totals = iter([int(valid.sum()) / world for _, _, valid in steps])
    per_rank = 8 // world
    selected = run_smf(model, wrapped, steps, slice(rank * per_rank, (rank + 1) * per_rank),
                       lambda valid: next(totals), variant="kept", rows=512)
    torch.save({"selected": selected, "values": model.memory.values.detach().clone(),
                "alpha": model.alpha.detach().clone()}, tmp_path / f"paper-{rank}.pt")
    del wrapped


def test_the_paper_layer_at_world_size_four_selects_the_same_rows_as_one_process(four_ranks):
    """Paper sizes (16,384 slots x 896, 4 heads, top-16, key_dim 256), three steps of 2 accumulated
    micro-batches: the same rows every step, and weights within fp32 rounding."""
    model = sparse_model(896, **PAPER_LAYER)
    start = model.memory.values.detach().clone()
    selected = run_smf(model, model, smf_steps(), slice(None), None, variant="kept", rows=512)
    assert all(rows.numel() == 512 for rows in selected)
    bounds = column_bounds(896, 4)
    values = model.memory.values.detach()
    for rank in range(4):
        got = torch.load(four_ranks / f"paper-{rank}.pt")
        assert all(torch.equal(a, b) for a, b in zip(got["selected"], selected)), rank
        columns = slice(bounds[rank], bounds[rank + 1])
        moved = values[:, columns] - start[:, columns]
        assert rel_err(got["values"] - start[:, columns], moved) < 1e-5, rank  # the updates themselves agree
        assert abs(got["alpha"].item() - model.alpha.item()) < 1e-6


# ------------------------------------------------------------------------------- one process, no process group
def test_without_torch_distributed_a_sharded_memory_is_the_whole_layer():
    torch.manual_seed(0)
    reference = ProductKeyMemory(**LAYER, backend="torch")
    torch.manual_seed(0)
    sharded = ShardedProductKeyMemory(**LAYER, backend="torch")
    assert (sharded.shard.rank, sharded.shard.size, sharded.values.shape) == (0, 1, (64, 30))
    assert sharded.config() == reference.config()
    x, probe, valid = layer_inputs()
    for memory in (reference, sharded):
        (memory(x, valid_mask=valid) * probe).sum().backward()
    for name, param in reference.named_parameters():
        assert torch.equal(sharded.get_parameter(name), param)
        assert torch.equal(sharded.get_parameter(name).grad, param.grad), name
    assert placement_of(sharded.values).copies(4) == 4  # one shard holding everything: an ordinary replicated table
    rng = torch.get_rng_state()
    copy = ShardedProductKeyMemory.from_memory(reference)
    assert torch.equal(rng, torch.get_rng_state()), "converting draws no random numbers"
    assert all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), reference.state_dict().values()))


def test_sharding_misuse_raises():
    with pytest.raises(ValueError, match="parts must be an int in"):
        column_bounds(3, 4)
    assert column_bounds(30, 4) == [0, 8, 16, 23, 30]
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        ColumnShard.of_group(30, group=object())
    with pytest.raises(ValueError, match="no unsharded ProductKeyMemory"):
        shard_memories(nn.Linear(2, 2))
    model = TinyModel()
    shard_memories(model)
    with pytest.raises(ValueError, match="sharded already"):
        ShardedProductKeyMemory.from_memory(model.memory)
    split = nn.Parameter(torch.zeros(4, 2))
    setattr(split, "_smf_column_shard", ColumnShard(4, 0, 2, (0, 2, 4)))
    with pytest.raises(ValueError, match="split over 2 ranks but gradients are averaged over 4"):
        placement_of(split).copies(4)
    assert placement_of(split).copies(2) == 1
