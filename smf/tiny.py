"""Tiny preset: a CPU-sized Qwen-2 model, a byte-level tokenizer, and memory sizes to match.

Everything the experiment suite runs on ``Qwen/Qwen2.5-0.5B-Instruct`` runs here too, on a
randomly initialised ``Qwen2ForCausalLM`` small enough for a laptop CPU. The tokenizer is
built in code (no asset): 256 byte tokens plus Qwen-2.5's three special tokens, with the same
roles as the real tokenizer (``<|endoftext|>`` pads, ``<|im_end|>`` ends a turn / is eos) and
a ChatML chat template in the same format as the real Instruct model's (minus its default
system prompt).
"""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from smf.vocabulary import TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS

__all__ = ["EOS_TOKEN", "PAD_TOKEN", "TINY_MEMORY_KWARGS", "TINY_MEMORY_LAYERS", "save_tiny_pretrained", "tiny_config",
           "tiny_model", "tiny_tokenizer"]

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, "<|im_start|>", EOS_TOKEN)

# ChatML, as used by Qwen-2.5-Instruct: <|im_start|>{role}\n{content}<|im_end|>\n per message.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """The 256 printable stand-in characters of byte-level BPE, indexed by byte value.

    Printable Latin-1 bytes map to themselves; every other byte maps to the next unused
    code point from 256 upwards (the convention ``pre_tokenizers.ByteLevel`` expects).
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    alphabet, extra = [], 0
    for byte in range(256):
        if byte in printable:
            alphabet.append(chr(byte))
        else:
            alphabet.append(chr(256 + extra))
            extra += 1
    return alphabet


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: ids 0-255 are bytes, 256-258 are SPECIAL_TOKENS. Right padding."""
    vocab = {char: byte for byte, char in enumerate(_byte_alphabet())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="right",
        model_max_length=1024,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(vocab_size: int | None = None) -> Qwen2Config:
    """Qwen-2 architecture at CPU size: hidden 64, 8 layers, 4 heads, 2 KV heads, tied embeddings."""
    tokenizer = tiny_tokenizer()
    return Qwen2Config(
        vocab_size=vocab_size if vocab_size is not None else len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    """Randomly initialised tiny Qwen2ForCausalLM (fp32, CPU, eval mode), reproducible per seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(tiny_config())
    return model.eval()


def save_tiny_pretrained(directory: str | Path, seed: int = 0) -> Path:
    """Write tiny_model(seed) and tiny_tokenizer() with save_pretrained, so that every code path
    can load the tiny preset by path exactly like a hub model. Returns the directory."""
    directory = Path(directory)
    tiny_model(seed).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory
