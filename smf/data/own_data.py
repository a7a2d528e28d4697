"""A user's own datasets (docs/own-data.md): text, question/answer and multiple-choice files, their schema
checks, and the training texts made from them.

Each file is one that :func:`smf.data.load_split` reads (.jsonl / .json / .parquet, or a ``save_to_disk``
directory); its schema is told by its columns:

- ``text``: rows ``{"text": str}``;
- ``qa``: rows ``{"question": str, "answers": [str, ...]}`` (non-empty; any answer counts as correct, the first is
  the training target);
- ``mc``: rows ``{"question": str, "choices": [str, ...], "label": int}`` (2 or more choices, ``label`` indexes them).

Training text of a qa row: ``"Question: {question}\\nAnswer: {answers[0]}"``; of an mc row
``"Question: {question}\\nAnswer: {choices[label]}"``. With ``loss_on="answer"`` the tokens of the prompt
``"Question: {question}\\nAnswer:"`` get label -100 (the token ids are the same either way).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from smf.data.causal_lm import IGNORE_INDEX, trainable
from smf.data.sources import load_split
from smf.errors import ConfigError
from smf.vocabulary import LOSS_ON

logger = logging.getLogger(__name__)

SCHEMAS = ("text", "qa", "mc")
SCHEMA_COLUMNS = {"text": ("text",), "qa": ("question", "answers"), "mc": ("question", "choices", "label")}


def qa_prompt(question: str) -> str:
    """The prompt of a qa or mc row, for training and scoring: ``Question: {question}\\nAnswer:``."""
    return f"Question: {question}\nAnswer:"


def detect_schema(columns, where: str) -> str:
    """The schema whose columns ``columns`` holds (mc before qa before text); ConfigError naming ``where``."""
    columns = set(columns)
    for schema in ("mc", "qa", "text"):
        if set(SCHEMA_COLUMNS[schema]) <= columns:
            return schema
    expected = "; ".join(f"{schema}: {', '.join(cols)}" for schema, cols in SCHEMA_COLUMNS.items())
    raise ConfigError(f"{where}: columns {sorted(columns)} match no schema (expected the columns of one of {expected};"
                      " see docs/own-data.md)")


def _row_error(schema: str, row: dict) -> str | None:
    """Why ``row`` breaks ``schema``, or None."""
    if schema == "text":
        return None if isinstance(row["text"], str) else f"'text' must be a string, got {row['text']!r}"
    if not isinstance(row["question"], str) or not row["question"].strip():
        return f"'question' must be a non-empty string, got {row['question']!r}"
    if schema == "qa":
        answers = row["answers"]
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
            return f"'answers' must be a non-empty list of non-empty strings, got {answers!r}"
        return None
    choices, label = row["choices"], row["label"]
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        return f"'choices' must be a list of 2 or more non-empty strings, got {choices!r}"
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        return f"'label' must be an int index into its {len(choices)} choices, got {label!r}"
    return None


def _json_rows(path: Path, where: str) -> tuple[list[dict], list[str]]:
    """(rows, where each is: ``line N`` / ``item N``) of a .jsonl or .json file, read exactly: UTF-8 (a leading BOM
    skipped), JSON lines of objects (blank lines skipped), or, in a .json file, one array of objects. ConfigError
    naming ``where``, the file, the line and what was expected otherwise."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{where} {str(path)!r} cannot be read ({err.strerror})") from None
    lines = data.removeprefix(b"\xef\xbb\xbf").split(b"\n")
    if path.suffix == ".json" and data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):  # one array of objects
        items = _parsed(b"\n".join(lines), where, path, 1, "a JSON array of row objects")
        rows = [(f"item {index}", item) for index, item in enumerate(items)]
    else:
        rows = [(f"line {number}", _parsed(line, where, path, number, "a JSON object per line"))
                for number, line in enumerate(lines, 1) if line.strip()]
    for place, row in rows:
        if not isinstance(row, dict):
            raise ConfigError(f"{where} {str(path)!r}, {place}: expected a JSON object (a row), got "
                              f"{type(row).__name__} {str(row)[:40]!r}")
    return [row for _, row in rows], [place for place, _ in rows]


def _parsed(raw: bytes, where: str, path: Path, line: int, expected: str):
    """The JSON value of ``raw`` (line ``line`` of ``path`` onwards); ConfigError saying why it is not one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line += raw[:err.start].count(b"\n")
        raise ConfigError(f"{where} {str(path)!r}, line {line}: not UTF-8 text (byte 0x{raw[err.start]:02x}); save "
                          "the file as UTF-8") from None
    try:
        value = json.loads(text)
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # an escaped lone surrogate (\ud800) is no text
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where} {str(path)!r}, line {line + err.lineno - 1}: expected {expected} ({err.msg} at "
                          f"column {err.colno})") from None
    except RecursionError:
        raise ConfigError(f"{where} {str(path)!r}, line {line}: expected {expected} (nested too deeply)") from None
    except UnicodeEncodeError as err:
        raise ConfigError(f"{where} {str(path)!r}, line {line}: expected Unicode text, got an unpaired surrogate "
                          f"escape (\\u{ord(err.object[err.start]):04x})") from None
    return value


def load_own(path: str | Path, where: str, schemas: tuple[str, ...] = SCHEMAS) -> tuple[list[dict], str]:
    """(rows as dicts, schema) of the dataset at ``path``, every row checked against its schema, which must be one
    of ``schemas``; ConfigError naming ``where`` (the flag or config key), the file and the line (the row of a
    .parquet file or a save_to_disk directory) otherwise. A .jsonl / .json file is read exactly as written
    (:func:`_json_rows`); a row's missing column reads as null."""
    path = Path(path)
    if path.suffix in (".jsonl", ".json") and path.is_file():
        found, places = _json_rows(path, where)
        columns = list(dict.fromkeys(key for row in found for key in row))
    else:
        dataset = load_split(None, None, "train", path)
        found, columns = list(dataset), dataset.column_names
        places = [f"row {index}" for index in range(len(found))]
    if not found:
        raise ConfigError(f"{where} {str(path)!r} holds no rows (expected {' or '.join(schemas)} rows: "
                          "docs/own-data.md)")
    schema = detect_schema(columns, f"{where} {str(path)!r}")
    if schema not in schemas:
        raise ConfigError(f"{where} {str(path)!r} holds {schema} rows; {where} takes {' or '.join(schemas)} rows "
                          "(docs/own-data.md)")
    rows = [{column: row.get(column) for column in SCHEMA_COLUMNS[schema]} for row in found]
    for place, row in zip(places, rows):
        error = _row_error(schema, row)
        if error is not None:
            raise ConfigError(f"{where} {str(path)!r}, {place}: {error}")
    return rows, schema


def one_batch_or_more(rows: Sequence, n_examples: int | None, global_batch_size: int, where: str,
                      batch_name: str) -> Sequence:
    """The first ``n_examples`` of ``rows`` (all with None) of the file ``where`` names, refused in one line unless
    they fill one global batch (``batch_name``: the option that sets its size)."""
    used = rows[:n_examples]
    if len(used) < global_batch_size:
        cut = "" if len(used) == len(rows) else f" of its {len(rows)} (n_examples)"
        raise ConfigError(f"{where}: {len(used)} rows{cut}, fewer than one global batch of {global_batch_size}; "
                          f"lower {batch_name} or add rows")
    return used


def training_text(row: dict, schema: str) -> tuple[str, str]:
    """(prompt, answer) of a qa or mc row: the training text is ``prompt + " " + answer``."""
    answer = row["answers"][0] if schema == "qa" else row["choices"][row["label"]]
    return qa_prompt(row["question"]), answer


def tokenize_own(tokenizer, row: dict, schema: str, loss_on: str = "all", max_length: int = 1024) -> dict:
    """{"input_ids", "labels"} of one row: the training text in the tokenizer's own encoding (its usual special
    tokens, no eos appended, as a plain text is trained), cut at ``max_length``; ``loss_on="answer"`` sets the
    labels of a qa/mc row's prompt tokens to -100 (those the text's encoding shares with the prompt's)."""
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on must be one of {LOSS_ON}, got {loss_on!r}")
    if schema == "text":
        ids = tokenizer(row["text"])["input_ids"][:max_length]
        return {"input_ids": ids, "labels": list(ids)}
    prompt, answer = training_text(row, schema)
    ids = tokenizer(f"{prompt} {answer}")["input_ids"][:max_length]
    labels = list(ids)
    if loss_on == "answer":
        prompt_ids = tokenizer(prompt)["input_ids"]
        shared = 0
        while shared < min(len(prompt_ids), len(ids)) and prompt_ids[shared] == ids[shared]:
            shared += 1
        labels[:shared] = [IGNORE_INDEX] * shared
    return {"input_ids": ids, "labels": labels}


def own_features(tokenizer, rows: list[dict], schema: str, loss_on: str = "all", max_length: int = 1024) -> list[dict]:
    """:func:`tokenize_own` over ``rows``; rows left with nothing to train on (one token, or a prompt filling
    ``max_length``) are dropped, and the number dropped logged."""
    tokenized = [tokenize_own(tokenizer, row, schema, loss_on, max_length) for row in rows]
    return trainable(tokenized, max_length)


def as_triviaqa_rows(rows: list[dict]) -> list[dict]:
    """qa rows in the TriviaQA schema that :func:`smf.eval.triviaqa.evaluate_triviaqa` scores (every answer an
    alias, under both protocols' alias fields)."""
    return [{"question": row["question"], "question_id": str(index),
             "answer": {"aliases": list(row["answers"]), "normalized_aliases": list(row["answers"])}}
            for index, row in enumerate(rows)]
