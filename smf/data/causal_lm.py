"""Prompt/target pairs -> token ids with loss labels, and the padding collator for training."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


def tokenize_example(tokenizer, prompt: str, target: str, max_length: int = 1024) -> dict:
    """{"input_ids", "labels"} (lists of int) for ``prompt + target + eos``.

    Prompt and target are tokenised separately (no special tokens added) so the boundary is
    exact; prompt positions get label -100, target tokens and the final eos are trained.
    Sequences longer than ``max_length`` are cut at the end.
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer needs an eos token: it ends every training target")
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    target_ids = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    input_ids = (prompt_ids + target_ids)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + target_ids)[:max_length]
    return {"input_ids": input_ids, "labels": labels}


def tokenize_text(tokenizer, text: str, max_length: int = 1024) -> dict:
    """{"input_ids", "labels"} for a plain text trained on every token: the tokenizer's own encoding
    (its usual special tokens, no eos appended) cut at ``max_length``; labels = input_ids (the
    authors' protocol, their smf_rebuild/datasets.py:105-111)."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    input_ids = tokenizer(text)["input_ids"][:max_length]
    return {"input_ids": input_ids, "labels": list(input_ids)}


def tokenize_examples(tokenizer, examples: list[dict], max_length: int = 1024) -> list[dict]:
    """:func:`tokenize_example` over dicts with "prompt" and "target", :func:`tokenize_text` over dicts
    with "text". Examples left with nothing to train on (a prompt filling ``max_length``; a text of
    <= 1 token, as the authors drop) are dropped, and the number dropped logged."""
    tokenized = [tokenize_text(tokenizer, ex["text"], max_length) if "text" in ex
                 else tokenize_example(tokenizer, ex["prompt"], ex["target"], max_length) for ex in examples]
    return trainable(tokenized, max_length)


def trainable(tokenized: list[dict], max_length: int) -> list[dict]:
    """The tokenized examples with something to train on (more than one token and a scored label after the
    first); the number dropped is logged."""
    kept = [ex for ex in tokenized
            if len(ex["input_ids"]) > 1 and any(label != IGNORE_INDEX for label in ex["labels"][1:])]
    if len(kept) < len(tokenized):
        logger.warning("dropped %d of %d examples with nothing to train on at max_length=%d",
                       len(tokenized) - len(kept), len(tokenized), max_length)
    return kept


@dataclass
class CausalLMCollator:
    """Pads a list of {"input_ids", "labels"} to the longest one.

    Returns LongTensors input_ids, attention_mask (1 = real token) and labels (-100 on padding),
    each (batch, longest). Right padding is the training default.
    """

    pad_token_id: int
    padding_side: str = "right"

    def __post_init__(self) -> None:
        if self.padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {self.padding_side!r}")
        if isinstance(self.pad_token_id, bool) or not isinstance(self.pad_token_id, int):
            raise ValueError(f"pad_token_id must be an int, got {self.pad_token_id!r}")

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("features must be a non-empty list")
        longest = max(len(f["input_ids"]) for f in features)
        batch = {"input_ids": [], "attention_mask": [], "labels": []}
        for feature in features:
            ids, labels = list(feature["input_ids"]), list(feature["labels"])
            if len(ids) != len(labels):
                raise ValueError(f"input_ids and labels differ in length ({len(ids)} vs {len(labels)})")
            pad = longest - len(ids)
            rows = (ids, [1] * len(ids), labels)
            fills = (self.pad_token_id, 0, IGNORE_INDEX)
            for key, row, fill in zip(batch, rows, fills):
                batch[key].append(row + [fill] * pad if self.padding_side == "right" else [fill] * pad + row)
        return {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}
