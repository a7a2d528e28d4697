"""Helpers shared by the evaluations: eval mode, device, padding, per-example output files."""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from torch import nn


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Put ``model`` in eval mode under ``torch.no_grad`` and restore its training flag afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (inputs are moved there)."""
    return next(model.parameters()).device


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int, *, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token-id lists to one (B, L) int64 tensor; returns (input_ids, attention_mask), both (B, L).

    ``left=True`` puts the padding before the tokens (needed for batched generation),
    ``left=False`` after them (enough for scoring with a causal model).
    """
    if not sequences or any(len(seq) == 0 for seq in sequences):
        raise ValueError("sequences must be a non-empty list of non-empty token-id lists")
    length = max(len(seq) for seq in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.int64)
    for row, seq in enumerate(sequences):
        span = slice(length - len(seq), length) if left else slice(0, len(seq))
        input_ids[row, span] = torch.as_tensor(seq, dtype=torch.int64)
        attention_mask[row, span] = 1
    return input_ids, attention_mask


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, else its eos id; padded positions are masked, so only validity matters."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    raise ValueError("tokenizer has neither a pad_token_id nor an eos_token_id to pad with")


def batched(items: Sequence, batch_size: int) -> Iterator[Sequence]:
    """Consecutive slices of ``items`` of length ``batch_size`` (the last may be shorter)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    for start in range(0, len(items), batch_size):
        yield items[start:start + batch_size]


def write_jsonl(path: str | Path, records: Iterable[dict]) -> None:
    """Write one JSON object per line to ``path`` (parent folders are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
