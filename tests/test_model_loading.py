"""smf.model.loading, the one home of model loading: what each kind of directory loads as, clear errors
for what it cannot load."""
import json

import pytest
import torch

from smf.errors import ConfigError
from smf.model import attach_memories, load_base, load_model, load_with_adapter, memory_blocks, save_memory_adapter
from smf.tiny import TINY_MEMORY_KWARGS, tiny_model


@pytest.fixture
def adapter(tmp_path):
    model, _ = load_base("tiny")
    attach_memories(model, (2, 5), "additive", **TINY_MEMORY_KWARGS)
    with torch.no_grad():
        memory_blocks(model)[0].alpha.fill_(0.5)
    return save_memory_adapter(model, tmp_path / "retrofit" / "final")


def test_each_kind_of_directory_loads_as_what_it_holds(adapter, tmp_path):
    base, tokenizer = load_base("tiny")
    assert not base.training and tokenizer.pad_token == "<|endoftext|>"
    for where in (adapter, adapter.parent):  # the adapter folder, or the retrofit run directory holding it
        model, _ = load_with_adapter("tiny", where)
        assert [b.layer_index for b in memory_blocks(model)] == [2, 5] and not model.training
        assert memory_blocks(model)[0].alpha.item() == 0.5
    assert memory_blocks(load_model("tiny", adapter)[0])[0].alpha.item() == 0.5
    tiny_model().save_pretrained(tmp_path / "finetuned")  # a full-finetune artefact: config.json
    assert memory_blocks(load_model("ignored", tmp_path / "finetuned")[0]) == []


def test_what_cannot_be_loaded_is_one_clear_error(adapter, tmp_path):
    with pytest.raises(ConfigError, match="trained on base model 'tiny' but --model is 'other'"):
        load_with_adapter("other", adapter)
    with pytest.raises(ConfigError, match="holds no memory adapter"):
        load_with_adapter("tiny", tmp_path)
    with pytest.raises(ConfigError, match="is none of: a training run directory"):
        load_model("tiny", tmp_path)
    with pytest.raises(ConfigError, match="no such directory"):
        load_model("tiny", tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"model '/no/such/model' cannot be loaded.*HF_HUB_OFFLINE"):
        load_base("/no/such/model")
    config = adapter / "memory_adapter.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model": None}))
    with pytest.raises(ConfigError, match="records no base model"):
        load_with_adapter(None, adapter)
