"""attach_memories on tiny decoder-only LMs of several architectures (README, "Other architectures")."""
import pytest
import torch
import transformers as tf
from torch import nn

from smf.model import attach_memories, from_pretrained, memory_blocks
from smf.tiny import TINY_MEMORY_KWARGS

SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {
    "llama": lambda: tf.LlamaConfig(**SIZES),
    "mistral": lambda: tf.MistralConfig(**SIZES),
    "qwen3": lambda: tf.Qwen3Config(**SIZES, head_dim=16),
    "gemma2": lambda: tf.Gemma2Config(**SIZES, head_dim=16),
    "gpt2": lambda: tf.GPT2Config(vocab_size=300, n_embd=64, n_layer=3, n_head=4, n_positions=64),
    "gpt_neox": lambda: tf.GPTNeoXConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                         num_attention_heads=4, max_position_embeddings=64),
    "falcon": lambda: tf.FalconConfig(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4),
}  # falcon: by smf.model.LAYOUTS alone (transformer.h[i].mlp)
OVERRIDES = {"gpt2": dict(layers_path="transformer.h", mlp_attr="mlp"),
             "gpt_neox": dict(layers_path="gpt_neox.layers", mlp_attr="mlp")}


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_attach_count_train_and_reload(arch, tmp_path):
    model = tf.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
    blocks = attach_memories(model, (1,), "additive", **TINY_MEMORY_KWARGS, **OVERRIDES.get(arch, {}))
    memory = blocks[0].memory
    memory.set_read_counting(True)
    ids = torch.randint(0, 300, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    logits = model(input_ids=ids, attention_mask=mask).logits
    assert memory.read_counts.sum() == 12 * memory.heads * memory.topk  # padding not counted
    logits.square().mean().backward()
    assert memory.values.grad is not None and memory.values.grad.abs().sum() > 0
    memory.set_read_counting(False)
    model.save_pretrained(tmp_path)
    reloaded = from_pretrained(tmp_path)
    assert [b.layer_index for b in memory_blocks(reloaded)] == [1]
    assert torch.equal(reloaded(input_ids=ids, attention_mask=mask).logits, model(input_ids=ids, attention_mask=mask).logits)
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # smf is imported: the memories come too
    assert [b.layer_index for b in memory_blocks(plain)] == [1]
    assert torch.equal(plain(input_ids=ids, attention_mask=mask).logits, model(input_ids=ids, attention_mask=mask).logits)


def test_unknown_layout_fails_naming_the_override():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = tf.LlamaConfig(**SIZES)
            self.blocks = nn.ModuleList(nn.Module() for _ in range(3))
            for block in self.blocks:
                block.ffn = nn.Linear(64, 64)

    with pytest.raises(ValueError, match="layers_path=.*mlp_attr="):
        attach_memories(Odd(), (1,), **TINY_MEMORY_KWARGS)
    blocks = attach_memories(Odd(), (1,), layers_path="blocks", mlp_attr="ffn", **TINY_MEMORY_KWARGS)
    assert isinstance(blocks[0], nn.Linear) and blocks[0].has_mlp and blocks[0].memory.d_model == 64
