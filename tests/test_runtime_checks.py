"""Run-time guards: counted reads under gradient checkpointing, .to(dtype) with memories, string devices."""
import pytest
import torch

from smf.model import attach_memories, memory_blocks
from smf.tiny import TINY_MEMORY_KWARGS, tiny_model
from smf_kernels.backends import available_backends, unavailable_reason


def test_gradient_checkpointing_with_counted_reads_raises_and_without_counting_trains():
    model = tiny_model()
    blocks = attach_memories(model, (2,), "additive", **TINY_MEMORY_KWARGS)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 256, (2, 6))
    blocks[0].memory.set_read_counting(True)
    with pytest.raises(RuntimeError, match="gradient checkpointing.*count every read twice"):
        model(ids)
    with torch.no_grad():  # no backward, no recompute: counting is fine (e.g. background statistics)
        model(ids)
    assert blocks[0].memory.read_counts.sum() == 12 * 2 * 4
    blocks[0].memory.set_read_counting(False)
    model(ids).logits.square().mean().backward()
    assert blocks[0].memory.values.grad is not None


@pytest.mark.parametrize("convert", [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.bfloat16()])
def test_to_dtype_keeps_memories_fp32_and_exact(convert):
    model = tiny_model()
    attach_memories(model, (2, 5), "additive", **TINY_MEMORY_KWARGS)
    before = {k: v.clone() for k, v in memory_blocks(model)[0].state_dict().items()}
    convert(model)
    block = memory_blocks(model)[0]
    assert block.memory.values.dtype == torch.float32 and block.alpha.dtype == torch.float32
    assert block.up_proj.weight.dtype != torch.float32 and model.lm_head.weight.dtype != torch.float32
    for key, value in block.memory.state_dict().items():
        assert torch.equal(value, before["memory." + key]), key
    model.to(torch.float64)
    assert block.memory.values.dtype == torch.float32 and block.up_proj.weight.dtype == torch.float64


def test_backend_queries_take_string_devices():
    assert unavailable_reason("torch", "cpu") is None
    assert unavailable_reason("torch", "cpu") == unavailable_reason("torch", torch.device("cpu"))
    assert "torch" in available_backends("cpu")
