"""Accuracy on a user's multiple-choice rows (docs/own-data.md), by the MedMCQA rule: the choice whose continuation
``" {choice}"`` after ``"Question: {question}\\nAnswer:"`` has the highest mean per-token log-likelihood.

Tokenisation at the boundary follows the protocol as for MedMCQA (:func:`smf.eval.medmcqa.encode_options`):
``clean`` tokenises prompt and continuation apart, ``authors`` together without special tokens.
"""
from __future__ import annotations

import logging
from pathlib import Path

from torch import nn
from tqdm.auto import tqdm

from smf.data.own_data import qa_prompt
from smf.data.protocol import DEFAULT_PROTOCOL, Protocol, get_protocol
from smf.eval.common import batched, evaluating, pad_token_id, write_jsonl
from smf.eval.medmcqa import mean_continuation_logprobs

logger = logging.getLogger(__name__)


def encode_choices(tokenizer, row: dict, protocol: str | Protocol = DEFAULT_PROTOCOL) -> list[tuple[list, list]]:
    """(context ids, continuation ids) of each choice of an mc row."""
    protocol = get_protocol(protocol)
    prompt = qa_prompt(row["question"])
    joint = protocol.medmcqa_joint_tokenization
    prompt_ids = tokenizer(prompt, add_special_tokens=not joint)["input_ids"]
    encoded = []
    for choice in row["choices"]:
        continuation = f" {choice}"
        if joint:
            full = tokenizer(prompt + continuation, add_special_tokens=False)["input_ids"]
            context, continuation_ids = full[:len(prompt_ids)], full[len(prompt_ids):]
        else:
            context, continuation_ids = prompt_ids, tokenizer(continuation, add_special_tokens=False)["input_ids"]
        if not context or not continuation_ids:
            raise ValueError(f"question {row['question']!r}: prompt and choice {choice!r} must tokenise to >= 1 "
                             "token each")
        encoded.append((list(context), list(continuation_ids)))
    return encoded


def evaluate_multiple_choice(model: nn.Module, tokenizer, rows: list[dict], *, questions_per_batch: int = 8,
                             output_path: str | Path | None = None,
                             protocol: str | Protocol = DEFAULT_PROTOCOL, name: str = "multiple choice") -> float:
    """Accuracy over every mc row (``{"question", "choices", "label"}``); the choices of ``questions_per_batch``
    questions go through the model as one padded batch. With ``output_path``, one JSON line per question: id (its
    row index), scores (one per choice), prediction, label, correct. ``name`` titles the progress bar and the log
    line (an own-data role: learn, retain)."""
    if not rows:
        raise ValueError("rows must hold at least one question")
    pad_id = pad_token_id(tokenizer)
    records = []
    with evaluating(model):
        for start, batch in tqdm(list(zip(range(0, len(rows), questions_per_batch),
                                          batched(rows, questions_per_batch))), desc=name, unit="batch"):
            pairs = [encode_choices(tokenizer, row, protocol) for row in batch]
            scores = mean_continuation_logprobs(model, [pair for row_pairs in pairs for pair in row_pairs], pad_id)
            offset = 0
            for index, row in enumerate(batch, start):
                row_scores = scores[offset:offset + len(row["choices"])]
                offset += len(row["choices"])
                prediction = int(row_scores.argmax())
                records.append({"id": index, "scores": row_scores.tolist(), "prediction": prediction,
                                "label": int(row["label"]), "correct": prediction == int(row["label"])})
    accuracy = sum(record["correct"] for record in records) / len(records)
    logger.info("%s accuracy %.4f on %d questions", name, accuracy, len(records))
    if output_path is not None:
        write_jsonl(output_path, records)
    return accuracy
