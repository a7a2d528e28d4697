"""The exact sparse step against its oracle (tests/sparse_oracle.py): dense float64 gradients, AdamW (or SGD)
restricted to the selected rows. Every way the controller fills the rows' gradient, on every backend, with and
without gradient accumulation and clipping; DDP and sharded memories: tests/test_sparse_controller.py and
test_sharded_memory.py."""
import pytest
import torch
import torch.nn.functional as F

from helpers import MemoryLM, backends_under_test, random_background
from smf_kernels.sparse import RowSparseAdamW, RowSparseSGD, SparseMemoryController
from sparse_oracle import assert_matches_reference, dense_reference

VOCAB, WIDTH, SEQ, ROWS = 40, 16, 5, 10
LR, WEIGHT_DECAY = 1e-2, 0.1


def tiny_model(backend=None):
    return MemoryLM(VOCAB, WIDTH, n_keys=6, heads=2, topk=3, key_dim=8, value_dim=12, backend=backend)


def make_steps(num_steps, sequences, micro_batches, seed=1):
    """Per step: its micro-batches (tokens, targets, valid, normaliser), right padding, the loss a token mean
    over the step."""
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(num_steps):
        tokens = torch.randint(0, VOCAB, (sequences, SEQ), generator=generator)
        targets = torch.randint(0, VOCAB, (sequences, SEQ), generator=generator)
        lengths = torch.randint(2, SEQ + 1, (sequences,), generator=generator)
        valid = torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)
        total = valid.sum()
        steps.append([(*chunk, total) for chunk in zip(tokens.chunk(micro_batches), targets.chunk(micro_batches),
                                                        valid.chunk(micro_batches))])
    return steps


def loss_of(model, micro_batch):
    tokens, targets, valid, total = micro_batch
    logits = model(tokens, valid)
    losses = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    return (losses * valid.reshape(-1).to(losses.dtype)).sum() / total


def run_path(model, controller, optimizer, steps, path, max_grad_norm):
    """The steps through the controller, filling the rows' gradient by ``path``: "kept" (reads kept until the
    step's end), "selected" (rows selected before the backward, after a counting forward when the step
    has several micro-batches), "in-backward" (one micro-batch, rows chosen by the backward from the counts)."""
    selected = []
    for micro_batches in steps:
        if path == "kept":
            controller.begin_step()
            for micro_batch in micro_batches:
                loss_of(model, micro_batch).backward()
        else:
            controller.begin_step(fill="rows_first")
            if len(micro_batches) > 1:
                with torch.no_grad():
                    for tokens, _, valid, _ in micro_batches:
                        model(tokens, valid)
                controller.select_rows()
                for micro_batch in micro_batches:
                    loss_of(model, micro_batch).backward()
            else:
                loss = loss_of(model, micro_batches[0])
                if path == "selected":
                    controller.select_rows()
                loss.backward()
        selected.append(controller.finish_step(optimizer, max_grad_norm=max_grad_norm))
    return selected


OPTIMIZERS = {"adamw": RowSparseAdamW, "sgd": RowSparseSGD}


def check_against_oracle(backend, path, micro_batches, max_grad_norm, dtype, tol, num_steps=3, optimizer="adamw"):
    torch.manual_seed(0)
    model = tiny_model(backend).to(dtype)
    background = random_background(model, documents=5, seed=2)
    steps = make_steps(num_steps, sequences=4, micro_batches=micro_batches)
    reference = dense_reference(model, steps, loss_of, background, rule="kl", rows_per_step=ROWS, lr=LR,
                                weight_decay=WEIGHT_DECAY, max_grad_norm=max_grad_norm, optimizer=optimizer)
    start = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    controller = SparseMemoryController(model, rule="kl", rows_per_step=ROWS, background=background)
    optim = OPTIMIZERS[optimizer]([model.memory.values, model.alpha], lr=LR, weight_decay=WEIGHT_DECAY)
    rows = run_path(model, controller, optim, steps, path, max_grad_norm)
    assert model.memory.values.grad is None
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    state = optim.row_state(model.memory.values) if optimizer == "adamw" else optim.state[model.memory.values]
    assert_matches_reference(reference, rows, params, {"memory": state}, start, tol)


PATHS = [("kept", 3), ("selected", 3), ("selected", 1), ("in-backward", 1)]


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
@pytest.mark.parametrize("path, micro_batches", PATHS)
def test_the_exact_step_is_dense_adamw_restricted_to_the_selected_rows(path, micro_batches, max_grad_norm):
    """float64 tables: the same rows, the same values to 1e-10, nothing else moved (0.05 clips every step)."""
    check_against_oracle(None, path, micro_batches, max_grad_norm, torch.float64, 1e-10)


@pytest.mark.parametrize("backend", backends_under_test())
@pytest.mark.parametrize("path, micro_batches", [("kept", 2), ("selected", 1)])
def test_every_backend_makes_the_exact_step_in_float32(backend, path, micro_batches):
    check_against_oracle(backend, path, micro_batches, 0.05, torch.float32, 1e-5, num_steps=2)


@pytest.mark.parametrize("path, micro_batches", PATHS)
def test_the_exact_step_with_sgd_is_dense_sgd_restricted_to_the_selected_rows(path, micro_batches):
    """RowSparseSGD (--row-optimizer sgd), float64, clipped every step: the oracle's rows and values, and every
    other row bit-identical."""
    check_against_oracle(None, path, micro_batches, 0.05, torch.float64, 1e-10, optimizer="sgd")


@pytest.mark.parametrize("backend", backends_under_test())
def test_every_backend_makes_the_exact_sgd_step_in_float32(backend):
    check_against_oracle(backend, "kept", 2, None, torch.float32, 1e-5, num_steps=2, optimizer="sgd")
