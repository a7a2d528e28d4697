"""TriviaQA accuracy (SPEC §6): greedy answers, alias-substring match after normalisation.

The prediction is the whole greedy continuation (up to 32 new tokens, stopping early only at
an end-of-sequence token); it is NOT cut at the first newline, as SPEC §6 and the paper match
aliases against the normalised prediction as generated. A question counts as correct when any
normalised alias (``answer["aliases"]`` and ``answer["normalized_aliases"]``) is a substring of
the normalised prediction.
"""
from __future__ import annotations

import logging
import itertools
import re
import string
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path

from torch import nn
from tqdm.auto import tqdm
from transformers import GenerationConfig

from smf.data.eval_sets import triviaqa_prompt
from smf.eval.common import batched, evaluating, model_device, pad_batch, pad_token_id, write_jsonl

logger = logging.getLogger(__name__)

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def _is_punctuation(char: str) -> bool:
    return char in string.punctuation or unicodedata.category(char).startswith("P")


def normalize_answer(text: str) -> str:
    """SPEC §6: lower-case, drop punctuation (ASCII and Unicode), drop the words a/an/the, collapse spaces.

    Punctuation vanishes ("jean-paul" -> "jeanpaul", "U.S.A." -> "usa"), as in the common SQuAD-style
    normaliser, not replaced by a space as in TriviaQA's own; the raw ``aliases`` are normalised the
    same way as the prediction, so hyphenated names still match.
    """
    text = "".join(char for char in text.lower() if not _is_punctuation(char))
    return " ".join(_ARTICLES.sub(" ", text).split())


def is_correct(prediction: str, answer: dict) -> bool:
    """Whether any normalised alias is a substring of the normalised prediction.

    Aliases that normalise to the empty string (e.g. "The") are ignored: the empty string would
    match every prediction. The match is on characters, as SPEC §6 states, not on whole words:
    alias "2" matches the prediction "1234".
    """
    normalized_prediction = normalize_answer(prediction)
    aliases = {normalize_answer(alias) for alias in [*answer["aliases"], *answer["normalized_aliases"]]}
    return any(alias in normalized_prediction for alias in aliases if alias)


def greedy_config(model: nn.Module, tokenizer, max_new_tokens: int) -> GenerationConfig:
    """Plain greedy decoding: no sampling, no repetition penalty (Qwen-Instruct's default config has
    one), stopping at the model's end-of-sequence token(s)."""
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
) -> float:
    """Accuracy on the first ``limit`` examples (TriviaQA rc.nocontext schema: question, question_id, answer;
    a list of dicts or a ``datasets.Dataset``). The prompt is :func:`smf.data.triviaqa_prompt`.

    With ``output_path``, writes one JSON line per question: id, prediction, correct.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    questions = list(itertools.islice(examples, limit))
    if not questions:
        raise ValueError("examples must hold at least one question")
    config = greedy_config(model, tokenizer, max_new_tokens)
    records = []
    with evaluating(model):
        for batch in tqdm(list(batched(questions, batch_size)), desc="TriviaQA", unit="batch"):
            predictions = generate_answers(model, tokenizer, [triviaqa_prompt(ex) for ex in batch], config)
            for example, prediction in zip(batch, predictions):
                records.append({"id": example.get("question_id"), "prediction": prediction,
                                "correct": is_correct(prediction, example["answer"])})
    accuracy = sum(record["correct"] for record in records) / len(records)
    logger.info("TriviaQA accuracy %.4f on %d questions", accuracy, len(records))
    if output_path is not None:
        write_jsonl(output_path, records)
    return accuracy
