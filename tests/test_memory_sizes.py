"""Memory sizes scaled to the model: the paper's at Qwen-2.5-0.5B, proportionate elsewhere, by attach_memories and
by `smf retrofit` when no size is given; given sizes win."""
import pytest
from transformers import Qwen2Config

from smf.model import attach_memories, memory_blocks
from smf.model.sizes import paper_qwen_config, scaled_layers, scaled_memory_sizes
from smf.tiny import tiny_config, tiny_model
from smf.train.config import RunConfig


def test_the_paper_sizes_at_the_paper_model_and_proportionate_ones_elsewhere():
    assert scaled_memory_sizes(paper_qwen_config()) == {"layers": (6, 12, 18), "n_keys": 128, "heads": 4,
                                                        "topk": 16, "key_dim": 256}
    small = scaled_memory_sizes(Qwen2Config(hidden_size=128, intermediate_size=512, num_hidden_layers=4))
    assert small == {"layers": (1, 2, 3), "n_keys": 42, "heads": 4, "topk": 16, "key_dim": 32}
    assert scaled_layers(2) == (0, 1) and scaled_layers(8) == (2, 4, 6)
    with pytest.raises(ValueError, match="num_layers"):
        scaled_layers(0)


def test_attach_memories_scales_unset_sizes_and_keeps_given_ones():
    blocks = attach_memories(tiny_model())
    expected = scaled_memory_sizes(tiny_config())
    assert [b.layer_index for b in blocks] == list(expected["layers"])
    memory = blocks[0].memory
    assert (memory.n_keys, memory.heads, memory.topk, memory.key_dim) == tuple(
        expected[name] for name in ("n_keys", "heads", "topk", "key_dim"))
    model = tiny_model()
    attach_memories(model, [1], n_keys=6, key_dim=8)
    memory = memory_blocks(model)[0].memory
    assert (memory.n_keys, memory.topk, memory.key_dim, memory.heads) == (6, 3, 8, 4)  # topk: the rule's for n_keys 6


def test_smf_retrofit_options_resolve_to_the_scaled_sizes():
    resolved = RunConfig(output_dir="x", model="tiny").resolved("retrofit")
    expected = scaled_memory_sizes(tiny_config())
    assert resolved.layers == list(expected["layers"]) and resolved.n_keys == expected["n_keys"]
    paper = RunConfig(output_dir="x", heads=2).resolved("retrofit")
    assert (paper.layers, paper.n_keys, paper.heads, paper.topk, paper.key_dim) == ([6, 12, 18], 128, 2, 16, 256)


def test_a_model_whose_config_cannot_be_read_asks_for_the_sizes(tmp_path):
    from smf.errors import ConfigError

    with pytest.raises(ConfigError, match="--layers, --n-keys, --heads, --topk and --key-dim"):
        RunConfig(output_dir="x", model=str(tmp_path)).resolved("retrofit")  # a directory without config.json
    assert RunConfig(output_dir="x", model=str(tmp_path), layers=[0], n_keys=4, heads=1, topk=2,
                     key_dim=8).resolved("retrofit").n_keys == 4
