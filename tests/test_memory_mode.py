"""smf.model.set_memory_mode: an additive retrofit switched to +S (alpha trains) and back, recorded for saving;
replacement memories refused."""
import json

import pytest

from smf.model import attach_memories, configure_trainable, memory_blocks, save_memory_adapter, set_memory_mode
from smf.tiny import tiny_model
from smf.vocabulary import TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS


def test_additive_switches_to_plus_s_and_back(tmp_path):
    model = tiny_model()
    attach_memories(model, TINY_MEMORY_LAYERS, "additive", **TINY_MEMORY_KWARGS)
    configure_trainable(model, "sparse")
    assert not any(block.alpha.requires_grad for block in memory_blocks(model))
    set_memory_mode(model, "additive+s")
    assert all(block.mode == "additive+s" and block.alpha.requires_grad for block in memory_blocks(model))
    assert model.config.smf_memories["mode"] == "additive+s"
    save_memory_adapter(model, tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "memory_adapter.json").read_text())["mode"] == "additive+s"
    set_memory_mode(model, "additive")
    assert not any(block.alpha.requires_grad for block in memory_blocks(model))
    assert all(block.memory.values.requires_grad for block in memory_blocks(model))


def test_a_fresh_model_switches_before_its_trainable_setup():
    model = tiny_model()
    attach_memories(model, TINY_MEMORY_LAYERS, "additive", **TINY_MEMORY_KWARGS)
    set_memory_mode(model, "additive+s")
    configure_trainable(model, "sparse")
    assert all(block.alpha.requires_grad for block in memory_blocks(model))


def test_replacement_and_unknown_modes_are_refused():
    model = tiny_model()
    attach_memories(model, TINY_MEMORY_LAYERS, "replacement", **TINY_MEMORY_KWARGS)
    with pytest.raises(ValueError, match="'replacement' and 'additive\\+s' was asked"):
        set_memory_mode(model, "additive+s")
    with pytest.raises(ValueError, match="holds no memories"):
        set_memory_mode(tiny_model(), "additive+s")
