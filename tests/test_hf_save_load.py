"""save_pretrained of a model with memories records them; smf.model.from_pretrained and, once smf is
imported, a plain AutoModelForCausalLM.from_pretrained restore them."""
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from smf.model import TOKENIZER_SUBFOLDER, attach_memories, from_pretrained, memory_blocks, save_tokenizer
from smf.tiny import TINY_MEMORY_KWARGS, tiny_model, tiny_tokenizer


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
    # The backend the reload below names: logits compared bit for bit come from the same kernels.
    attach_memories(model, (2, 5), mode, backend="torch", **TINY_MEMORY_KWARGS)
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


def test_plain_auto_from_pretrained_loads_the_memories(tmp_path):
    """After ``import smf.model`` a plain AutoModelForCausalLM load returns the memories; the
    tokenizer saved beside them still loads with AutoTokenizer."""
    model = tiny_model()
    base_config = model.config
    attach_memories(model, (2,), "replacement", **TINY_MEMORY_KWARGS)
    assert type(base_config).model_type == "qwen2" and not hasattr(base_config, "smf_memories")  # caller's, untouched
    assert model.model.config is model.config and model.model.layers[0].self_attn.config is model.config
    _trained_looking(model)
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2_smf_memories"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert [b.layer_index for b in memory_blocks(loaded)] == [2] and memory_blocks(loaded)[0].mode == "replacement"
    ids = torch.randint(0, 256, (2, 7))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert AutoTokenizer.from_pretrained(tmp_path)("ab").input_ids == [97, 98]


def test_plain_auto_from_pretrained_without_smf_asks_for_trust_remote_code(tmp_path):
    """Without smf and without trust_remote_code, transformers refuses the directory's custom code (it never
    loads the base model silently); tests/test_hf_portable.py loads it with trust_remote_code=True."""
    model = tiny_model()
    attach_memories(model, (2,), "additive", **TINY_MEMORY_KWARGS)
    model.save_pretrained(tmp_path)
    save_tokenizer(tiny_tokenizer(), tmp_path)
    script = ("import sys\nfrom transformers import AutoModelForCausalLM\n"
              "try:\n    AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
              "except ValueError as err:\n    print('ERROR', err)\n"
              "assert not any(name.split('.')[0] == 'smf' for name in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert "ERROR" in result.stdout and "trust_remote_code=True" in result.stdout, result.stdout


def test_the_tokenizer_subfolder_loads_without_smf_with_no_prompt_or_warning(tmp_path):
    """A model with memories keeps a copy of its tokenizer in ``tokenizer/`` (no config.json there): a process
    without smf loads it with no custom-code prompt and no model-type warning (smf.model.saved_tokenizer)."""
    model = tiny_model()
    attach_memories(model, (2,), "additive", **TINY_MEMORY_KWARGS)
    model.save_pretrained(tmp_path)
    save_tokenizer(tiny_tokenizer(), tmp_path)
    copy = tmp_path / TOKENIZER_SUBFOLDER
    assert (copy / "tokenizer_config.json").is_file() and not (copy / "config.json").exists()
    script = ("import sys\nfrom transformers import AutoTokenizer\n"
              "tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], subfolder='tokenizer')\n"
              "print(tokenizer('ab').input_ids)\n"
              "assert not any(name.split('.')[0] == 'smf' for name in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path, stdin=subprocess.DEVNULL,
                            env={**os.environ, "TRANSFORMERS_VERBOSITY": "warning"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[97, 98]"
    assert "custom code" not in result.stderr and "model of type" not in result.stderr, result.stderr
    plain = tmp_path / "plain"  # a model without memories: no copy (its config.json is transformers' own)
    tiny_model().save_pretrained(plain)
    save_tokenizer(tiny_tokenizer(), plain)
    assert (plain / "tokenizer_config.json").is_file() and not (plain / TOKENIZER_SUBFOLDER).exists()


def test_from_pretrained_without_memories_is_a_plain_model(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (1, 5))
    loaded = from_pretrained(tmp_path)
    assert not memory_blocks(loaded) and torch.equal(loaded(ids).logits, model(ids).logits)


def test_from_pretrained_of_an_older_save_fails_naming_the_fix(tmp_path):
    """A config.json with smf_memories under the base model_type (before memory types existed)."""
    model = tiny_model()
    attach_memories(model, (2,), "additive", **TINY_MEMORY_KWARGS)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    with pytest.raises(ValueError, match="records smf_memories under model_type 'qwen2'.*'qwen2_smf_memories'"):
        from_pretrained(tmp_path)
