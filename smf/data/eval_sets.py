"""WikiText-103 and TriviaQA rows for the forgetting evaluations (docs/method.md#evaluation); metrics live elsewhere."""
from __future__ import annotations

from smf.data.protocol import DEFAULT_PROTOCOL, Protocol, get_protocol
from smf.data.sources import load_split, subset

WIKITEXT_HUB_ID = "Salesforce/wikitext"
TRIVIAQA_HUB_ID, TRIVIAQA_CONFIG = "mandarjoshi/trivia_qa", "rc.nocontext"


def load_wikitext(split: str = "test", path=None, protocol: str | Protocol = DEFAULT_PROTOCOL):
    """WikiText-103 rows of the protocol's config (``wikitext-103-v1`` for ``authors``, ``-raw-v1`` for
    ``clean``): one ``text`` line per row, empty rows included, in order. ``path``: a local copy of it."""
    return load_split(WIKITEXT_HUB_ID, get_protocol(protocol).wikitext_config, split, path)


def wikitext_lines(rows, protocol: str | Protocol = DEFAULT_PROTOCOL) -> list[str]:
    """The lines the perplexity is computed on (joined with blank lines by the evaluation): ``authors``:
    each row stripped, empty ones dropped, the first 1,000 kept; ``clean``: every row as stored."""
    protocol = get_protocol(protocol)
    texts = [row["text"] for row in rows]
    if protocol.wikitext_lines is None:
        return texts
    return [text.strip() for text in texts if text and text.strip()][:protocol.wikitext_lines]


def load_triviaqa(split: str = "validation", path=None, n: int | None = None, seed: int | None = None):
    """TriviaQA rc.nocontext rows (hub schema). Paper eval: n=1000, seed=None (the first 1,000)."""
    return subset(load_split(TRIVIAQA_HUB_ID, TRIVIAQA_CONFIG, split, path), n, seed)


def triviaqa_prompt(example: dict, protocol: str | Protocol = DEFAULT_PROTOCOL) -> str:
    """``Question: {question}\\nAnswer:`` (docs/method.md#evaluation); the question stripped in the ``clean``
    protocol only."""
    question = example["question"].strip() if get_protocol(protocol).strip_fields else example["question"]
    return f"Question: {question}\nAnswer:"
