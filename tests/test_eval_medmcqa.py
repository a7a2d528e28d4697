"""MedMCQA scoring: mean continuation log-likelihood, argmax, accuracy, padding independence."""
import json
import random
import types

import pytest
import torch
from torch import nn

from smf.data.medmcqa import format_prompt, option_continuations
from smf.eval.medmcqa import encode_options, evaluate_medmcqa
from smf.tiny import tiny_model, tiny_tokenizer

WORDS = "heart liver kidney nerve bone blood acid enzyme vitamin cell tissue drug dose".split()


def make_examples(count, seed=0):
    rng = random.Random(seed)
    phrase = lambda n: " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, n)))  # noqa: E731
    return [{"id": f"q{i}", "question": phrase(8) + "?", "opa": phrase(4), "opb": phrase(4), "opc": phrase(4),
             "opd": phrase(4), "cop": rng.randrange(4), "choice_type": "single", "exp": "", "subject_name": "s",
             "topic_name": "t"} for i in range(count)]


class BigramModel(nn.Module):
    """Fake causal LM whose logits at position t are table[input_ids[t]]: log-probs known in closed form."""

    def __init__(self, vocab_size):
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab_size, vocab_size))

    def forward(self, input_ids, attention_mask):
        return types.SimpleNamespace(logits=self.table[input_ids])


def reference_scores(logprob_of_next, tokenizer, example):
    """Mean log-prob of each continuation, one option at a time, no padding."""
    prompt = tokenizer(format_prompt(example))["input_ids"]
    scores = []
    for continuation in option_continuations(example):
        cont = tokenizer(continuation, add_special_tokens=False)["input_ids"]
        ids = torch.tensor(prompt + cont)
        logprobs = logprob_of_next(ids)  # (len, V): row t = log p(. | ids[:t+1])
        picked = [logprobs[t - 1, ids[t]] for t in range(len(prompt), len(ids))]
        scores.append(torch.stack(picked).mean())
    return torch.stack(scores)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_scores_argmax_and_accuracy_match_closed_form(tmp_path):
    tokenizer = tiny_tokenizer()
    model = BigramModel(len(tokenizer))
    examples = make_examples(7)
    ref = [reference_scores(lambda ids: torch.log_softmax(model.table[ids].detach(), -1), tokenizer, ex)
           for ex in examples]
    # Make exactly the first four answers correct.
    for i, (example, scores) in enumerate(zip(examples, ref)):
        best = int(scores.argmax())
        example["cop"] = best if i < 4 else (best + 1) % 4
    accuracy = evaluate_medmcqa(model, tokenizer, examples, questions_per_batch=3, output_path=tmp_path / "m.jsonl")
    assert accuracy == pytest.approx(4 / 7)
    records = read_jsonl(tmp_path / "m.jsonl")
    assert [r["id"] for r in records] == [ex["id"] for ex in examples]
    got = torch.tensor([r["scores"] for r in records])
    want = torch.stack(ref)
    assert (got - want).norm() / want.norm() < 1e-5
    assert [r["correct"] for r in records] == [True] * 4 + [False] * 3


def test_batched_padded_scores_equal_one_sequence_at_a_time(tmp_path):
    tokenizer, model = tiny_tokenizer(), tiny_model(seed=1)
    examples = make_examples(5, seed=3)
    evaluate_medmcqa(model, tokenizer, examples, questions_per_batch=4, output_path=tmp_path / "m.jsonl")
    got = torch.tensor([r["scores"] for r in read_jsonl(tmp_path / "m.jsonl")])
    with torch.no_grad():
        want = torch.stack([reference_scores(lambda ids: torch.log_softmax(model(ids[None]).logits[0], -1),
                                             tokenizer, ex) for ex in examples])
    assert (got - want).norm() / want.norm() < 1e-5


def test_continuation_tokens_are_the_continuation_tokenised_alone():
    tokenizer = tiny_tokenizer()
    example = make_examples(1)[0]
    pairs = encode_options(tokenizer, example)
    assert len(pairs) == 4
    for (prompt, cont), text in zip(pairs, option_continuations(example)):
        assert prompt == tokenizer(format_prompt(example))["input_ids"]
        assert cont == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(cont) == text
    assert format_prompt(example).endswith("Answer:")


def test_only_first_single_answer_questions_are_scored(tmp_path):
    tokenizer = tiny_tokenizer()
    model = BigramModel(len(tokenizer))
    examples = make_examples(6)
    examples[1]["choice_type"] = "multi"
    evaluate_medmcqa(model, tokenizer, examples, limit=3, output_path=tmp_path / "m.jsonl")
    assert [r["id"] for r in read_jsonl(tmp_path / "m.jsonl")] == ["q0", "q2", "q3"]


def test_model_back_in_training_mode_and_bad_input_rejected():
    tokenizer = tiny_tokenizer()
    model = BigramModel(len(tokenizer)).train()
    evaluate_medmcqa(model, tokenizer, make_examples(2))
    assert model.training and model.table.grad is None
    bad = make_examples(1)
    bad[0]["cop"] = 4
    with pytest.raises(ValueError, match="cop must be 0-3"):
        evaluate_medmcqa(model, tokenizer, bad)
    with pytest.raises(ValueError, match="single-answer"):
        evaluate_medmcqa(model, tokenizer, [dict(bad[0], choice_type="multi")])
