"""torch.compile with the default backend (Inductor), fullgraph, forward and backward, against eager.

Inductor compiles C++ on CPU, so the models are tiny and few. The sparse-rows path does not
compile as one graph (a sparse COO gradient cannot be traced); its breaks are counted here.
"""
import pytest
import torch
from transformers import Qwen2ForCausalLM

from helpers import rel_err
from smf.model import attach_memories, configure_trainable, memory_blocks
from smf.tiny import TINY_MEMORY_KWARGS, tiny_config
from smf_kernels import ProductKeyMemory
from smf_kernels.ops import weighted_gather

SMALL = dict(n_keys=8, heads=2, topk=3, key_dim=18)  # 64 slots, halves of 9


def test_backend_choice_is_marked_constant_as_torch_would_mark_it():
    """smf_kernels marks resolve_backend without importing torch._dynamo (about 1 s at import); the mark must be
    the one torch.compiler.assume_constant_result sets, or a compiled model would re-resolve it per call."""
    from smf_kernels.backends import _assume_constant_result, resolve_backend

    def ours():
        return 0

    def torchs():
        return 0

    _assume_constant_result(ours)
    torch.compiler.assume_constant_result(torchs)
    assert vars(ours) == vars(torchs) and vars(torchs)
    assert all(getattr(resolve_backend, name) == value for name, value in vars(torchs).items())


def test_weighted_gather_compiles_with_inductor():
    values = torch.randn(50, 24, requires_grad=True)
    indices = torch.randint(0, 50, (7, 5))
    weights = torch.softmax(torch.randn(7, 5), -1).requires_grad_(True)
    out = torch.compile(lambda: weighted_gather(values, indices, weights), fullgraph=True)()
    out.square().sum().backward()
    grads = values.grad.clone(), weights.grad.clone()
    values.grad = weights.grad = None
    eager = weighted_gather(values, indices, weights)
    eager.square().sum().backward()
    assert rel_err(out, eager) < 1e-6
    assert rel_err(grads[0], values.grad) < 1e-6 and rel_err(grads[1], weights.grad) < 1e-6


@pytest.mark.parametrize("counting", [False, True])
def test_memory_compiles_with_inductor(counting):
    mem = ProductKeyMemory(40, **SMALL)
    mem.set_read_counting(counting)
    x = torch.randn(2, 6, 40)
    valid = torch.rand(2, 6) > 0.3
    out = torch.compile(mem, fullgraph=True)(x, valid)
    out.square().sum().backward()
    compiled_grads = {name: p.grad.clone() for name, p in mem.named_parameters()}
    compiled_counts = mem.read_counts.clone()
    mem.zero_grad(set_to_none=True)
    mem.reset_read_counts()
    eager = mem(x, valid)
    eager.square().sum().backward()
    assert rel_err(out, eager) < 1e-6
    for name, p in mem.named_parameters():
        assert rel_err(compiled_grads[name], p.grad) < 1e-5, name
    assert torch.equal(compiled_counts, mem.read_counts)
    assert compiled_counts.sum() == (int(valid.sum()) * mem.heads * mem.topk if counting else 0)


def test_tiny_qwen2_with_memories_compiles_with_inductor():
    config = tiny_config()
    config.num_hidden_layers = 2
    model = Qwen2ForCausalLM(config).eval()
    attach_memories(model, layers=(1,), **TINY_MEMORY_KWARGS)
    memory = memory_blocks(model)[0].memory
    memory.set_read_counting(True)
    ids = torch.randint(0, 256, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    logits = torch.compile(model, fullgraph=True)(input_ids=ids, attention_mask=mask).logits
    logits.square().mean().backward()
    compiled_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    compiled_counts = memory.read_counts.clone()
    model.zero_grad(set_to_none=True)
    memory.reset_read_counts()
    eager = model(input_ids=ids, attention_mask=mask).logits
    eager.square().mean().backward()
    assert rel_err(logits, eager) < 1e-6
    for name, p in model.named_parameters():
        assert rel_err(compiled_grads[name], p.grad) < 1e-5, name
    assert torch.equal(compiled_counts, memory.read_counts) and compiled_counts.sum() == 15 * 2 * 4


def test_a_sparse_step_of_a_tiny_qwen2_compiles_whole_and_matches_eager():
    """The sparse step that torch.compile can take whole: the row-gradient sink, rows chosen by the backward from the
    step's counts (fixed T, no host sync). fullgraph=True fails on any graph break (the removed COO gradient had
    25-30 for 3 memories), mode="reduce-overhead" is what `smf train --compile` uses; the trained rows and values
    equal eager's."""
    from smf_kernels.sparse import BackgroundStats, RowSparseAdamW, SparseMemoryController

    def run(compiled):
        torch.manual_seed(0)
        config = tiny_config()
        config.num_hidden_layers = 2
        model = Qwen2ForCausalLM(config)
        attach_memories(model, layers=(1,), mode="additive+s", **TINY_MEMORY_KWARGS)
        configure_trainable(model, "sparse")
        controller = SparseMemoryController(model, rule="kl", rows_per_step=8)
        background = BackgroundStats.for_memories(controller.memories)
        for name, memory in controller.memories.items():
            background.add_batch(name, torch.randint(0, 3, (memory.num_slots,)))
        controller.set_background(background)
        optimizer = RowSparseAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        forward = torch.compile(model, mode="reduce-overhead", fullgraph=True) if compiled else model
        rows = []
        for _ in range(2):
            ids = torch.randint(0, 256, (2, 9))
            mask = torch.ones_like(ids)
            mask[1, 6:] = 0
            controller.begin_step(fill="rows_first")
            forward(input_ids=ids, attention_mask=mask).logits.float().square().mean().backward()
            rows.append(controller.finish_step(optimizer, max_grad_norm=1.0))
        return rows, {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}

    torch._dynamo.reset()
    (eager_rows, eager), (compiled_rows, compiled) = run(False), run(True)
    assert all(torch.equal(a[name], b[name]) for a, b in zip(eager_rows, compiled_rows) for name in a)
    for name, value in eager.items():
        assert rel_err(compiled[name], value) < 1e-5, name
