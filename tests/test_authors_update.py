"""The authors' sparse update (AuthorsSparseUpdate) against a step written out by hand: counts of each
micro-batch including padding, rows chosen per micro-batch, each backward masked by its own rows,
dense AdamW; and the rows it moves outside its selection, which the exact update never does."""
import json

import pytest
import torch
from torch import nn

from smf.train import train
from smf.train.checkpoint import LOG_FILE
from helpers import random_background
from smf_kernels import ProductKeyMemory
from smf_kernels.sparse import (AuthorsSparseUpdate, RowSparseAdamW, SparseMemoryController,
                                rows_moved_outside, score_slots, select_top_rows)
from test_train_recipes import tiny_run_config, write_adapter_and_background

pytestmark = pytest.mark.usefixtures("one_thread")
D_MODEL, T = 24, 6


class Wrapper(nn.Module):
    """One memory called the way MemoryBlock calls it: with a valid_mask that marks padding."""

    def __init__(self):
        super().__init__()
        self.memory = ProductKeyMemory(D_MODEL, n_keys=8, heads=2, topk=3, key_dim=16)

    def forward(self, x, valid):
        return self.memory(x, valid_mask=valid)


def background_for(model):
    return random_background(model, documents=5, seed=0, most=3)


def micro_batches(seed):
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(2):
        x = torch.randn(3, 7, D_MODEL, generator=generator)
        valid = torch.ones(3, 7, dtype=torch.bool)
        valid[0, 4:] = False  # right padding
        valid[2, 2:] = False
        batches.append((x, valid))
    return batches


def loss_of(model, x, valid):
    return (model(x, valid) ** 2 * valid[..., None]).sum()


@pytest.mark.parametrize("rule", ["kl", "tfidf"])
def test_one_step_equals_the_step_written_out(rule):
    torch.manual_seed(0)
    model, reference = Wrapper(), Wrapper()
    reference.load_state_dict(model.state_dict())
    stats = background_for(model)
    for m in (model, reference):
        m.requires_grad_(False)
        m.memory.values.requires_grad_(True)
    update = AuthorsSparseUpdate(model, rule=rule, rows_per_step=T, background=stats)
    optimizer = torch.optim.AdamW([model.memory.values], lr=1e-2, weight_decay=0.0)
    ref_optimizer = torch.optim.AdamW([reference.memory.values], lr=1e-2, weight_decay=0.0)
    num_slots = model.memory.num_slots
    for step in range(3):
        batches = micro_batches(step)
        update.begin_step()
        for x, valid in batches:
            loss = loss_of(model, x, valid)
            update.after_forward()
            loss.backward()
        selected = update.finish_step(optimizer, max_grad_norm=1.0)

        # By hand: counts over every position (padding too), top-T of that micro-batch, its gradient masked.
        grad, union = torch.zeros_like(reference.memory.values), torch.zeros(num_slots, dtype=torch.bool)
        for x, valid in batches:
            _, indices = reference.memory.lookup(x.reshape(-1, D_MODEL))
            counts = torch.bincount(indices.reshape(-1), minlength=num_slots)
            scores = score_slots(rule, counts, stats.doc_freq["memory"], stats.reads["memory"],
                                 stats.num_batches["memory"])
            rows = select_top_rows(scores, counts, T)
            (micro_grad,) = torch.autograd.grad(loss_of(reference, x, valid), reference.memory.values)
            keep = torch.zeros(num_slots, dtype=torch.bool)
            keep[rows] = True
            grad += micro_grad * keep[:, None]
            union |= keep
        reference.memory.values.grad = grad
        torch.nn.utils.clip_grad_norm_([reference.memory.values], 1.0)
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
        assert torch.equal(selected["memory"], union.nonzero().squeeze(1))
        torch.testing.assert_close(model.memory.values, reference.memory.values, rtol=1e-5, atol=1e-6)
    assert model.memory.count_reads is False and model.memory.read_counts.sum() == 0


def test_abort_step_discards_a_step_whose_forward_raised():
    torch.manual_seed(0)
    model = Wrapper()
    model.requires_grad_(False)
    model.memory.values.requires_grad_(True)
    update = AuthorsSparseUpdate(model, rule="kl", rows_per_step=T, background=background_for(model))
    x, valid = micro_batches(0)[0]
    update.begin_step()
    loss_of(model, x, valid).backward()  # a first micro-batch went through
    with pytest.raises(IndexError):  # the second one's loss raises after the memory counted its reads
        model(x, valid)[..., D_MODEL]
    with pytest.raises(RuntimeError, match="abort_step"):
        update.begin_step()
    update.abort_step()
    assert model.memory.values.grad is None and not model.memory.count_reads and model.memory.read_counts.sum() == 0
    assert not model.memory._forward_pre_hooks  # the padding-counting hook is gone
    update.abort_step()  # nothing in progress: a no-op
    update.begin_step()
    loss_of(model, x, valid)
    update.after_forward()
    update.finish_step(torch.optim.AdamW([model.memory.values], lr=1e-2))


def test_padding_is_counted_and_momentum_moves_unselected_rows():
    torch.manual_seed(1)
    model = Wrapper()
    model.requires_grad_(False)
    model.memory.values.requires_grad_(True)
    stats = background_for(model)
    update = AuthorsSparseUpdate(model, rule="kl", rows_per_step=T, background=stats)
    optimizer = torch.optim.AdamW([model.memory.values], lr=1e-2, weight_decay=0.0)
    x, valid = micro_batches(0)[0]
    update.begin_step()
    model(x, valid)
    counted = model.memory.read_counts.sum().item()
    update.after_forward()
    assert counted == x.shape[0] * x.shape[1] * 2 * 3  # every position, padding included: B*L*heads*topk
    update.finish_step(optimizer)

    exact_model = Wrapper()
    exact_model.load_state_dict(model.state_dict())
    exact_model.requires_grad_(False)
    exact_model.memory.values.requires_grad_(True)
    exact = SparseMemoryController(exact_model, rule="kl", rows_per_step=T, background=background_for(exact_model))
    exact_optimizer = RowSparseAdamW([exact_model.memory.values], lr=1e-2)
    moved = {"authors": [], "exact": []}
    for step in range(1, 4):
        for name, (m, controller, opt) in {"authors": (model, update, optimizer),
                                           "exact": (exact_model, exact, exact_optimizer)}.items():
            before = {"memory": m.memory.values.detach().clone()}
            controller.begin_step()
            for xb, vb in micro_batches(step):
                loss = loss_of(m, xb, vb)
                if name == "authors":
                    controller.after_forward()
                loss.backward()
            rows = controller.finish_step(opt)
            moved[name].append(rows_moved_outside(before, {"memory": m.memory.values.detach()}, rows))
    assert sum(moved["authors"]) > 0, moved  # the momentum of rows selected earlier keeps moving them
    assert moved["exact"] == [0, 0, 0]


def test_sparse_run_with_the_authors_update_logs_rows_moved(tmp_path):
    adapter = write_adapter_and_background(tmp_path / "adapter", "additive")
    overrides = {"n_examples": 8, "global_batch_size": 4, "micro_batch_size": 2, "epochs": 2, "lr": 1e-2,
                 "warmup_steps": 0, "adapter": str(adapter), "background": str(adapter), "protocol": "clean"}
    logs = {}
    for optimizer in ("authors", "exact"):
        config = tiny_run_config(tmp_path / optimizer, "train", "sparse", update=optimizer, **overrides)
        train(config)
        logs[optimizer] = [json.loads(line) for line in (tmp_path / optimizer / "sparse-run" / LOG_FILE).open()]
    assert len(logs["authors"]) == 4 and all("rows_moved_outside" in record for record in logs["authors"])
    assert sum(record["rows_moved_outside"] for record in logs["authors"][1:]) > 0
    # Two micro-batches choose up to 2 x T rows per layer; the exact update T per layer and moves no other.
    rows_per_step = config.rows_per_step
    assert any(record["selected_rows"] > 3 * rows_per_step for record in logs["authors"])
    assert all(record["selected_rows"] <= 3 * rows_per_step and record["rows_moved_outside"] == 0
               for record in logs["exact"])
