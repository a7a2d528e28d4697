"""TriviaQA accuracy (docs/method.md#evaluation): greedy answers, alias-substring match after normalisation.

The prediction is the whole greedy continuation (up to 32 new tokens, stopping early only at
an end-of-sequence token); it is NOT cut at the first newline, as docs/method.md#evaluation and the paper match
aliases against the normalised prediction as generated. A question counts as correct when any
normalised alias of the protocol's answer fields is a non-empty substring of the normalised
prediction. Per protocol (:mod:`smf.data.protocol`):

- ``authors``: decoding under the model's own generation config (Qwen-2.5-Instruct's
  repetition_penalty 1.1 applies), eos = the tokenizer's; the authors' normaliser, which keeps
  "." and "-"; ``answer["aliases"]`` only (their smf_rebuild/eval_tasks.py:23-27, 152-174).
- ``clean``: plain greedy (repetition_penalty 1.0, the model's eos ids); punctuation removed;
  ``aliases`` and ``normalized_aliases``.
"""
from __future__ import annotations

import copy
import itertools
import logging
import re
import string
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path

from torch import nn
from tqdm.auto import tqdm
from transformers import GenerationConfig

from smf.data.eval_sets import triviaqa_prompt
from smf.data.protocol import DEFAULT_PROTOCOL, Protocol, get_protocol
from smf.eval.common import batched, evaluating, model_device, pad_batch, pad_token_id, write_jsonl

logger = logging.getLogger(__name__)

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_OUTSIDE_AUTHORS_ALPHABET = re.compile(r"[^a-z0-9 .-]")


def _is_punctuation(char: str) -> bool:
    return char in string.punctuation or unicodedata.category(char).startswith("P")


def normalize_answer(text: str, protocol: str | Protocol = DEFAULT_PROTOCOL) -> str:
    """The protocol's normaliser: :func:`normalize_answer_authors` or :func:`normalize_answer_squad`."""
    if get_protocol(protocol).triviaqa_normalizer == "authors":
        return normalize_answer_authors(text)
    return normalize_answer_squad(text)


def normalize_answer_authors(text: str) -> str:
    """The authors' normaliser: lower-case; the words a/an/the -> a space; every character outside
    ``[a-z0-9 .-]`` (accented letters included) -> a space; whitespace collapsed. "U.S.A." becomes "u.s. .": the
    article rule takes its final "a" for the word "a" (tests/test_protocol.py)."""
    text = _ARTICLES.sub(" ", text.lower())
    return " ".join(_OUTSIDE_AUTHORS_ALPHABET.sub(" ", text).split())


def normalize_answer_squad(text: str) -> str:
    """docs/method.md#evaluation: lower-case, drop punctuation (ASCII and Unicode), drop the words a/an/the,
    collapse spaces.

    Punctuation vanishes ("jean-paul" -> "jeanpaul", "U.S.A." -> "usa"), as in the common SQuAD-style
    normaliser, not replaced by a space as in TriviaQA's own; the raw ``aliases`` are normalised the
    same way as the prediction, so hyphenated names still match.
    """
    text = "".join(char for char in text.lower() if not _is_punctuation(char))
    return " ".join(_ARTICLES.sub(" ", text).split())


def is_correct(prediction: str, answer: dict, protocol: str | Protocol = DEFAULT_PROTOCOL) -> bool:
    """Whether any normalised alias (of the protocol's answer fields) is a substring of the normalised prediction.

    Aliases that normalise to the empty string (e.g. "The") are ignored: the empty string would
    match every prediction. The match is on characters, as docs/method.md#evaluation states, not on whole words:
    alias "2" matches the prediction "1234".
    """
    protocol = get_protocol(protocol)
    normalized_prediction = normalize_answer(prediction, protocol)
    aliases = {normalize_answer(alias, protocol) for field in protocol.triviaqa_alias_fields for alias in answer[field]}
    return any(alias in normalized_prediction for alias in aliases if alias)


def greedy_config(model: nn.Module, tokenizer, max_new_tokens: int,
                  protocol: str | Protocol = DEFAULT_PROTOCOL) -> GenerationConfig:
    """Greedy decoding. ``authors``: the model's generation config (its repetition penalty included) with
    sampling off, ``max_new_tokens`` and the tokenizer's pad and eos ids. ``clean``: no repetition penalty
    (Qwen-Instruct's default config has one), stopping at the model's end-of-sequence token(s)."""
    if get_protocol(protocol).triviaqa_model_generation_config:
        config = copy.deepcopy(model.generation_config)
        config.update(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id(tokenizer),
                      eos_token_id=tokenizer.eos_token_id)
        return config
    eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, repetition_penalty=1.0,
        eos_token_id=eos if eos is not None else tokenizer.eos_token_id, pad_token_id=pad_token_id(tokenizer),
    )


def generate_answers(model: nn.Module, tokenizer, prompts: Sequence[str], config: GenerationConfig) -> list[str]:
    """Greedy continuations of ``prompts``, run as one LEFT-padded batch; decoded without special tokens."""
    encoded = [tokenizer(prompt)["input_ids"] for prompt in prompts]
    input_ids, attention_mask = pad_batch(encoded, config.pad_token_id, left=True)
    device = model_device(model)
    output = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                            generation_config=config)
    return tokenizer.batch_decode(output[:, input_ids.shape[1]:], skip_special_tokens=True)


def evaluate_triviaqa(
    model: nn.Module,
    tokenizer,
    examples: Iterable[dict],
    *,
    limit: int | None = 1000,
    batch_size: int = 32,
    max_new_tokens: int = 32,
    output_path: str | Path | None = None,
    protocol: str | Protocol = DEFAULT_PROTOCOL,
    name: str = "TriviaQA",
) -> float:
    """Accuracy on the first ``limit`` examples (TriviaQA rc.nocontext schema: question, question_id, answer;
    a list of dicts or a ``datasets.Dataset``). The prompt is :func:`smf.data.triviaqa_prompt`. ``name`` titles
    the progress bar and the log line (an own-data role: learn, retain).

    With ``output_path``, writes one JSON line per question: id, prediction, correct.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    questions = list(itertools.islice(examples, limit))
    if not questions:
        raise ValueError("examples must hold at least one question")
    config = greedy_config(model, tokenizer, max_new_tokens, protocol)
    records = []
    with evaluating(model):
        for batch in tqdm(list(batched(questions, batch_size)), desc=name, unit="batch"):
            predictions = generate_answers(model, tokenizer, [triviaqa_prompt(ex, protocol) for ex in batch], config)
            for example, prediction in zip(batch, predictions):
                records.append({"id": example.get("question_id"), "prediction": prediction,
                                "correct": is_correct(prediction, example["answer"], protocol)})
    accuracy = sum(record["correct"] for record in records) / len(records)
    logger.info("%s accuracy %.4f on %d questions", name, accuracy, len(records))
    if output_path is not None:
        write_jsonl(output_path, records)
    return accuracy
