"""WikiText-103 and TriviaQA rows for the forgetting evaluations (SPEC §6); metrics live elsewhere."""
from __future__ import annotations

from smf.data.sources import load_split, subset

WIKITEXT_HUB_ID, WIKITEXT_CONFIG = "Salesforce/wikitext", "wikitext-103-raw-v1"
TRIVIAQA_HUB_ID, TRIVIAQA_CONFIG = "mandarjoshi/trivia_qa", "rc.nocontext"


def load_wikitext(split: str = "test", path=None):
    """WikiText-103 raw rows: one ``text`` line per row, empty rows included, in order."""
    return load_split(WIKITEXT_HUB_ID, WIKITEXT_CONFIG, split, path)


def load_triviaqa(split: str = "validation", path=None, n: int | None = None, seed: int | None = None):
    """TriviaQA rc.nocontext rows (hub schema). Paper eval: n=1000, seed=None (the first 1,000)."""
    return subset(load_split(TRIVIAQA_HUB_ID, TRIVIAQA_CONFIG, split, path), n, seed)


def triviaqa_prompt(example: dict) -> str:
    """``Question: {question}\\nAnswer:`` (SPEC §6)."""
    return f"Question: {example['question'].strip()}\nAnswer:"
