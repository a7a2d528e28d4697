"""MedMCQA (openlifescienceai/medmcqa): loading, and THE formats shared by training and eval
(docs/method.md#evaluation).

Evaluation prompt (``header`` is the protocol's, "Medical exam question:\\n" for the authors')::

    {header}Question: {question}
    A. {opa}
    B. {opb}
    C. {opc}
    D. {opd}
    Answer:

Continuation of option k: ``" {label}. {option}"``. Protocol ``clean`` strips question and options;
``authors`` keeps them as stored. Training text (:func:`format_example`):

- ``authors``: single-answer rows only; one plain text, the prompt above followed by
  ``" {label}. {answer}"`` and, when ``exp`` is non-empty, ``"\\nExplanation: {exp}"``; loss on every
  token (the authors' smf_rebuild/datasets.py:55-85).
- ``clean``: every row; prompt (without header) loss-masked, target the correct continuation.

See :mod:`smf.data.protocol` for where each choice comes from.
"""
from __future__ import annotations

from smf.data.protocol import DEFAULT_PROTOCOL, Protocol, first_n_of_shuffle, get_protocol
from smf.data.sources import load_split, subset

HUB_ID = "openlifescienceai/medmcqa"
LABELS = ("A", "B", "C", "D")
OPTION_FIELDS = ("opa", "opb", "opc", "opd")


def load_medmcqa(split: str = "train", path=None, n: int | None = None, seed: int | None = None,
                 single_only: bool = False):
    """MedMCQA rows (``datasets.Dataset``, hub schema), the first ``n`` (seed None) or ``n`` drawn with
    ``seed`` (:func:`smf.data.subset`). Eval: split="validation", n=None (the evaluation takes the first
    1,000 single-answer rows)."""
    dataset = load_split(HUB_ID, None, split, path)
    if single_only:
        dataset = dataset.select([i for i, kind in enumerate(dataset["choice_type"]) if kind == "single"])  # no bar
    return subset(dataset, n, seed)


def load_training_rows(path=None, n: int | None = 60_000, seed: int = 0, protocol: str | Protocol = DEFAULT_PROTOCOL):
    """The MedMCQA train rows of a training run: ``authors``: single-answer rows, drawn with the authors'
    rule (:func:`smf.data.protocol.first_n_of_shuffle`); ``clean``: ``n`` of all rows drawn with ``seed``."""
    protocol = get_protocol(protocol)
    if protocol.medmcqa_exam_text:
        return first_n_of_shuffle(load_medmcqa("train", path=path, single_only=True), n, seed)
    return load_medmcqa("train", path=path, n=n, seed=seed)


def _answer_index(example: dict) -> int:
    cop = example["cop"]
    if isinstance(cop, bool) or not isinstance(cop, int) or not 0 <= cop < 4:
        raise ValueError(f"MedMCQA 'cop' must be an int in [0, 3], got {cop!r} (id {example.get('id')!r})")
    return cop


def _field(example: dict, name: str, protocol: Protocol) -> str:
    return example[name].strip() if protocol.strip_fields else example[name]


def format_prompt(example: dict, protocol: str | Protocol = DEFAULT_PROTOCOL) -> str:
    """The protocol's header, the question with options labelled A-D, ending in ``Answer:``."""
    protocol = get_protocol(protocol)
    lines = [f"{protocol.medmcqa_header}Question: {_field(example, 'question', protocol)}"]
    lines += [f"{label}. {_field(example, field, protocol)}" for label, field in zip(LABELS, OPTION_FIELDS)]
    return "\n".join(lines + ["Answer:"])


def option_continuations(example: dict, protocol: str | Protocol = DEFAULT_PROTOCOL) -> list[str]:
    """The four scored continuations ``" A. {opa}"`` ... ``" D. {opd}"``."""
    protocol = get_protocol(protocol)
    return [f" {label}. {_field(example, field, protocol)}" for label, field in zip(LABELS, OPTION_FIELDS)]


def format_example(example: dict, protocol: str | Protocol = DEFAULT_PROTOCOL) -> dict:
    """One training example: ``clean``: {"prompt", "target"}; ``authors``: {"text"}, the whole exam text
    with the explanation (trained on every token, no eos; see :func:`smf.data.tokenize_examples`)."""
    protocol = get_protocol(protocol)
    answer = option_continuations(example, protocol)[_answer_index(example)]
    if not protocol.medmcqa_exam_text:
        return {"prompt": format_prompt(example, protocol), "target": answer}
    text = format_prompt(example, protocol) + answer
    explanation = (example.get("exp") or "").strip()
    if explanation:
        text += f"\nExplanation: {explanation}"
    return {"text": text}
