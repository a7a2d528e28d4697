"""The two data/eval protocols on the fixtures: exact training texts, eval prompts, WikiText line
selection, TriviaQA normalisation and decoding of ``authors`` (the authors' code) and ``clean``."""
import dataclasses
import math
from pathlib import Path

import datasets
import pytest
import torch

from smf.data import load_medmcqa, load_oasst1, load_wikitext, tokenize_examples
from smf.data import medmcqa, oasst
from smf.data.eval_sets import triviaqa_prompt, wikitext_lines
from smf.data.protocol import PROTOCOLS, first_n_of_shuffle, get_protocol
from smf.eval.medmcqa import encode_options
from smf.eval.triviaqa import greedy_config, is_correct, normalize_answer
from smf.eval.wikitext import evaluate_wikitext
from smf.tiny import tiny_model, tiny_tokenizer
from smf.train.config import TINY_PRESET, RunConfig
from smf.train.data import background_features, training_features

FIXTURES = Path(__file__).parent / "fixtures"
SCURVY = {"id": "x", "question": "Deficiency of which vitamin causes scurvy? ", "opa": "Vitamin A",
          "opb": " Vitamin D", "opc": "Vitamin C", "opd": "Vitamin K", "cop": 2, "choice_type": "single",
          "exp": " Ans. is 'c' i.e., Vitamin C. "}


def test_unknown_protocol_is_refused():
    with pytest.raises(ValueError, match="protocol must be one of authors, clean; got 'paper'"):
        get_protocol("paper")


def test_first_n_of_shuffle_is_the_authors_datasets_shuffle():
    rows = datasets.Dataset.from_dict({"x": list(range(40))})
    assert first_n_of_shuffle(rows, 7, 42)["x"] == rows.shuffle(seed=42).select(range(7))["x"]
    assert first_n_of_shuffle(list(range(40)), 7, 42) == rows.shuffle(seed=42).select(range(7))["x"]
    assert first_n_of_shuffle(list(range(40)), 40, 42) == list(range(40))  # n >= size: all, in order
    assert first_n_of_shuffle(list(range(40)), None, 42) == list(range(40))


def test_medmcqa_training_text_of_each_protocol():
    assert medmcqa.format_example(SCURVY, "authors") == {"text": (
        "Medical exam question:\nQuestion: Deficiency of which vitamin causes scurvy? \nA. Vitamin A\n"
        "B.  Vitamin D\nC. Vitamin C\nD. Vitamin K\nAnswer: C. Vitamin C\nExplanation: Ans. is 'c' i.e., Vitamin C.")}
    assert medmcqa.format_example({**SCURVY, "exp": None}, "authors")["text"].endswith("Answer: C. Vitamin C")
    assert medmcqa.format_example(SCURVY, "clean") == {
        "prompt": "Question: Deficiency of which vitamin causes scurvy?\nA. Vitamin A\nB. Vitamin D\nC. Vitamin C\n"
                  "D. Vitamin K\nAnswer:", "target": " C. Vitamin C"}
    tokenizer = tiny_tokenizer()
    authors, clean = (tokenize_examples(tokenizer, [medmcqa.format_example(SCURVY, p)]) for p in PROTOCOLS)
    text = medmcqa.format_example(SCURVY, "authors")["text"]
    assert authors == [{"input_ids": tokenizer(text)["input_ids"], "labels": tokenizer(text)["input_ids"]}]
    assert clean[0]["input_ids"][-1] == tokenizer.eos_token_id and clean[0]["labels"][0] == -100


def test_medmcqa_training_rows_of_each_protocol():
    path = FIXTURES / "medmcqa_train.jsonl"
    authors = medmcqa.load_training_rows(path, n=None, seed=0, protocol="authors")
    assert len(authors) == 27 and set(authors["choice_type"]) == {"single"}  # 3 multi rows dropped
    singles = load_medmcqa("train", path=path, single_only=True)
    assert medmcqa.load_training_rows(path, n=5, seed=3, protocol="authors")["id"] == \
        singles.shuffle(seed=3).select(range(5))["id"]
    assert len(medmcqa.load_training_rows(path, n=None, seed=0, protocol="clean")) == 30


def test_training_features_follow_the_protocol(tmp_path):
    tokenizer = tiny_tokenizer()
    base = RunConfig(**{**TINY_PRESET, "output_dir": str(tmp_path), "n_examples": 8}, recipe="sparse")
    features = training_features(dataclasses.replace(base, protocol="authors"), tokenizer)
    rows = medmcqa.load_training_rows(base.medmcqa_path, 8, base.data_seed, "authors")
    assert [f["input_ids"] for f in features] == \
        [tokenizer(medmcqa.format_example(row, "authors")["text"])["input_ids"][:base.max_length] for row in rows]
    assert all(f["labels"] == f["input_ids"] for f in features)
    clean = training_features(dataclasses.replace(base, protocol="clean"), tokenizer)
    assert all(-100 in f["labels"] and f["input_ids"][-1] == tokenizer.eos_token_id for f in clean)


def test_oasst_texts_of_each_protocol(tmp_path):
    messages = load_oasst1(path=FIXTURES / "oasst1_train.jsonl")
    texts = oasst.response_texts(messages)
    expected = [row for row in messages if row["lang"] == "en" and row["role"] == "assistant"
                and row["rank"] in (0, 1) and len(row["text"]) >= 50]
    assert [t["text"] for t in texts] == [row["text"] for row in expected] and len(texts) == 13
    tokenizer = tiny_tokenizer()
    config = RunConfig(**{**TINY_PRESET, "output_dir": str(tmp_path), "n_examples": 10, "n_background": 4},
                       recipe="retrofit")
    retrofit = training_features(config, tokenizer)
    drawn = first_n_of_shuffle(texts, 10, config.data_seed)
    assert [f["input_ids"] for f in retrofit] == [tokenizer(t["text"])["input_ids"][:256] for t in drawn]
    # Background: the first 4 of a draw from the same 13 texts (pool 20,000 > 13: all of them, in order).
    background = background_features(dataclasses.replace(config, recipe="background"), tokenizer)
    assert [f["input_ids"] for f in background] == [tokenizer(t["text"])["input_ids"][:256] for t in texts[:4]]
    clean = training_features(dataclasses.replace(config, protocol="clean"), tokenizer)
    assert all(f["labels"][0] == -100 for f in clean) and len(clean) == 10


def test_background_of_a_retrofit_run_logs_no_overlap_warning(tmp_path, caplog):
    config = RunConfig(**{**TINY_PRESET, "output_dir": str(tmp_path), "n_examples": 28}, recipe="retrofit",
                       protocol="clean")
    training_features(config, tiny_tokenizer())  # 28 of 28 pairs: no background set left, but none is drawn
    assert "overlaps" not in caplog.text


def test_medmcqa_eval_prompt_and_tokens_of_each_protocol():
    tokenizer = tiny_tokenizer()
    row = load_medmcqa("validation", path=FIXTURES / "medmcqa_validation.jsonl")[0]
    body = ("Question: Night blindness is an early sign of deficiency of\nA. Vitamin B12\nB. Vitamin C\n"
            "C. Vitamin E\nD. Vitamin A\nAnswer:")
    assert medmcqa.format_prompt(row, "authors") == "Medical exam question:\n" + body
    assert medmcqa.format_prompt(row, "clean") == body
    for (context, continuation), text in zip(encode_options(tokenizer, row, "authors"),
                                             medmcqa.option_continuations(row, "authors")):
        assert context + continuation == tokenizer("Medical exam question:\n" + body + text,
                                                   add_special_tokens=False)["input_ids"]
        assert context == tokenizer("Medical exam question:\n" + body, add_special_tokens=False)["input_ids"]


def test_wikitext_line_selection_of_each_protocol():
    v1 = load_wikitext("test", path=FIXTURES / "wikitext103_v1_test.jsonl", protocol="authors")
    lines = wikitext_lines(v1, "authors")
    assert lines == [row["text"].strip() for row in v1 if row["text"].strip()]
    assert lines[0] == "= Harbour Lighthouse of Vell =" and "<unk>" in lines[1] and len(lines) == 24
    assert wikitext_lines([{"text": f" line {i} \n"} for i in range(1200)], "authors")[-1] == "line 999"
    raw = load_wikitext("test", path=FIXTURES / "wikitext103_test.jsonl", protocol="clean")
    assert wikitext_lines(raw, "clean") == raw["text"] and len(raw) == 47
    assert get_protocol("authors").wikitext_config == "wikitext-103-v1"
    assert get_protocol("clean").wikitext_config == "wikitext-103-raw-v1"


def test_wikitext_authors_perplexity_is_their_window_loop():
    """The authors' loop (eval_tasks.py:135-148): HF mean loss of each window x (end - prev_end)."""
    tokenizer, model = tiny_tokenizer(), tiny_model(seed=3)
    rows = load_wikitext("test", path=FIXTURES / "wikitext103_v1_test.jsonl", protocol="authors")
    ids = torch.tensor(tokenizer("\n\n".join(wikitext_lines(rows, "authors")), add_special_tokens=False)["input_ids"])
    window, stride, nll_sum, count, prev_end = 128, 48, 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        target_len = end - prev_end
        labels = ids[begin:end].clone()[None]
        labels[:, :-target_len] = -100
        with torch.no_grad():
            loss = model(input_ids=ids[None, begin:end], labels=labels).loss.item()
        nll_sum, count, prev_end = nll_sum + loss * target_len, count + target_len, end
        if end == len(ids):
            break
    got = evaluate_wikitext(model, tokenizer, rows, window=window, stride=stride, windows_per_batch=3,
                            protocol="authors")
    assert got == pytest.approx(math.exp(nll_sum / count), rel=1e-5)
    assert got != pytest.approx(evaluate_wikitext(model, tokenizer, rows, window=window, stride=stride,
                                                  protocol="clean"), rel=1e-6)


@pytest.mark.parametrize("text, authors, clean", [
    ("U.S.A.", "u.s. .", "usa"),  # the authors' article rule sees the "a" of "u.s.a." as a word
    ("Jean-Paul Sartre", "jean-paul sartre", "jeanpaul sartre"),
    ("Kraków, Poland", "krak w poland", "kraków poland"),
    ("The Beatles' album", "beatles album", "beatles album"),
    ("rock_and_roll", "rock and roll", "rockandroll"),
])
def test_triviaqa_normalisation_of_each_protocol(text, authors, clean):
    assert normalize_answer(text, "authors") == authors
    assert normalize_answer(text, "clean") == clean


def test_triviaqa_alias_fields_and_prompt_of_each_protocol():
    answer = {"aliases": ["Kraków"], "normalized_aliases": ["krakow"]}
    assert is_correct(" Krakow", answer, "clean") and not is_correct(" Krakow", answer, "authors")
    assert triviaqa_prompt({"question": " Who? "}, "authors") == "Question:  Who? \nAnswer:"
    assert triviaqa_prompt({"question": " Who? "}, "clean") == "Question: Who?\nAnswer:"


def test_triviaqa_decoding_inherits_the_model_generation_config_for_authors():
    tokenizer, model = tiny_tokenizer(), tiny_model(seed=1)
    model.generation_config.repetition_penalty = 1.1  # as Qwen-2.5-Instruct's generation_config.json
    authors = greedy_config(model, tokenizer, 32, "authors")
    clean = greedy_config(model, tokenizer, 32, "clean")
    assert (authors.repetition_penalty, clean.repetition_penalty) == (1.1, 1.0)
    assert authors.do_sample is False and authors.max_new_tokens == 32
    assert authors.eos_token_id == tokenizer.eos_token_id and authors.pad_token_id == tokenizer.pad_token_id
    assert model.generation_config.max_new_tokens != 32 or model.generation_config is not authors
