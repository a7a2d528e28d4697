"""Memory sizes scaled to the model (docs/own-data.md#memory-sizes): the paper's sizes at Qwen-2.5-0.5B (24 layers,
hidden 896, MLP width 4864: memories at layers 6, 12, 18, n_keys 128 (16,384 slots), 4 heads, topk 16, key_dim
256), and proportionate sizes elsewhere:

- ``layers``: the decoder layers at a quarter, half and three quarters of the depth (``L // 4``, ``L // 2``,
  ``3 * L // 4``, distinct; every layer of a model with fewer than 4);
- ``n_keys``: ``round(128 * sqrt(intermediate / 4864))`` (at least 2), so the value table keeps the paper's ratio to
  one MLP's parameters (slots grow with the MLP width);
- ``heads``: 4;
- ``topk``: ``min(16, n_keys // 2)`` (at least 1);
- ``key_dim``: the power of two nearest ``256 * hidden / 896``, within [16, 256].
"""
from __future__ import annotations

import math

from transformers import AutoConfig, PretrainedConfig, Qwen2Config

from smf.model.hf_auto import decoder_config
from smf.vocabulary import DEFAULT_MODEL, TINY_MODEL

PAPER_SIZES = {"hidden": 896, "intermediate": 4864, "layers": 24, "n_keys": 128, "heads": 4, "topk": 16,
               "key_dim": 256}


def scaled_layers(num_layers: int) -> tuple[int, ...]:
    """Memory layer indices at a quarter, half and three quarters of ``num_layers`` decoder layers."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if num_layers < 4:
        return tuple(range(num_layers))
    return tuple(sorted({num_layers // 4, num_layers // 2, 3 * num_layers // 4}))


def scaled_memory_kwargs(hidden_size: int, intermediate_size: int) -> dict[str, int]:
    """``n_keys``, ``heads``, ``topk`` and ``key_dim`` for a model of ``hidden_size`` and MLP ``intermediate_size``
    (the module docstring's rule)."""
    for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    n_keys = max(2, round(PAPER_SIZES["n_keys"] * math.sqrt(intermediate_size / PAPER_SIZES["intermediate"])))
    key_dim = 2 ** round(math.log2(PAPER_SIZES["key_dim"] * hidden_size / PAPER_SIZES["hidden"]))
    return {"n_keys": n_keys, "heads": PAPER_SIZES["heads"], "topk": max(1, min(PAPER_SIZES["topk"], n_keys // 2)),
            "key_dim": min(256, max(16, key_dim))}


def scaled_memory_sizes(config) -> dict:
    """``{"layers", "n_keys", "heads", "topk", "key_dim"}`` scaled to a transformers config (its text config's
    ``num_hidden_layers``, ``hidden_size`` and ``intermediate_size``; the MLP width defaults to 4x hidden)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = text.hidden_size
    intermediate = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    return {"layers": scaled_layers(text.num_hidden_layers), **scaled_memory_kwargs(hidden, intermediate)}


def paper_qwen_config() -> Qwen2Config:
    """Qwen-2.5-0.5B-Instruct's architecture (docs/method.md#public-datasets-and-the-fixtures), for accounting
    without downloading weights."""
    return Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
                       max_position_embeddings=32768)


def model_architecture(model: str) -> PretrainedConfig:
    """The transformers config of base model ``model`` without loading weights: built in for 'tiny' and the paper's
    Qwen (no download), else read from the local directory or the hub cache (OSError or ValueError if it cannot);
    of a model saved with memories (a base pretrained with them), its decoder's."""
    if model == TINY_MODEL:
        from smf.tiny import tiny_config  # defers transformers' Qwen-2 model code and tokenizers (about 1.5 s)

        return tiny_config()
    if model == DEFAULT_MODEL:
        return paper_qwen_config()
    return decoder_config(AutoConfig.from_pretrained(model))
