"""Memories inside a real (tiny) Qwen2ForCausalLM: modes, padding, freezing, adapters, errors."""
import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

from smf.model import (
    MemoryBlock,
    apply_lora,
    attach_memories,
    configure_trainable,
    count_parameters,
    load_base,
    load_with_adapter,
    memory_blocks,
    save_memory_adapter,
)
from smf.tiny import TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS, save_tiny_pretrained, tiny_model

VOCAB = 259


def _rel(out, ref):
    return ((out - ref).norm() / ref.norm()).item()


def _counts(model):
    return torch.stack([block.memory.read_counts.clone() for block in memory_blocks(model)])


def _start_counting(model):
    for block in memory_blocks(model):
        block.memory.reset_read_counts()
        block.memory.set_read_counting(True)


def test_additive_with_alpha_zero_leaves_logits_unchanged():
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (2, 9))
    ref = model(ids).logits
    blocks = attach_memories(model, TINY_MEMORY_LAYERS, "additive", alpha_init=0.0, **TINY_MEMORY_KWARGS)
    assert torch.equal(model(ids).logits, ref)
    with torch.no_grad():
        for block in blocks:
            block.alpha.fill_(0.5)
    assert _rel(model(ids).logits, ref) > 1e-3


def test_additive_block_is_mlp_plus_alpha_times_memory_and_defaults_alpha():
    model = tiny_model()
    blocks = attach_memories(model, (3,), "additive+s", **TINY_MEMORY_KWARGS)
    block = model.model.layers[3].mlp
    assert blocks == [block] and isinstance(block, Qwen2MLP) and block.alpha.item() == pytest.approx(0.01)
    assert block.memory.values.dtype == torch.float32 and block.memory.d_model == 64
    hidden = torch.randn(2, 5, 64)
    ref = Qwen2MLP.forward(block, hidden) + 0.01 * block.memory(hidden)
    assert torch.equal(block.mlp_forward(hidden), Qwen2MLP.forward(block, hidden))
    assert _rel(block(hidden), ref) < 1e-6


def test_replacement_drops_the_mlp():
    model = tiny_model()
    total_before = count_parameters(model)["total"]
    mlp_size = sum(p.numel() for p in model.model.layers[2].mlp.parameters())
    blocks = attach_memories(model, TINY_MEMORY_LAYERS, "replacement", **TINY_MEMORY_KWARGS)
    for index in range(8):
        mlp = model.model.layers[index].mlp
        assert isinstance(mlp, MemoryBlock if index in TINY_MEMORY_LAYERS else Qwen2MLP)
    assert all(not block.has_mlp and block.alpha is None for block in blocks)
    memory_size = sum(p.numel() for p in blocks[0].memory.parameters())
    assert count_parameters(model)["total"] == total_before + 3 * (memory_size - mlp_size)
    hidden = torch.randn(3, 4, 64)
    assert torch.equal(blocks[0](hidden), blocks[0].memory(hidden))


def test_padding_is_not_counted_as_reads_through_the_model():
    model = tiny_model()
    attach_memories(model, TINY_MEMORY_LAYERS, "additive", **TINY_MEMORY_KWARGS)
    sequences = [torch.randint(0, VOCAB - 3, (n,)) for n in (7, 4, 10)]
    _start_counting(model)
    for seq in sequences:
        model(seq[None])
    expected = _counts(model)
    assert expected.sum() == 3 * (7 + 4 + 10) * 2 * 4  # layers * tokens * heads * topk

    length = max(len(s) for s in sequences)
    ids = torch.full((3, length), 256)
    mask = torch.zeros(3, length, dtype=torch.long)
    for row, seq in enumerate(sequences):  # right padding, as in training
        ids[row, :len(seq)] = seq
        mask[row, :len(seq)] = 1
    _start_counting(model)
    model(input_ids=ids, attention_mask=mask)
    assert torch.equal(_counts(model), expected)
    assert all(block.attention_mask is None for block in memory_blocks(model))

    _start_counting(model)
    model(ids)  # no mask: every position is a real token
    assert _counts(model).sum() == 3 * 3 * length * 2 * 4


def test_generation_with_kv_cache_and_left_padding_counts_only_real_tokens():
    model = tiny_model()
    attach_memories(model, TINY_MEMORY_LAYERS, "additive", **TINY_MEMORY_KWARGS)
    prompts = [torch.randint(0, VOCAB - 3, (n,)) for n in (6, 3)]
    ids = torch.full((2, 6), 256)
    mask = torch.zeros(2, 6, dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding, as in generation
        ids[row, 6 - len(prompt):] = prompt
        mask[row, 6 - len(prompt):] = 1
    _start_counting(model)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         pad_token_id=256, eos_token_id=None)
    counted = _counts(model)

    _start_counting(model)
    for row, prompt in enumerate(prompts):
        generated = out[row, 6:]
        model(torch.cat([prompt, generated[:-1]])[None])  # the last new token is never fed back
    assert torch.equal(counted, _counts(model))


def _paper_size_model():
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        return Qwen2ForCausalLM(config)


@pytest.mark.parametrize("mode", ["replacement", "additive", "additive+s"])
def test_trainable_counts_per_stage_match_spec_at_paper_size(mode):
    model = _paper_size_model()
    assert configure_trainable(model, "full")["trainable"] == 494_032_768
    attach_memories(model, mode=mode)
    alphas = 0 if mode == "replacement" else 3
    assert configure_trainable(model, "retrofit")["trainable"] == 3 * 17_337_088 + alphas
    assert configure_trainable(model, "sparse")["trainable"] == 3 * 14_680_064 + (3 if mode == "additive+s" else 0)


@pytest.mark.parametrize("mode", ["replacement", "additive", "additive+s"])
def test_trainable_parameters_per_stage_tiny(mode):
    model = tiny_model()
    blocks = attach_memories(model, TINY_MEMORY_LAYERS, mode, **TINY_MEMORY_KWARGS)
    configure_trainable(model, "retrofit")
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    memory_names = {f"model.layers.{b.layer_index}.mlp.memory.{n}" for b in blocks
                    for n, _ in b.memory.named_parameters()}
    alpha_names = {f"model.layers.{b.layer_index}.mlp.alpha" for b in blocks if b.alpha is not None}
    assert trainable == memory_names | alpha_names
    configure_trainable(model, "sparse")
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    values = {f"model.layers.{b.layer_index}.mlp.memory.values" for b in blocks}
    assert trainable == values | (alpha_names if mode == "additive+s" else set())


def test_lora_targets_the_seven_projections_with_paper_count():
    assert count_parameters(apply_lora(_paper_size_model()))["trainable"] == 24 * 366_592
    peft_model = apply_lora(tiny_model())
    # per layer r * (in + out): q 64+64, k 64+32, v 64+32, o 64+64, gate/up 64+128, down 128+64
    assert count_parameters(peft_model)["trainable"] == 8 * 16 * (128 + 96 + 96 + 128 + 3 * 192)


@pytest.mark.parametrize("mode", ["replacement", "additive+s"])
def test_adapter_round_trip_gives_identical_logits(tmp_path, mode):
    base_dir = save_tiny_pretrained(tmp_path / "base")
    model, _ = load_base(str(base_dir))
    blocks = attach_memories(model, TINY_MEMORY_LAYERS, mode, **TINY_MEMORY_KWARGS)
    with torch.no_grad():  # move every saved tensor away from its init
        for block in blocks:
            for p in block.memory.parameters():
                p.add_(torch.randn_like(p) * 0.1)
            if block.alpha is not None:
                block.alpha.fill_(0.3)
    ids = torch.randint(0, VOCAB, (2, 8))
    ref = model(ids).logits
    save_memory_adapter(model, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "memory_adapter.json").read_text())
    assert config["mode"] == mode and config["layers"] == list(TINY_MEMORY_LAYERS)
    assert config["memory_kwargs"] == {**TINY_MEMORY_KWARGS, "value_dim": 64}
    assert config["base_model"] == str(base_dir)

    reloaded, _ = load_with_adapter(None, tmp_path / "adapter")  # the base model the adapter records
    assert torch.equal(load_with_adapter(str(base_dir), tmp_path / "adapter")[0](ids).logits, ref)
    assert torch.equal(reloaded(ids).logits, ref)


def test_bad_arguments_raise_clear_errors():
    model = tiny_model()
    with pytest.raises(ValueError, match="mode must be one of"):
        attach_memories(model, TINY_MEMORY_LAYERS, "parallel", **TINY_MEMORY_KWARGS)
    with pytest.raises(ValueError, match=r"\[0, 7\]"):
        attach_memories(model, (2, 8), **TINY_MEMORY_KWARGS)
    with pytest.raises(ValueError, match="non-negative"):
        attach_memories(model, (-1,), **TINY_MEMORY_KWARGS)
    with pytest.raises(ValueError, match="distinct"):
        attach_memories(model, (2, 2), **TINY_MEMORY_KWARGS)
    with pytest.raises(ValueError, match="has none"):
        configure_trainable(model, "sparse")
    attach_memories(model, TINY_MEMORY_LAYERS, **TINY_MEMORY_KWARGS)
    with pytest.raises(ValueError, match="already has memories"):
        attach_memories(model, (1,), **TINY_MEMORY_KWARGS)
    with pytest.raises(ValueError, match="stage must be one of"):
        configure_trainable(model, "lora")
    counts = configure_trainable(model, "full")  # a model with memories trains whole, memories included
    assert counts["trainable"] == counts["total"] and all(p.requires_grad for p in model.parameters())


def test_bf16_base_keeps_fp32_memories():
    model = tiny_model().to(torch.bfloat16)
    blocks = attach_memories(model, TINY_MEMORY_LAYERS, "additive", **TINY_MEMORY_KWARGS)
    assert blocks[0].memory.values.dtype == torch.float32 and blocks[0].alpha.dtype == torch.float32
    assert model(torch.randint(0, VOCAB, (1, 5))).logits.dtype == torch.bfloat16
