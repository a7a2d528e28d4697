"""WikiText sliding-window perplexity: exactly-once scoring, one-window equality, batching."""
import json
import math
import random

import pytest
import torch

from smf.eval.wikitext import evaluate_wikitext, sliding_windows
from smf.tiny import tiny_model, tiny_tokenizer


@pytest.mark.parametrize("num_tokens,window,stride", [(2, 4, 2), (10, 4, 2), (11, 4, 2), (100, 16, 5),
                                                      (1000, 1024, 512), (5000, 1024, 512), (37, 8, 7)])
def test_every_token_after_the_first_is_scored_exactly_once(num_tokens, window, stride):
    windows = sliding_windows(num_tokens, window, stride)
    scored = [t for _, end, first in windows for t in range(first, end)]
    assert sorted(scored) == list(range(1, num_tokens))
    for begin, end, first in windows:
        assert 0 <= begin < first <= end <= num_tokens and end - begin <= window
        # As much context as the window allows: a later window's scored tokens see >= window - stride tokens.
        assert begin == 0 or first - begin >= window - stride


def test_bad_window_arguments_raise():
    with pytest.raises(ValueError, match="stride < window"):
        sliding_windows(100, 8, 8)
    with pytest.raises(ValueError, match="num_tokens"):
        sliding_windows(1, 8, 4)


def full_sequence_perplexity(model, token_ids):
    with torch.no_grad():
        logits = model(token_ids[None]).logits[0]
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1].double(), token_ids[1:]).item())


def random_rows(count, seed=0):
    rng = random.Random(seed)
    words = "the of river city war album song team league season game north".split()
    return [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(0, 12)))} for _ in range(count)]


def test_text_shorter_than_window_equals_full_sequence_nll():
    tokenizer, model = tiny_tokenizer(), tiny_model(seed=2)
    rows = random_rows(6)
    token_ids = torch.tensor(tokenizer("\n\n".join(r["text"] for r in rows))["input_ids"])
    assert len(token_ids) < 512
    got = evaluate_wikitext(model, tokenizer, rows, window=512, stride=256, protocol="clean")
    assert got == pytest.approx(full_sequence_perplexity(model, token_ids), rel=1e-5)


def test_windows_match_per_window_reference_and_batching_does_not_matter(tmp_path):
    tokenizer, model = tiny_tokenizer(), tiny_model(seed=3)
    rows = random_rows(12, seed=1)
    token_ids = torch.tensor(tokenizer("\n\n".join(r["text"] for r in rows))["input_ids"])
    window, stride = 64, 24
    one_by_one = evaluate_wikitext(model, tokenizer, rows, window=window, stride=stride, windows_per_batch=1,
                                   protocol="clean")
    batched = evaluate_wikitext(model, tokenizer, rows, window=window, stride=stride, windows_per_batch=5,
                                protocol="clean", output_path=tmp_path / "w.jsonl")
    assert batched == pytest.approx(one_by_one, rel=1e-5)
    # Reference: each window alone, NLL of its scored tokens.
    total = 0.0
    records = [json.loads(line) for line in (tmp_path / "w.jsonl").read_text().splitlines()]
    for record, (begin, end, first) in zip(records, sliding_windows(len(token_ids), window, stride)):
        with torch.no_grad():
            logits = model(token_ids[None, begin:end]).logits[0]
        nll = torch.nn.functional.cross_entropy(logits[first - begin - 1:-1].double(), token_ids[first:end],
                                                reduction="sum").item()
        assert (record["begin"], record["end"], record["scored"]) == (begin, end, end - first)
        assert record["nll_sum"] == pytest.approx(nll, rel=1e-5)
        total += nll
    assert len(records) > 3 and sum(r["scored"] for r in records) == len(token_ids) - 1
    assert batched == pytest.approx(math.exp(total / (len(token_ids) - 1)), rel=1e-5)
