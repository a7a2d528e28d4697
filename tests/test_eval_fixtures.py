"""All three evaluations on the real-schema fixtures, with memories attached to the tiny model."""
import json
import math
from pathlib import Path

import pytest
import torch

from smf.data import load_split
from smf.eval import evaluate_medmcqa, evaluate_triviaqa, evaluate_wikitext
from smf.eval.triviaqa import is_correct
from smf.model import attach_memories, memory_blocks
from smf.tiny import TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS, tiny_model, tiny_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"


def load(name):
    """The fixture as the data loaders return it: a ``datasets.Dataset``."""
    return load_split("fixture", None, "test", FIXTURES / name)


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def memory_model():
    model = tiny_model(seed=5)
    attach_memories(model, layers=TINY_MEMORY_LAYERS, mode="replacement", **TINY_MEMORY_KWARGS)
    return model


def test_evaluations_run_on_fixture_schemas(memory_model, tmp_path):
    tokenizer = tiny_tokenizer()
    medmcqa = load("medmcqa_validation.jsonl").select(range(17, 25))  # row 21 is the fixture's "multi" question
    accuracy = evaluate_medmcqa(memory_model, tokenizer, medmcqa, limit=6, output_path=tmp_path / "m.jsonl")
    records = lines(tmp_path / "m.jsonl")
    assert [r["id"] for r in records] == [ex["id"] for i, ex in enumerate(medmcqa) if i != 4][:6]
    assert medmcqa[4]["choice_type"] == "multi"
    assert accuracy == sum(r["correct"] for r in records) / len(records)

    wikitext = load("wikitext103_test.jsonl").select(range(12))
    perplexity = evaluate_wikitext(memory_model, tokenizer, wikitext, window=96, stride=40, protocol="clean",
                                   output_path=tmp_path / "w.jsonl")
    windows = lines(tmp_path / "w.jsonl")
    assert 1 < perplexity < 10 * len(tokenizer) and len(windows) > 2
    assert perplexity == pytest.approx(math.exp(sum(w["nll_sum"] for w in windows) / sum(w["scored"] for w in windows)))

    triviaqa = load("triviaqa_validation.jsonl")
    accuracy = evaluate_triviaqa(memory_model, tokenizer, triviaqa, limit=3, max_new_tokens=4,
                                 output_path=tmp_path / "t.jsonl")
    assert [r["id"] for r in lines(tmp_path / "t.jsonl")] == triviaqa["question_id"][:3]
    assert 0.0 <= accuracy <= 1.0


def test_fixture_answers_are_matched_by_their_own_values():
    for example in load("triviaqa_validation.jsonl"):
        answer = example["answer"]
        for protocol in ("authors", "clean"):
            assert is_correct(f" I think it is {answer['value']}.", answer, protocol)
            assert not is_correct(" xyzzy", answer, protocol)


def test_memory_model_left_padded_generation_equals_one_by_one(memory_model, tmp_path):
    tokenizer = tiny_tokenizer()
    examples = load("triviaqa_validation.jsonl").select(range(3, 6))
    for block in memory_blocks(memory_model):
        block.memory.reset_read_counts()
    predictions = []
    for batch_size in (3, 1):
        evaluate_triviaqa(memory_model, tokenizer, examples, batch_size=batch_size, max_new_tokens=8,
                          output_path=tmp_path / f"{batch_size}.jsonl")
        predictions.append([r["prediction"] for r in lines(tmp_path / f"{batch_size}.jsonl")])
    assert predictions[0] == predictions[1] and any(predictions[0])
    # Evaluation does not count reads unless asked to.
    assert all(torch.all(block.memory.read_counts == 0) for block in memory_blocks(memory_model))
