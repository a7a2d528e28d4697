"""The tiny preset: byte-level tokenizer with Qwen-2.5's special tokens, and a tiny Qwen-2."""
import random

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from smf.tiny import EOS_TOKEN, PAD_TOKEN, TINY_MEMORY_LAYERS, save_tiny_pretrained, tiny_model, tiny_tokenizer


def test_tokenizer_round_trips_arbitrary_text_byte_by_byte():
    tokenizer = tiny_tokenizer()
    rng = random.Random(0)
    text = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0xA0, 0x3000)])) for _ in range(200))
    ids = tokenizer(text).input_ids
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_tokenizer_special_tokens_and_padding_sides():
    tokenizer = tiny_tokenizer()
    assert len(tokenizer) == 259
    assert tokenizer.pad_token == PAD_TOKEN and tokenizer.pad_token_id == 256
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.eos_token_id == 258
    assert tokenizer("x<|im_end|>").input_ids == [ord("x"), 258]
    right = tokenizer(["ab", "abcd"], padding=True)
    assert right["input_ids"][0] == [97, 98, 256, 256] and right["attention_mask"][0] == [1, 1, 0, 0]
    tokenizer.padding_side = "left"
    left = tokenizer(["ab", "abcd"], padding=True)
    assert left["input_ids"][0] == [256, 256, 97, 98] and left["attention_mask"][0] == [0, 0, 1, 1]


def test_chat_template_is_chatml():
    tokenizer = tiny_tokenizer()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_model_is_seeded_and_reloads_by_path(tmp_path):
    model = tiny_model(seed=0)
    assert model.config.num_hidden_layers > max(TINY_MEMORY_LAYERS)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 259, (2, 12))
    logits = model(ids).logits
    assert logits.shape == (2, 12, 259)
    assert torch.equal(tiny_model(seed=0)(ids).logits, logits)
    assert not torch.equal(tiny_model(seed=1)(ids).logits, logits)

    save_tiny_pretrained(tmp_path, seed=0)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(reloaded(ids).logits, logits)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer("héllo<|im_end|>").input_ids == list("héllo".encode()) + [258]
    assert tokenizer.pad_token_id == 256 and tokenizer.chat_template is not None


def test_preset_data_ship_with_the_package_and_are_the_test_fixtures():
    """--preset tiny and `smf suite --config tiny` read smf/assets/tiny (package data), never tests/; those
    files are the fixtures of the same names (make_fixtures.py writes both)."""
    from pathlib import Path

    import smf
    from smf.suite.config import load_suite_config
    from smf.train.config import TINY_PRESET

    fixtures, tiny_data = Path(__file__).parent / "fixtures", Path(smf.__file__).resolve().parent / "assets" / "tiny"
    suite = load_suite_config("tiny")
    paths = [TINY_PRESET["oasst_path"], TINY_PRESET["medmcqa_path"], *filter(None, vars(suite.data).values())]
    for path in map(Path, paths):
        assert path.parent == tiny_data and path.read_bytes() == (fixtures / path.name).read_bytes(), path
