"""MedMCQA accuracy (docs/method.md#evaluation): pick the option whose continuation has the highest mean log-likelihood.

Each option is scored as the continuation ``" {label}. {option}"`` of the question prompt; both
come from :mod:`smf.data.medmcqa`, the one definition shared with training.
Tokenisation at the boundary depends on the protocol (:mod:`smf.data.protocol`):

- ``clean``: the prompt is tokenised on its own (with the tokenizer's usual special tokens) and
  each continuation on its own (no special tokens), and the two id lists are concatenated. The
  scored tokens are exactly ``tokenizer(continuation)``, the same for every prompt.
- ``authors``: prompt + continuation tokenised as one string without special tokens; the first
  ``len(tokenizer(prompt))`` positions are the context, the rest is scored (their
  smf_rebuild/eval_tasks.py:53-58), so a merge across the boundary moves a token into the score.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from smf.data.medmcqa import LABELS, format_prompt, option_continuations
from smf.data.protocol import DEFAULT_PROTOCOL, Protocol, get_protocol
from smf.eval.common import batched, evaluating, model_device, pad_batch, pad_token_id, write_jsonl

logger = logging.getLogger(__name__)


def single_answer_slice(examples: Iterable[dict], limit: int | None = 1000) -> list[dict]:
    """The first ``limit`` examples with ``choice_type == "single"`` (all of them for None)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    single = (example for example in examples if example["choice_type"] == "single")
    return list(itertools.islice(single, limit))


def count_rows(examples: Iterable[dict], limit: int | None = 1000) -> dict[str, int]:
    """How :func:`evaluate_medmcqa` uses ``examples``: ``rows`` (all of them), ``scored`` (the first ``limit``
    single-answer questions) and ``skipped`` (the multi-answer questions passed over before those are found)."""
    rows = list(examples)
    scored = skipped = 0
    for example in rows:
        if limit is not None and scored == limit:
            break
        if example["choice_type"] == "single":
            scored += 1
        else:
            skipped += 1
    return {"rows": len(rows), "scored": scored, "skipped": skipped}


def encode_options(tokenizer, example: dict, protocol: str | Protocol = DEFAULT_PROTOCOL
                   ) -> list[tuple[list[int], list[int]]]:
    """(context ids, continuation ids) for each of the four options (see the module docstring)."""
    protocol = get_protocol(protocol)
    prompt = format_prompt(example, protocol)
    joint = protocol.medmcqa_joint_tokenization
    prompt_ids = tokenizer(prompt, add_special_tokens=not joint)["input_ids"]
    encoded = []
    for continuation in option_continuations(example, protocol):
        if joint:
            full_ids = tokenizer(prompt + continuation, add_special_tokens=False)["input_ids"]
            prompt_ids, continuation_ids = full_ids[:len(prompt_ids)], full_ids[len(prompt_ids):]
        else:
            continuation_ids = tokenizer(continuation, add_special_tokens=False)["input_ids"]
        if not prompt_ids or not continuation_ids:
            raise ValueError(f"example {example.get('id')!r}: prompt and continuation must tokenise to >= 1 token")
        encoded.append((list(prompt_ids), list(continuation_ids)))
    return encoded


def mean_continuation_logprobs(
    model: nn.Module, pairs: Sequence[tuple[list[int], list[int]]], pad_id: int
) -> torch.Tensor:
    """Mean per-token log-probability of each continuation given its prompt, in one forward pass.

    pairs: S (prompt ids, continuation ids) pairs, right-padded into one (S, L) batch.
    Returns (S,) float32 on the CPU.
    """
    device = model_device(model)
    input_ids, attention_mask = pad_batch([prompt + cont for prompt, cont in pairs], pad_id, left=False)
    # is_target[s, t]: token t of sequence s belongs to the continuation.
    is_target = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, (prompt, cont) in enumerate(pairs):
        is_target[row, len(prompt):len(prompt) + len(cont)] = True
    input_ids, attention_mask, is_target = input_ids.to(device), attention_mask.to(device), is_target.to(device)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (S, L, V)
    # Logits at position t predict token t + 1: keep only the rows that predict a target.
    predicts_target = is_target[:, 1:]
    selected = logits[:, :-1][predicts_target].float()  # (K, V)
    targets = input_ids[:, 1:][predicts_target]  # (K,)
    token_logprobs = torch.log_softmax(selected, dim=-1).gather(1, targets[:, None]).squeeze(1)
    sequence_of_token = torch.arange(len(pairs), device=device)[:, None].expand_as(predicts_target)[predicts_target]
    sums = torch.zeros(len(pairs), device=device).index_add_(0, sequence_of_token, token_logprobs)
    return (sums / predicts_target.sum(dim=1)).cpu()


def evaluate_medmcqa(
    model: nn.Module,
    tokenizer,
    examples: Iterable[dict],
    *,
    limit: int | None = 1000,
    questions_per_batch: int = 8,
    output_path: str | Path | None = None,
    protocol: str | Protocol = DEFAULT_PROTOCOL,
) -> float:
    """Accuracy on the first ``limit`` single-answer examples (MedMCQA schema: question, opa-opd, cop;
    a list of dicts or a ``datasets.Dataset``).

    Prompt, continuations and tokenisation follow ``protocol``. All four options of
    ``questions_per_batch`` questions go through the model as one padded
    batch. With ``output_path``, writes one JSON line per question: id, scores (mean
    log-likelihood per option, A-D), prediction (0-3), cop, correct.
    """
    examples = list(examples)
    questions = single_answer_slice(examples, limit)
    counts = count_rows(examples, limit)
    if counts["skipped"]:
        logger.info("MedMCQA: scoring %d of %d rows; %d multi-answer rows (choice_type != 'single') skipped",
                    counts["scored"], counts["rows"], counts["skipped"])
    if not questions:
        raise ValueError("examples holds no single-answer (choice_type == 'single') question")
    for example in questions:
        if example["cop"] not in (0, 1, 2, 3):
            raise ValueError(f"example {example.get('id')!r}: cop must be 0-3, got {example['cop']!r}")
    pad_id = pad_token_id(tokenizer)
    records = []
    with evaluating(model):
        for batch in tqdm(list(batched(questions, questions_per_batch)), desc="MedMCQA", unit="batch"):
            pairs = [pair for example in batch for pair in encode_options(tokenizer, example, protocol)]
            scores = mean_continuation_logprobs(model, pairs, pad_id).view(len(batch), len(LABELS))
            for example, option_scores in zip(batch, scores):
                prediction = int(option_scores.argmax())
                records.append({"id": example.get("id"), "scores": option_scores.tolist(), "prediction": prediction,
                                "cop": int(example["cop"]), "correct": prediction == int(example["cop"])})
    accuracy = sum(record["correct"] for record in records) / len(records)
    logger.info("MedMCQA accuracy %.4f on %d questions", accuracy, len(records))
    if output_path is not None:
        write_jsonl(output_path, records)
    return accuracy
