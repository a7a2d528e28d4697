"""Memories built in bf16 or another dtype (``ProductKeyMemory(dtype=)``, ``attach_memories(dtype=)``; issue 56's
leftover): the value table is drawn in float32 a block of rows at a time and cast, so the memory equals, bit for bit,
a float32 memory built from the same seed and cast afterwards (the build that held every table in float32 first), and
the generator ends where that build leaves it."""
import pytest
import torch

from smf.model import attach_memories, memory_blocks
from smf.model.precision import cast_like_the_authors
from smf.tiny import TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS, tiny_model
from smf_kernels import ProductKeyMemory
from smf_kernels import memory as memory_module
from smf_kernels.memory import draw_normal_rows

# (d_model, n_keys, value_dim, values drawn per block): one block; several blocks, the last longer (a tail under
# 16 values joins it); blocks of 16 rows of an odd width; the whole table under 16 values (drawn in one call).
SHAPES = [(24, 7, 10, 1 << 22), (24, 7, 3, 64), (40, 9, 5, 100), (12, 3, 1, 16), (40, 5, None, 700)]


def _built(dtype, shape, **kwargs):
    d_model, n_keys, value_dim, _ = shape
    torch.manual_seed(11)
    memory = ProductKeyMemory(d_model, n_keys=n_keys, heads=2, topk=2, key_dim=6, value_dim=value_dim, dtype=dtype,
                              **kwargs)
    return memory, torch.rand(5)  # what the generator gives next


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_memory_built_in_another_dtype_is_the_float32_build_cast(monkeypatch, shape, dtype):
    monkeypatch.setattr(memory_module, "_DRAW_ELEMENTS", shape[3])
    reference, after_reference = _built(None, shape)
    memory, after = _built(dtype, shape)
    expected, state = reference.to(dtype).state_dict(), memory.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in state.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    assert memory.values.dtype == dtype and memory.read_counts.dtype == torch.int64
    assert torch.equal(after, after_reference)  # the same draws, in the same order
    assert memory.values.float().std() > 0  # never zeros


def test_blocks_draw_what_one_call_over_the_table_draws(monkeypatch):
    monkeypatch.setattr(memory_module, "_DRAW_ELEMENTS", 48)
    for rows, width in ((49, 3), (17, 1), (5, 3), (33, 16)):
        torch.manual_seed(2)
        whole = torch.empty(rows, width).normal_(std=0.3)
        torch.manual_seed(2)
        table, spans = torch.full((rows, width), float("nan")), []
        draw_normal_rows(rows, width, 0.3, "cpu", lambda start, stop, block: (table[start:stop].copy_(block),
                                                                              spans.append((start, stop))))
        assert torch.equal(table, whole), (rows, width)
        assert spans[0][0] == 0 and spans[-1][1] == rows and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert all((stop - start) * width % 16 == 0 for start, stop in spans[:-1])


@pytest.mark.parametrize("mode", ["additive+s", "replacement"])
def test_attach_memories_in_bf16_gives_the_fp32_memories_cast_like_the_authors(mode):
    reference, model = tiny_model(), tiny_model()
    torch.manual_seed(4)
    attach_memories(reference, TINY_MEMORY_LAYERS, mode, **TINY_MEMORY_KWARGS)
    cast_like_the_authors(reference)
    torch.manual_seed(4)
    blocks = attach_memories(model, TINY_MEMORY_LAYERS, mode, dtype=torch.bfloat16, **TINY_MEMORY_KWARGS)
    assert all(block.memory.values.dtype == torch.bfloat16 for block in blocks)
    assert all(block.alpha is None or block.alpha.dtype == torch.float32 for block in blocks)  # alpha: float32
    cast_like_the_authors(model)
    expected = reference.state_dict()
    assert all(torch.equal(tensor, expected[name]) and tensor.dtype == expected[name].dtype
               for name, tensor in model.state_dict().items())
    ids = torch.tensor([[3, 77, 140, 9, 201]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert [b.layer_index for b in memory_blocks(model)] == list(TINY_MEMORY_LAYERS)


@pytest.mark.parametrize("dtype", [torch.int32, "bfloat16", torch.bool])
def test_a_dtype_that_is_not_a_floating_torch_dtype_is_refused(dtype):
    with pytest.raises(ValueError, match=r"^dtype must be a floating torch.dtype or None, got"):
        ProductKeyMemory(16, n_keys=4, heads=1, topk=2, key_dim=4, dtype=dtype)
    with pytest.raises(ValueError, match=r"^dtype must be a floating torch.dtype"):
        attach_memories(tiny_model(), TINY_MEMORY_LAYERS, "additive", dtype=dtype, **TINY_MEMORY_KWARGS)
