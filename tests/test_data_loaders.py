"""Loaders on the bundled fixtures: schema, filtering, counts, determinism, formatting."""
from pathlib import Path

import datasets
import pytest

from smf.data import (
    assistant_pairs,
    load_medmcqa,
    load_oasst1,
    load_split,
    load_triviaqa,
    load_wikitext,
    retrofit_and_background,
    subset,
    triviaqa_prompt,
)
from smf.data import medmcqa, oasst
from smf.errors import ConfigError
from smf.tiny import tiny_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
MEDMCQA_TRAIN = FIXTURES / "medmcqa_train.jsonl"
MEDMCQA_COLUMNS = ["id", "question", "opa", "opb", "opc", "opd", "cop", "choice_type", "exp", "subject_name",
                   "topic_name"]


def test_medmcqa_schema_and_deterministic_subsets():
    rows = load_medmcqa(path=MEDMCQA_TRAIN)
    assert rows.column_names == MEDMCQA_COLUMNS and len(rows) == 30
    assert all(isinstance(c, int) and 0 <= c <= 3 for c in rows["cop"])
    assert set(rows["choice_type"]) == {"single", "multi"}

    first = load_medmcqa(path=MEDMCQA_TRAIN, n=10)
    assert first["id"] == rows["id"][:10]
    drawn = load_medmcqa(path=MEDMCQA_TRAIN, n=10, seed=3)
    assert drawn["id"] == load_medmcqa(path=MEDMCQA_TRAIN, n=10, seed=3)["id"]
    assert drawn["id"] != load_medmcqa(path=MEDMCQA_TRAIN, n=10, seed=4)["id"]
    assert set(drawn["id"]) <= set(rows["id"]) and len(set(drawn["id"])) == 10
    assert sorted(load_medmcqa(path=MEDMCQA_TRAIN, seed=3)["id"]) == sorted(rows["id"])


def test_medmcqa_single_only_filters_multi_choice():
    val = load_medmcqa("validation", path=FIXTURES / "medmcqa_validation.jsonl", single_only=True)
    assert len(val) == 29 and set(val["choice_type"]) == {"single"}
    assert len(load_medmcqa("validation", path=FIXTURES / "medmcqa_validation.jsonl", single_only=True, n=5)) == 5


def test_medmcqa_prompt_and_continuations():
    example = {"question": "Which vitamin is fat soluble? ", "opa": "Vitamin C", "opb": " Vitamin K",
               "opc": "Thiamine", "opd": "Folate", "cop": 1}
    assert medmcqa.format_prompt(example, "clean") == (
        "Question: Which vitamin is fat soluble?\nA. Vitamin C\nB. Vitamin K\nC. Thiamine\nD. Folate\nAnswer:")
    assert medmcqa.option_continuations(example, "clean") == [" A. Vitamin C", " B. Vitamin K", " C. Thiamine",
                                                              " D. Folate"]
    assert medmcqa.format_example(example, "clean") == {"prompt": medmcqa.format_prompt(example, "clean"),
                                                        "target": " B. Vitamin K"}
    for row in load_medmcqa(path=MEDMCQA_TRAIN):
        target = medmcqa.format_example(row, "clean")["target"]
        assert target == f" {'ABCD'[row['cop']]}. {row[('opa', 'opb', 'opc', 'opd')[row['cop']]].strip()}"
    with pytest.raises(ValueError, match=r"'cop' must be an int in \[0, 3\]"):
        medmcqa.format_example({**example, "cop": 4})


def test_local_path_formats_give_the_same_rows(tmp_path):
    rows = load_split("unused/hub-id", None, "train", MEDMCQA_TRAIN)
    rows.to_parquet(str(tmp_path / "train.parquet"))
    rows.save_to_disk(str(tmp_path / "dataset"))
    datasets.DatasetDict({"train": rows}).save_to_disk(str(tmp_path / "dict"))
    for path in (tmp_path / "train.parquet", tmp_path / "dataset", tmp_path / "dict"):
        assert load_medmcqa(path=path).to_list() == rows.to_list()
    (tmp_path / "not_a_dataset").mkdir()
    (tmp_path / "bad.jsonl").write_text('{"question": "q"}\nnot json\n')
    for path, message in ((tmp_path / "dict", "holds splits \\['train'\\], not 'validation'"),
                          (FIXTURES / "README.md", "not a dataset file: expected a .jsonl"),
                          (tmp_path / "missing.jsonl", "no such path"), ("/dev/null", "not a dataset file"),
                          (tmp_path / "not_a_dataset", "not a dataset saved by save_to_disk"),
                          (tmp_path / "bad.jsonl", "bad.jsonl' cannot be read")):
        with pytest.raises(ConfigError, match=message):  # one clear error naming the path, whatever the format
            load_medmcqa("validation" if path == tmp_path / "dict" else "train", path=path)


def test_subset_rejects_bad_n_and_tolerates_too_large():
    rows = load_medmcqa(path=MEDMCQA_TRAIN)
    assert len(subset(rows, 1000)) == 30
    with pytest.raises(ValueError, match="n must be"):
        subset(rows, -1)


def test_oasst_pairs_filter_language_deletion_and_link_prompts():
    messages = load_oasst1(path=FIXTURES / "oasst1_train.jsonl")
    assert {"message_id", "parent_id", "text", "role", "lang", "rank", "deleted", "review_result",
            "message_tree_id"} <= set(messages.column_names)
    rows = messages.to_list()
    by_id = {r["message_id"]: r for r in rows}
    pairs = assistant_pairs(messages)
    assert len(pairs) == 28 and len(assistant_pairs(messages, languages=None)) == 33
    for pair in pairs:
        message = by_id[pair["message_id"]]
        parent = by_id[message["parent_id"]]
        assert message["role"] == "assistant" and message["lang"] == "en" and not message["deleted"]
        assert parent["role"] == "prompter" and not parent["deleted"]
        assert (pair["prompt"], pair["target"]) == (parent["text"], message["text"])
    prompts = {p["prompt"] for p in pairs}
    assert "What is a prime number?" not in prompts  # deleted tree
    assert "Yes, it is fine." not in {p["target"] for p in pairs}  # deleted reply
    assert "Then why are sunsets red?" in prompts  # a follow-up turn pairs with its own prompt
    assert any(p["rank"] is None for p in pairs) and any(p["rank"] == 1 for p in pairs)


def ids(pairs):
    return [pair["message_id"] for pair in pairs]


def test_retrofit_and_background_are_disjoint_when_possible_and_deterministic():
    pairs = assistant_pairs(load_oasst1(path=FIXTURES / "oasst1_train.jsonl"))
    retrofit, background = retrofit_and_background(pairs, n_retrofit=20, n_background=6, seed=1)
    assert len(retrofit) == 20 and len(background) == 6 and not set(ids(retrofit)) & set(ids(background))
    again = retrofit_and_background(pairs, n_retrofit=20, n_background=6, seed=1)
    assert (ids(retrofit), ids(background)) == (ids(again[0]), ids(again[1]))
    assert ids(retrofit) != ids(retrofit_and_background(pairs, 20, 6, seed=2)[0])

    retrofit, background = retrofit_and_background(pairs, n_retrofit=50_000, n_background=2_000, seed=0)
    assert len(retrofit) == 28 and len(background) == 28  # all pairs; background must overlap
    retrofit, background = retrofit_and_background(pairs, n_retrofit=25, n_background=6, seed=0)
    assert len(background) == 6 and len(set(ids(background)) & set(ids(retrofit))) == 3


def test_oasst_formatting_uses_the_chat_template():
    pair = {"prompt": "Why?", "target": "Because."}
    example = oasst.format_example(pair, tiny_tokenizer())
    assert example == {"prompt": "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n", "target": "Because."}


def test_wikitext_rows_keep_order_and_empty_lines():
    rows = load_wikitext(path=FIXTURES / "wikitext103_test.jsonl")
    assert rows.column_names == ["text"] and len(rows) == 47
    assert rows[0]["text"] == "" and rows[1]["text"] == " = Harbour Lighthouse of Vell = \n"
    assert sum(text == "" for text in rows["text"]) > 10


def test_triviaqa_schema_and_prompt():
    rows = load_triviaqa(path=FIXTURES / "triviaqa_validation.jsonl", n=12)
    assert len(rows) == 12
    assert rows.column_names == ["question", "question_id", "question_source", "entity_pages", "search_results",
                                 "answer"]
    answer = rows[0]["answer"]
    assert set(answer) == {"aliases", "normalized_aliases", "matched_wiki_entity_name",
                           "normalized_matched_wiki_entity_name", "normalized_value", "type", "value"}
    assert answer["value"] in answer["aliases"] and answer["normalized_value"] in answer["normalized_aliases"]
    assert triviaqa_prompt(rows[0]) == f"Question: {rows[0]['question']}\nAnswer:"
