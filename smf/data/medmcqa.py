"""MedMCQA (openlifescienceai/medmcqa): loading, and THE prompt format shared by training and eval (SPEC §6).

Prompt::

    Question: {question}
    A. {opa}
    B. {opb}
    C. {opc}
    D. {opd}
    Answer:

Continuation of option k: ``" {label}. {option}"``; the training target is the continuation of
``cop``. Question and options are stripped of surrounding whitespace.

Training uses every train row (the paper's 60,000 are a seeded random subset of all 182,822,
single- and multi-choice alike; the paper does not filter). Evaluation uses single-answer
validation questions (``single_only=True``).
"""
from __future__ import annotations

from smf.data.sources import load_split, subset

HUB_ID = "openlifescienceai/medmcqa"
LABELS = ("A", "B", "C", "D")
OPTION_FIELDS = ("opa", "opb", "opc", "opd")


def load_medmcqa(split: str = "train", path=None, n: int | None = None, seed: int | None = None,
                 single_only: bool = False):
    """MedMCQA rows (``datasets.Dataset``, hub schema). Paper: train with n=60_000 and a seed;
    eval: split="validation", single_only=True, n=1000, seed=None (the first 1,000)."""
    dataset = load_split(HUB_ID, None, split, path)
    if single_only:
        dataset = dataset.filter(lambda row: row["choice_type"] == "single")
    return subset(dataset, n, seed)


def _answer_index(example: dict) -> int:
    cop = example["cop"]
    if isinstance(cop, bool) or not isinstance(cop, int) or not 0 <= cop < 4:
        raise ValueError(f"MedMCQA 'cop' must be an int in [0, 3], got {cop!r} (id {example.get('id')!r})")
    return cop


def format_prompt(example: dict) -> str:
    """The question with options labelled A-D, ending in ``Answer:``."""
    lines = [f"Question: {example['question'].strip()}"]
    lines += [f"{label}. {example[field].strip()}" for label, field in zip(LABELS, OPTION_FIELDS)]
    return "\n".join(lines + ["Answer:"])


def option_continuations(example: dict) -> list[str]:
    """The four scored continuations ``" A. {opa}"`` ... ``" D. {opd}"``."""
    return [f" {label}. {example[field].strip()}" for label, field in zip(LABELS, OPTION_FIELDS)]


def format_example(example: dict) -> dict:
    """{"prompt", "target"} for training: target is the continuation of the correct option."""
    return {"prompt": format_prompt(example), "target": option_continuations(example)[_answer_index(example)]}
