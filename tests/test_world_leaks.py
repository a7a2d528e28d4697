"""Issue 48's world options (smf/data/world.py) on reduced worlds: the defaults keep today's rows, digests, tokenizer
and shipped-base fingerprints; the held-out old-fact probe asks in a form no training text holds; retrofit and
background without QA texts are disjoint from every evaluation set; a new-kind world's new facts have words, values and
templates of their own, one token per word, and appear in finetuning only."""
import itertools
import re
from pathlib import Path

import pytest
import yaml

from smf.data.world import (ATTRIBUTES, FAMILY_NAMES, FIRST_NAMES, HELDOUT_QUESTIONS, NEW_KINDS, PARAPHRASES,
                            WorldOptions, build_world, generic_texts, qa_text, world_digest, world_words)
from smf.errors import ConfigError
from test_science import SMALL_WORLD

TRAINING = ("pretrain", "retrofit", "background", "train")
EVALUATION = ("eval_learn", "eval_heldout", "eval_retain", "eval_retain_heldout")
LEAK_FREE = {"old_qa_templates": 4, "retain_heldout": True, "retrofit_qa": False}
SCIENCE = Path(__file__).parents[1] / "smf" / "configs" / "suite_science.yaml"


def _texts(world, role) -> list[str]:
    """Every text of a dataset: a text row's text, a qa row as its training text."""
    return [row["text"] if "text" in row else qa_text(row["question"], row["answers"][0])
            for row in world.datasets[role]]


def _science_world(seed: int) -> dict:
    return {**yaml.safe_load(SCIENCE.read_text())["world"], "seed": seed}


def test_default_options_keep_todays_world_tokenizer_and_base_fingerprint():
    """Digests recorded before the options existed: the rows, the tokenizer and the shipped base of seed 0."""
    from smf.data.world_tokenizer import world_tokenizer
    from smf.train.pretrain import PretrainOptions, pretrain_fingerprint, tokenizer_digest

    reduced = {"n_old": 20, "n_new": 6, "heldout_people": 5, "n_retain": 12}
    assert world_digest(build_world(reduced)) == "056c001e165c240d"
    assert world_digest(build_world({**reduced, "old_qa_templates": 2, "retrofit_qa": True})) == "056c001e165c240d"
    assert "retain_heldout" not in WorldOptions.from_dict(reduced).to_dict()  # records of older worlds unchanged
    tokenizer = world_tokenizer()
    assert tokenizer_digest(tokenizer) == "f2e86a9e236e9319"
    assert tokenizer_digest(world_tokenizer(WorldOptions.from_dict(LEAK_FREE))) == "f2e86a9e236e9319"
    world = build_world(_science_world(0))
    assert world_digest(world) == "c66c6efc68d24b43"
    texts = [row["text"] + "\n\n" for row in world.datasets["pretrain"]]
    pretrain = yaml.safe_load(SCIENCE.read_text())["pretrain"]
    assert pretrain_fingerprint(world.options, PretrainOptions.from_dict({**pretrain, "seed": 0}), texts,
                                tokenizer) == "023d98daca64e143"  # smf/assets/science/base-seed0
    leak_free = build_world({**_science_world(0), "retain_heldout": True, "retrofit_qa": False})
    assert leak_free.datasets["pretrain"][:] == world.datasets["pretrain"][:]
    assert pretrain_fingerprint(leak_free.options, PretrainOptions.from_dict({**pretrain, "seed": 0}), texts,
                                tokenizer) == "023d98daca64e143"  # options of no pretraining text: the same base


def test_the_options_leave_the_default_draws_alone():
    """Old people, their pretraining biographies and the eval_retain facts are those of the world without them."""
    plain, leak_free = build_world(SMALL_WORLD), build_world({**SMALL_WORLD, **LEAK_FREE, "new_kind": True})
    assert plain.old == leak_free.old and [p.name for p in plain.new] == [p.name for p in leak_free.new]
    for role in ("eval_retain", "eval_heldout"):
        assert list(plain.datasets[role]) == list(leak_free.datasets[role])
    assert set(_texts(plain, "pretrain")) <= set(_texts(leak_free, "pretrain"))


@pytest.mark.parametrize("new_kind", [False, True])
def test_the_heldout_probe_is_in_no_training_text(new_kind):
    world = build_world({**SMALL_WORLD, **LEAK_FREE, "new_kind": new_kind})
    retain, heldout = world.datasets["eval_retain"], world.datasets["eval_retain_heldout"]
    assert len(heldout) == len(retain) == SMALL_WORLD["n_retain"]
    assert [row["answers"] for row in heldout] == [row["answers"] for row in retain]  # the same facts, in order
    assert all(a["question"] != b["question"] for a, b in zip(retain, heldout))
    training = "\n".join(text for role in TRAINING for text in _texts(world, role))
    for person, template in itertools.product(world.old + world.new, HELDOUT_QUESTIONS.values()):
        assert template.format(name=person.name) not in training
    probe = "\n".join(_texts(world, "eval_retain_heldout"))
    for template in HELDOUT_QUESTIONS.values():  # nor its form with any name at all (the probe's own texts have it)
        form = re.escape(template).replace(re.escape("{name}"), r"\S+ \S+")
        assert re.search(form, probe) and not re.search(form, training), template
    paraphrased = "\n".join(_texts(world, "pretrain"))
    for attribute, templates in PARAPHRASES.items():  # old_qa_templates 4: both paraphrases of every old fact
        for person in world.old:
            for template in templates:
                assert qa_text(template.format(name=person.name), person.facts[attribute]) in paraphrased


def test_retrofit_and_background_without_qa_are_disjoint_from_every_evaluation_set():
    world = build_world({**SMALL_WORLD, **LEAK_FREE})
    questions = [row["question"] for role in ("eval_learn", "eval_retain", "eval_retain_heldout")
                 for row in world.datasets[role]]
    heldout = set(_texts(world, "eval_heldout"))
    for role in ("retrofit", "background"):
        texts = _texts(world, role)
        assert len(texts) == SMALL_WORLD["n_old"] and not any(text.startswith("Question:") for text in texts)
        assert not heldout & set(texts)
        assert not any(question in text for question in questions for text in texts)
    assert WorldOptions.from_dict({**SMALL_WORLD, **LEAK_FREE}).sizes() == {
        role: len(dataset) for role, dataset in world.datasets.items()}


def test_new_kind_facts_have_their_own_values_and_templates_and_appear_in_finetuning_only():
    world = build_world({**SMALL_WORLD, "new_kind": True})
    old_values = {value for values, _, _ in ATTRIBUTES.values() for value in values}
    new_values = [value for values, _, _ in NEW_KINDS.values() for value in values]
    assert not set(NEW_KINDS) & set(ATTRIBUTES) and not set(new_values) & old_values
    every = [*old_values, *new_values, *FIRST_NAMES, *FAMILY_NAMES]
    assert len(set(every)) == len(every)
    for value, other in itertools.permutations({*old_values, *new_values}, 2):
        assert value not in other, (value, other)  # the QA rule's substring match is exact match
    new_templates = {template for _, _, templates in NEW_KINDS.values() for template in templates}
    old_templates = {template for _, _, templates in ATTRIBUTES.values() for template in templates}
    assert not new_templates & old_templates
    assert all(set(person.facts) == set(NEW_KINDS) for person in world.new)
    assert {row["question"] for row in world.datasets["train"]} == {
        template.format(name=person.name) for template in new_templates for person in world.new}
    assert len(world.datasets["eval_learn"]) == SMALL_WORLD["n_new"] * len(NEW_KINDS)
    names = {person.name for person in world.old + world.new}
    generic = set(generic_texts())
    assert generic <= set(_texts(world, "pretrain"))
    assert not any(name in text for text in generic for name in names)  # the new kinds' words, no fact
    pretrained = {word for text in _texts(world, "pretrain") for word in text.split()}
    assert {word for role in ("train", "eval_learn") for text in _texts(world, role)
            for word in text.split()} <= pretrained  # every word finetuning reads has a trained embedding
    for role in ("pretrain", "retrofit", "background"):  # no new person's new-kind fact outside finetuning
        for text in _texts(world, role):
            assert not any(person.name in text for person in world.new)
    assert WorldOptions.from_dict({**SMALL_WORLD, "new_kind": True}).sizes() == {
        role: len(dataset) for role, dataset in world.datasets.items()}


def test_every_word_is_one_token_of_its_worlds_tokenizer():
    """The paraphrased and held-out templates use the default world's words (the shipped bases read them one token
    each); a new-kind world's tokenizer has the new kinds' words as single tokens too."""
    from smf.data.world_tokenizer import world_tokenizer

    extra = [*HELDOUT_QUESTIONS.values(), *(t for templates in PARAPHRASES.values() for t in templates)]
    assert {word for template in extra for word in template.split() if word != "{name}"} <= set(world_words())
    for new_kind in (False, True):
        world = build_world({**SMALL_WORLD, **LEAK_FREE, "new_kind": new_kind})
        tokenizer = world_tokenizer(world.options)
        words = {word for role in world.datasets for text in _texts(world, role) for word in text.split()}
        assert words <= set(world_words(new_kind)) | {"Question:", "Answer:"}
        for word in words - {"Question:", "Answer:"}:
            assert len(tokenizer(word)["input_ids"]) == len(tokenizer(" " + word)["input_ids"]) == 1, word
        for text in _texts(world, "eval_retain_heldout") + _texts(world, "eval_learn"):
            assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_issue48_options_are_checked():
    with pytest.raises(ConfigError, match="old_qa_templates"):
        WorldOptions.from_dict({"old_qa_templates": 2 + len(PARAPHRASES["city"]) + 1})
    with pytest.raises(ConfigError, match="retrofit_qa"):
        WorldOptions.from_dict({"retrofit_qa": "sometimes"})


def test_a_leak_free_new_kind_suite_reports_both_probes_and_the_read_overlap(tmp_path):
    """A reduced new-kind world with every leak option through the science preset's stages: each run evaluated on
    the held-out probe as well (retain_heldout_acc), science_diagnostics with the two probes side by side and each
    retrofit's read overlap."""
    import json

    from smf.suite.config import load_suite_config
    from smf.suite.report import write_suite_report
    from smf.suite.runner import run_suite
    from test_science import SMALL_PRETRAIN

    raw = yaml.safe_load(SCIENCE.read_text())
    raw.update(output_dir=str(tmp_path / "suite"), seeds=[3], conditions=["base", "additive-tfidf", "full"],
               world={**{k: v for k, v in SMALL_WORLD.items() if k != "seed"}, **LEAK_FREE, "new_kind": True},
               pretrain={k: v for k, v in {**SMALL_PRETRAIN, "epochs": 2}.items() if k != "seed"},
               lr_sweep={"sparse": [1e-2], "full": [1e-3]})
    for key in ("variants", "schedule_sweep", "hypotheses"):  # one rate each, no SMF configurations
        raw.pop(key, None)
    raw["train"].update(layers=[0, 1], n_keys=8, topk=4, key_dim=16, rows_per_step=16, n_background=20,
                        global_batch_size=8, micro_batch_size=8)
    raw["stages"] = {"retrofit": {"epochs": 1}, "sparse": {"epochs": 1}, "full": {"epochs": 1}}
    path = tmp_path / "science.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_suite_config(str(path))
    assert "retain_heldout" in config.eval.tasks
    results = run_suite(config)
    for result in results:
        assert set(result["metrics"]) == {"learn_acc", "heldout_ppl", "retain_acc", "retain_heldout_acc"}
    write_suite_report(config.output_dir)
    diagnostics = json.loads((config.output_dir / "science_diagnostics.json").read_text())
    overlap = diagnostics["retrofit"]["additive-seed3"]["read_overlap"]
    assert set(overlap["layers"]) == {"0", "1"} and all(0 <= v <= 1 for v in overlap["overall"].values())
    text = (config.output_dir / "science_diagnostics.md").read_text()
    assert "## Read overlap" in text and "## Old facts asked as in training, and with a template" in text
