"""OpenAssistant oasst1: assistant responses, for retrofit and background statistics.

Protocol ``authors`` (:func:`response_texts`, :func:`authors_retrofit_and_background`): the text of
each English assistant message ranked 0 or 1 with at least 50 characters, alone (no prompt, no chat
template); the background examples are drawn from the same pool (see :mod:`smf.data.protocol`).

Protocol ``clean``: a training pair is an assistant message that is not deleted, in one of ``languages`` (default
English), with non-empty text, whose parent is a non-deleted prompter message; prompt = the
parent's text, target = the assistant's text. Every ranked sibling is kept (rank is not used;
it is often null).

Sizes (docs/method.md#two-stage-training, #slot-selection): 50,000 pairs for retrofit and 2,000 for
background statistics. The English
train split likely has fewer than 52,000 such pairs; :func:`retrofit_and_background` then keeps
as many retrofit pairs as possible and makes the background set disjoint from them only as far as
the leftovers allow (see there).
"""
from __future__ import annotations

import logging

from smf.data.protocol import AUTHORS_OASST_MIN_CHARS, AUTHORS_OASST_RANKS, first_n_of_shuffle
from smf.data.sources import load_split, shuffled

logger = logging.getLogger(__name__)

HUB_ID = "OpenAssistant/oasst1"


def load_oasst1(split: str = "train", path=None):
    """The flat oasst1 messages (``datasets.Dataset``, hub schema)."""
    return load_split(HUB_ID, None, split, path)


def assistant_pairs(messages, languages: tuple[str, ...] | None = ("en",)) -> list[dict]:
    """Prompt/response pairs in message order: dicts with message_id, message_tree_id, lang, rank,
    prompt and target. ``languages`` None keeps every language."""
    rows = messages.to_list() if hasattr(messages, "to_list") else list(messages)
    by_id = {row["message_id"]: row for row in rows}
    pairs = []
    for row in rows:
        if row["role"] != "assistant" or row["deleted"] or not row["text"].strip():
            continue
        if languages is not None and row["lang"] not in languages:
            continue
        parent = by_id.get(row["parent_id"])
        if parent is None or parent["role"] != "prompter" or parent["deleted"]:
            continue
        pairs.append({"message_id": row["message_id"], "message_tree_id": row["message_tree_id"],
                      "lang": row["lang"], "rank": row["rank"], "prompt": parent["text"], "target": row["text"]})
    return pairs


def response_texts(messages) -> list[dict]:
    """The authors' oasst1 examples, in message order: {"message_id", "text"} of every message with
    lang "en", role "assistant", rank 0 or 1 and at least 50 characters of text (deleted messages
    are not dropped; the authors' smf_rebuild/datasets.py:30-42)."""
    rows = messages.to_list() if hasattr(messages, "to_list") else list(messages)
    return [{"message_id": row["message_id"], "text": row["text"]} for row in rows
            if row.get("lang") == "en" and row.get("role") == "assistant" and row.get("rank") in AUTHORS_OASST_RANKS
            and len(row.get("text") or "") >= AUTHORS_OASST_MIN_CHARS]


def authors_retrofit_and_background(texts: list[dict], n_retrofit: int, n_background: int, pool: int,
                                    seed: int) -> tuple[list[dict], list[dict]]:
    """(retrofit, background) the authors' way: retrofit = :func:`first_n_of_shuffle` (texts, n_retrofit,
    seed); background = the first ``n_background`` of the same draw of size ``pool``. Both come from one
    pool, so the background examples are retrofit examples too (by design in that protocol)."""
    for name, value in (("n_retrofit", n_retrofit), ("n_background", n_background), ("pool", pool)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    retrofit = list(first_n_of_shuffle(texts, n_retrofit, seed))
    background = list(first_n_of_shuffle(texts, pool, seed))[:n_background]
    if len(background) < n_background:
        logger.warning("only %d oasst1 texts for %d background examples; using all", len(background), n_background)
    return retrofit, background


def retrofit_and_background(pairs: list[dict], n_retrofit: int = 50_000, n_background: int = 2_000,
                            seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Split ``pairs`` into (retrofit, background), deterministic given ``seed``.

    The pairs are shuffled with ``seed``; retrofit takes the first ``min(n_retrofit, len)``,
    background the next ``n_background`` (disjoint). If too few are left, background is topped
    up from the start of the retrofit pairs and the overlap is logged.
    """
    for name, value in (("n_retrofit", n_retrofit), ("n_background", n_background)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    order = shuffled(pairs, seed)
    if len(order) < n_retrofit:
        logger.warning("only %d assistant pairs for %d retrofit examples; using all", len(order), n_retrofit)
    retrofit = order[:n_retrofit]
    background = order[len(retrofit):len(retrofit) + n_background]
    overlap = min(n_background - len(background), len(retrofit))
    if overlap:
        logger.warning("background set overlaps the retrofit set in %d of %d examples (too few pairs)",
                       overlap, n_background)
        background += retrofit[:overlap]
    return retrofit, background


def format_example(pair: dict, tokenizer) -> dict:
    """{"prompt", "target"}: the prompt as a user turn in the tokenizer's chat template with the
    assistant turn opened, the target the assistant text (eos is appended at tokenisation)."""
    if tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat_template; oasst1 pairs are formatted as a chat turn")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": pair["prompt"]}], tokenize=False,
                                           add_generation_prompt=True)
    return {"prompt": prompt, "target": pair["target"]}
