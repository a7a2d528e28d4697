"""TriviaQA: normaliser, alias-substring matching, left-padded batched greedy decoding."""
import json

import pytest
import torch
from torch import nn

from smf.data import triviaqa_prompt
from smf.eval.triviaqa import evaluate_triviaqa, is_correct, normalize_answer
from smf.tiny import tiny_model, tiny_tokenizer


@pytest.mark.parametrize("text,expected", [
    ("The Beatles!", "beatles"),
    ("  A   Tale of\tTwo  Cities. ", "tale of two cities"),
    ("Jean-Paul Sartre", "jeanpaul sartre"),
    ("“Quoted” — dash…", "quoted dash"),
    ("Anne and Theo ate an apple", "anne and theo ate apple"),
    ("U.S.A.", "usa"),  # punctuation is dropped (docs/method.md#evaluation), not turned into spaces
    ("rock_and_roll", "rockandroll"),
    ("THE END", "end"),
    ("$100", "100"),
    ("", ""),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text, "clean") == expected
    assert normalize_answer(expected, "clean") == expected


def answer(aliases, normalized=()):
    return {"aliases": list(aliases), "normalized_aliases": list(normalized), "value": aliases[0] if aliases else "",
            "normalized_value": "", "matched_wiki_entity_name": "", "normalized_matched_wiki_entity_name": "",
            "type": "WikipediaEntity"}


def test_alias_substring_matching():
    assert is_correct(" It was the Beatles, of course.", answer(["The Beatles"]), "clean")
    assert is_correct(" Jean-Paul Sartre wrote it", answer(["Jean-Paul Sartre"], ["jean paul sartre"]), "clean")
    assert is_correct(" It was the U.S.A.", answer(["USA"]), "clean")
    assert is_correct(" Paris\nQuestion: and Rome?", answer(["paris"]))  # the full generation is kept
    assert not is_correct(" London", answer(["Paris", "Paris, France"], ["paris", "paris france"]), "clean")
    # An alias that normalises to nothing must not match everything.
    assert not is_correct(" London", answer(["The", "!!"]), "clean")


class ScriptedGenerator(nn.Module):
    """Fake model: generate() appends scripted token ids per prompt and checks the batch is left-padded."""

    def __init__(self, tokenizer, replies):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.generation_config = None
        self.tokenizer, self.replies = tokenizer, replies

    def generate(self, input_ids, attention_mask, generation_config):
        assert generation_config.do_sample is False and generation_config.max_new_tokens == 32
        assert torch.all(attention_mask[:, -1] == 1), "batch must be left-padded"
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            prompt = self.tokenizer.decode(ids[mask.bool()])
            reply = self.tokenizer(self.replies[prompt], add_special_tokens=False)["input_ids"]
            rows.append(torch.cat([ids, torch.tensor(reply + [self.tokenizer.eos_token_id] * (40 - len(reply)))]))
        return torch.stack(rows)


def test_accuracy_and_outputs_with_scripted_answers(tmp_path):
    tokenizer = tiny_tokenizer()
    examples = [{"question_id": f"tq{i}", "question": q, "question_source": "", "entity_pages": {},
                 "search_results": {}, "answer": answer(a)}
                for i, (q, a) in enumerate([("Capital of France?", ["Paris"]), ("Who wrote Hamlet?", ["Shakespeare"]),
                                            ("Largest ocean on Earth, by area?", ["The Pacific", "Pacific Ocean"])])]
    replies = {triviaqa_prompt({"question": "Capital of France?"}): " Paris, France.",
               triviaqa_prompt({"question": "Who wrote Hamlet?"}): " Marlowe",
               triviaqa_prompt({"question": "Largest ocean on Earth, by area?"}): " the pacific"}
    model = ScriptedGenerator(tokenizer, replies)
    accuracy = evaluate_triviaqa(model, tokenizer, examples, batch_size=2, protocol="clean",
                                 output_path=tmp_path / "t.jsonl")
    assert accuracy == pytest.approx(2 / 3)
    records = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert records == [{"id": "tq0", "prediction": " Paris, France.", "correct": True},
                       {"id": "tq1", "prediction": " Marlowe", "correct": False},
                       {"id": "tq2", "prediction": " the pacific", "correct": True}]
    assert evaluate_triviaqa(model, tokenizer, examples, limit=1, protocol="clean") == 1.0


def test_left_padded_batch_generates_what_each_prompt_generates_alone(tmp_path):
    tokenizer, model = tiny_tokenizer(), tiny_model(seed=4)
    questions = ["Who?", "Which river flows through the city of Vienna?", "Name a prime number greater than 7."]
    examples = [{"question_id": str(i), "question": q, "answer": answer(["x"])} for i, q in enumerate(questions)]
    evaluate_triviaqa(model, tokenizer, examples, batch_size=3, max_new_tokens=12, output_path=tmp_path / "b.jsonl")
    batched = [json.loads(line)["prediction"] for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    evaluate_triviaqa(model, tokenizer, examples, batch_size=1, max_new_tokens=12, output_path=tmp_path / "s.jsonl")
    single = [json.loads(line)["prediction"] for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert batched == single and any(batched)
