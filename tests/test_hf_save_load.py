"""save_pretrained of a model with memories records them; smf.model.from_pretrained restores them."""
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from smf.model import attach_memories, from_pretrained, memory_blocks
from smf.tiny import TINY_MEMORY_KWARGS, tiny_model


def _trained_looking(model):
    """Move every memory parameter off its init so that a re-initialised memory would show."""
    with torch.no_grad():
        for block in memory_blocks(model):
            for p in block.memory.parameters():
                p.add_(torch.randn_like(p) * 0.1)
            if block.alpha is not None:
                block.alpha.fill_(0.7)


@pytest.mark.parametrize("mode", ["additive", "replacement"])
def test_save_pretrained_then_from_pretrained_keeps_memories(tmp_path, mode):
    model = tiny_model()
    attach_memories(model, (2, 5), mode, **TINY_MEMORY_KWARGS)
    _trained_looking(model)
    ids = torch.randint(0, 256, (2, 7))
    ref = model(ids).logits
    model.save_pretrained(tmp_path)
    saved = (tmp_path / "config.json").read_text()
    assert '"smf_memories"' in saved and '"layers": [\n      2,\n      5\n    ]' in saved

    loaded = from_pretrained(tmp_path, backend="torch")
    blocks = memory_blocks(loaded)
    assert [b.layer_index for b in blocks] == [2, 5] and blocks[0].mode == mode
    assert blocks[0].memory.config() == memory_blocks(model)[0].memory.config()
    assert torch.equal(loaded(ids).logits, ref)
    loaded_bf16 = from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert memory_blocks(loaded_bf16)[0].memory.values.dtype == torch.float32
    assert torch.equal(memory_blocks(loaded_bf16)[0].memory.values, memory_blocks(model)[0].memory.values)


def test_plain_auto_from_pretrained_names_the_memories(tmp_path):
    """Plain transformers does not know the memories; its load report must name them (it warns)."""
    model = tiny_model()
    attach_memories(model, (2,), "replacement", **TINY_MEMORY_KWARGS)
    model.save_pretrained(tmp_path)
    records = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = lambda record: records.append(record)
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    finally:
        hf_logger.removeHandler(handler)
    warnings = [record.getMessage() for record in records if record.levelno >= logging.WARNING]
    assert any("model.layers.2.mlp.memory.values" in w and "UNEXPECTED" in w for w in warnings), warnings


def test_from_pretrained_without_memories_is_a_plain_model(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (1, 5))
    loaded = from_pretrained(tmp_path)
    assert not memory_blocks(loaded) and torch.equal(loaded(ids).logits, model(ids).logits)
