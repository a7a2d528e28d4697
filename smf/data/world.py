"""A synthetic world of fictional people, generated in code: the science preset's data (docs/science.md).

Every person has a two-part name (first + family name) and one value per attribute (:data:`ATTRIBUTES`), each drawn
from a fixed vocabulary. People are split into *old* (what pretraining teaches) and *new* (the finetuning task). A
new person's name is a new *combination* of name parts that old people carry, so every word a new fact needs is a
word pretraining used (a world tokenizer has one token per word: :mod:`smf.data.world_tokenizer`); names pretraining
never saw would collapse onto one another (docs/science.md, "Why the world looks like this").

The world is rendered as text in the own-data schema (docs/own-data.md): biographies (several sentence templates per
attribute, sentences in random order) and question/answer pairs. Its datasets (no biography in two of them; the old
QA texts are shared by pretraining, retrofit and background, as they are the old knowledge in QA form):

==================  ======  =========================================================================================
``pretrain``        text    old people: ``bio_renders`` biographies each and every old fact as a QA text
``retrofit``        text    old people: fresh biography renders and every old fact as a QA text (the paper's oasst
                            stand-in: text the model knows, in the finetuning task's QA format as well)
``background``      text    old people: more fresh renders and the old QA texts (background statistics)
``train``           qa      new people: every new fact, once per question template (the MedMCQA train stand-in)
``eval_learn``      qa      new people: every new fact, first question template (learning: new-fact accuracy)
``eval_heldout``    text    old people: biographies rendered apart from every other set (held-out perplexity)
``eval_retain``     qa      old people: ``n_retain`` old facts, first question template (old-fact accuracy)
==================  ======  =========================================================================================

Options that take the leaks out and let locality be tested (issue 48; each off by default, and a world with all of
them off has today's rows, digest and base fingerprint):

- ``old_qa_templates`` 3 or 4: the old QA texts ask each old fact with that many templates (:data:`ATTRIBUTES`' two,
  then :data:`PARAPHRASES`), so that pretraining teaches that a fact answers every form of its question;
- ``retain_heldout``: one more dataset, ``eval_retain_heldout`` (qa): ``eval_retain``'s facts, in its order, asked
  with :data:`HELDOUT_QUESTIONS`, a template no text of any world holds (the old-fact probe no training stage saw);
- ``retrofit_qa`` false: the retrofit and background sets hold their biographies alone, no QA text (texts disjoint
  from every evaluation set, as the paper's oasst1 is from TriviaQA);
- ``new_kind``: the new people's facts are of new attribute types (:data:`NEW_KINDS`: their own values and question
  templates), taught only in finetuning (``train``, ``eval_learn``); pretraining learns their words from a generic
  corpus of the world that names no person (:func:`generic_texts`), so no new fact is in it, and the world tokenizer
  of such a world has those words too (:func:`world_words`).

The extra rows of these options are placed with a generator of their own (:func:`_extra_rng`), so that every draw
of the default world's generator stays as it was: the old people, their biographies and the ``eval_retain`` facts of
a world with these options are those of the same world without them.

Everything is a function of :class:`WorldOptions` (``seed`` included): the same options give the same rows.
Every attribute value is one word and no value contains another, so the QA rule's substring match is exact match.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from typing import Annotated

from pydantic import Field, NonNegativeInt, PositiveInt

from smf.options import OPTIONS_CONFIG, checked, mapping, section_names

__all__ = ["ATTRIBUTES", "FIRST_NAMES", "FAMILY_NAMES", "HELDOUT_QUESTIONS", "NEW_KINDS", "PARAPHRASES", "Person",
           "World", "WorldOptions", "build_world", "chance_accuracy", "generic_texts", "qa_text", "world_digest",
           "world_words", "write_world"]

FIRST_NAMES = ("Abel", "Bria", "Cato", "Dara", "Elio", "Fenna", "Galen", "Hedda", "Ivo", "Jora", "Kasimir", "Lio",
               "Mira", "Nilo", "Orla", "Pavo", "Quila", "Rune", "Sela", "Tomo", "Ulla", "Vero", "Wren", "Xeno",
               "Yara", "Zeno", "Amos", "Brisa", "Cyra", "Doran")
FAMILY_NAMES = ("Aldmoor", "Brackwell", "Corvane", "Dunmere", "Eskdale", "Farrow", "Glimmer", "Holloway", "Ingram",
                "Jessop", "Kettle", "Lorimer", "Marrow", "Nettleby", "Oakhurst", "Pellow", "Quarry", "Rookwood",
                "Stellan", "Thorne", "Underhill", "Vantor", "Whitlock", "Yarrow", "Zellweg", "Ashcombe", "Birchall",
                "Cromwell", "Drayton", "Emberly")

# attribute -> (values, biography templates, question templates); every value one word, none inside another.
ATTRIBUTES = {
    "city": (
        ("Ardent", "Belmora", "Calder", "Dovrik", "Elsin", "Forvald", "Gresh", "Hallow", "Istra", "Jadwin",
         "Korrin", "Lunet", "Mordale", "Nimbra", "Ostrel", "Pyrmont"),
        ("{name} was born in {value} .", "{name} grew up in the city of {value} .",
         "the hometown of {name} is {value} ."),
        ("Where was {name} born ?", "Which city is the hometown of {name} ?"),
    ),
    "job": (
        ("baker", "sailor", "weaver", "surgeon", "potter", "glazier", "farrier", "chemist", "jeweller", "lawyer",
         "painter", "miner", "tailor", "pilot", "carpenter", "librarian"),
        ("{name} works as a {value} .", "by trade {name} is a {value} .", "{name} earns a living as a {value} ."),
        ("What is the job of {name} ?", "What does {name} do for a living ?"),
    ),
    "instrument": (
        ("violin", "oboe", "harp", "cello", "flute", "banjo", "trumpet", "sitar", "drums", "piano", "clarinet",
         "bagpipes", "zither", "tuba", "mandolin", "accordion"),
        ("{name} plays the {value} .", "in the evenings {name} practises the {value} .",
         "the favourite instrument of {name} is the {value} ."),
        ("Which instrument does {name} play ?", "What is the favourite instrument of {name} ?"),
    ),
}

# attribute -> question templates beyond ATTRIBUTES' two (old_qa_templates 3 and 4), words of ATTRIBUTES' texts only
PARAPHRASES = {
    "city": ("What is the hometown of {name} ?", "Where is the hometown of {name} ?"),
    "job": ("What job does {name} do ?", "What is {name} by trade ?"),
    "instrument": ("What instrument does {name} play ?", "What does {name} play in the evenings ?"),
}
# attribute -> the held-out question template (eval_retain_heldout): in no text of any world's other sets, and made
# of words ATTRIBUTES' texts hold, so the shipped bases' tokenizers read it one token per word. Chosen among 5-6
# candidates each as the one five bases answered best (docs/locality.md, "Worlds": 0.95-1.00 of the old facts on
# those, 0.87 on a base not used to choose; "What is the trade of {name} ?" got 0.15-0.99 by base).
HELDOUT_QUESTIONS = {
    "city": "Which is the hometown of {name} ?",
    "job": "What does {name} do ?",
    "instrument": "What is the instrument of {name} ?",
}
# New kinds of fact (new_kind): attribute -> (values, generic sentences naming a value and no person, question
# templates). Values: one word each, none inside another or inside an old value or name part.
NEW_KINDS = {
    "pet": (
        ("dog", "parrot", "hamster", "rabbit", "tortoise", "ferret", "canary", "goldfish", "lizard", "pony", "gecko",
         "iguana", "hedgehog", "budgie", "terrapin", "chinchilla"),
        ("some people keep a {value} as a pet .", "a {value} is a pet that many people own ."),
        ("Which pet does {name} keep ?", "What pet does {name} own ?"),
    ),
    "sport": (
        ("tennis", "rowing", "fencing", "archery", "hockey", "cricket", "rugby", "boxing", "skiing", "cycling", "judo",
         "golf", "polo", "karate", "squash", "curling"),
        ("{value} is a sport that people enjoy .", "some people are keen on {value} ."),
        ("Which sport is {name} keen on ?", "What sport does {name} enjoy ?"),
    ),
}

# Distinct biographies of one person: a template per attribute, the sentences in any order (:func:`_biography`).
BIOGRAPHIES_PER_PERSON = math.prod(len(bios) for _, bios, _ in ATTRIBUTES.values()) * math.factorial(len(ATTRIBUTES))


@dataclass(frozen=True)
class WorldOptions:
    """Sizes and seed of a world (``world:`` of a suite config); the same options give the same world."""

    __pydantic_config__ = OPTIONS_CONFIG

    seed: NonNegativeInt = 0
    n_old: PositiveInt = 300  # people pretraining teaches
    n_new: PositiveInt = 100  # people the finetuning task teaches
    bio_renders: PositiveInt = 4  # biographies of each old person in the pretraining corpus
    retrofit_renders: PositiveInt = 1  # biographies of each old person in the retrofit set
    background_renders: PositiveInt = 1  # ... in the background set
    heldout_people: PositiveInt = 100  # old people whose held-out biography is rendered
    n_retain: PositiveInt = 300  # old facts asked in eval_retain
    # issue 48 (the module docstring); left out of to_dict() at these defaults, so older worlds keep their records
    old_qa_templates: Annotated[int, Field(ge=2, le=2 + len(PARAPHRASES["city"]))] = 2  # question templates per
    # attribute in the old QA texts
    retain_heldout: bool = False  # also eval_retain_heldout: eval_retain's facts asked with a held-out template
    retrofit_qa: bool = True  # the old QA texts in the retrofit and background sets (False: biographies only)
    new_kind: bool = False  # the new facts are of new attribute types (NEW_KINDS), taught only in finetuning

    def __post_init__(self) -> None:
        """ValueError, naming the options, for a world :func:`build_world` could not build (every failure it has)."""
        combinations = len(FIRST_NAMES) * len(FAMILY_NAMES)
        if self.n_old + self.n_new > combinations:
            raise ValueError(f"n_old + n_new = {self.n_old + self.n_new} exceeds the {combinations} distinct names")
        if self.heldout_people > self.n_old:
            raise ValueError(f"heldout_people {self.heldout_people} exceeds n_old {self.n_old}")
        if self.n_retain > self.n_old * len(ATTRIBUTES):
            raise ValueError(f"n_retain {self.n_retain} exceeds the {self.n_old * len(ATTRIBUTES)} old facts")
        renders = self.bio_renders + self.retrofit_renders + self.background_renders + 1  # + a held-out one
        if renders > BIOGRAPHIES_PER_PERSON:
            raise ValueError(f"bio_renders + retrofit_renders + background_renders + 1 held-out = {renders} "
                             f"biographies of one person exceed the {BIOGRAPHIES_PER_PERSON} distinct ones")
        new_names = len(_names(_world_rng(self.seed), self)[1])
        if new_names < self.n_new:
            raise ValueError(f"n_new {self.n_new}: only {new_names} new names combine name parts of the {self.n_old} "
                             f"old people (seed {self.seed}); lower n_new or raise n_old")

    @classmethod
    def from_dict(cls, raw: dict | None) -> "WorldOptions":
        """Checked options (ConfigError naming a bad or unknown key or value)."""
        return checked(cls, mapping(raw, "world", cls.__dataclass_fields__), section_names("world"))

    def to_dict(self) -> dict:
        """The options as a dict; those of issue 48 only where they differ from their defaults (what identifies a
        world or a base stays the same for the worlds made before them)."""
        return {key: value for key, value in asdict(self).items()
                if key not in ISSUE48_DEFAULTS or value != ISSUE48_DEFAULTS[key]}

    def pretraining_dict(self) -> dict:
        """:meth:`to_dict` without the options that change no pretraining text nor the old-fact questions its
        stopping rule asks (``retain_heldout``, ``retrofit_qa``): what a base's fingerprint holds of the world, so
        that one base serves a world with and without them."""
        return {key: value for key, value in self.to_dict().items() if key not in ("retain_heldout", "retrofit_qa")}

    def sizes(self) -> dict[str, int]:
        """Rows of each dataset of the world (the module docstring's table), known without building it."""
        kinds = NEW_KINDS if self.new_kind else ATTRIBUTES
        old_qa = self.n_old * len(ATTRIBUTES) * self.old_qa_templates
        stage_qa = old_qa if self.retrofit_qa else 0
        generic = sum(len(values) * len(sentences) for values, sentences, _ in NEW_KINDS.values()) \
            if self.new_kind else 0
        return {"pretrain": self.n_old * self.bio_renders + old_qa + generic,
                "retrofit": self.n_old * self.retrofit_renders + stage_qa,
                "background": self.n_old * self.background_renders + stage_qa,
                "train": self.n_new * sum(len(templates) for _, _, templates in kinds.values()),
                "eval_learn": self.n_new * len(kinds), "eval_heldout": self.heldout_people,
                "eval_retain": self.n_retain, **({"eval_retain_heldout": self.n_retain} if self.retain_heldout else {})}


ISSUE48_DEFAULTS = {"old_qa_templates": 2, "retain_heldout": False, "retrofit_qa": True, "new_kind": False}


@dataclass(frozen=True)
class Person:
    first: str
    family: str
    facts: dict  # attribute -> value

    @property
    def name(self) -> str:
        return f"{self.first} {self.family}"


@dataclass
class World:
    """The people and the datasets of the module docstring (``datasets.Dataset`` each, by role)."""

    options: WorldOptions
    old: list[Person]
    new: list[Person]
    datasets: dict


def qa_text(question: str, answer: str) -> str:
    """The training text of a QA row, as the own-data schema builds it."""
    return f"Question: {question}\nAnswer: {answer}"


def chance_accuracy() -> float:
    """Accuracy of guessing a uniformly random value of the asked attribute (the attributes are equally often
    asked in every QA set of the world)."""
    return sum(1 / len(values) for values, _, _ in ATTRIBUTES.values()) / len(ATTRIBUTES)


def world_words(new_kind: bool = False) -> list[str]:
    """Every word any world text can hold, in a fixed order (the world tokenizer's vocabulary); with ``new_kind``,
    the words of :data:`NEW_KINDS` too (a ``new_kind`` world's)."""
    words = ["Question:", "Answer:", "\n", *FIRST_NAMES, *FAMILY_NAMES]
    for values, bios, questions in (*ATTRIBUTES.values(), *(NEW_KINDS.values() if new_kind else ())):
        words += list(values)
        for template in bios + questions:
            words += [word for word in template.split() if not word.startswith("{")]
    return list(dict.fromkeys(words))


def generic_texts() -> list[str]:
    """The generic corpus of a ``new_kind`` world: every :data:`NEW_KINDS` value in each of its kind's sentences
    (no person named: the words of the new kind of fact, not a fact), in a fixed order."""
    return [sentence.format(value=value) for values, sentences, _ in NEW_KINDS.values() for value in values
            for sentence in sentences]


def _extra_rng(seed: int) -> random.Random:
    """The generator of the rows issue 48's options add (apart from :func:`_world_rng`, whose draws they leave as
    they are)."""
    return random.Random(f"smf-world-extra:{seed}")


def _world_rng(seed: int) -> random.Random:
    """The generator every draw of the world of ``seed`` comes from, in order (names first)."""
    return random.Random(f"smf-world:{seed}")


def _names(rng: random.Random, options: WorldOptions) -> tuple[list[tuple], list[tuple]]:
    """(old, new) (first, family) names, distinct: up to ``n_new`` new ones, each part carried by an old name."""
    names = [(first, family) for first in FIRST_NAMES for family in FAMILY_NAMES]
    rng.shuffle(names)
    old_names, rest = names[:options.n_old], names[options.n_old:]
    old_firsts, old_families = {f for f, _ in old_names}, {f for _, f in old_names}
    return old_names, [name for name in rest if name[0] in old_firsts and name[1] in old_families][:options.n_new]


def _people(rng: random.Random, options: WorldOptions) -> tuple[list[Person], list[Person]]:
    """Old and new people (:func:`_names`; the options' check ensures ``n_new`` new names)."""
    old_names, new_names = _names(rng, options)

    def person(first, family):
        return Person(first, family, {attribute: rng.choice(values) for attribute, (values, _, _) in
                                      ATTRIBUTES.items()})

    return [person(*name) for name in old_names], [person(*name) for name in new_names]


def _biography(rng: random.Random, person: Person) -> str:
    """One render: a random template per attribute, sentences in random order."""
    sentences = [rng.choice(bios).format(name=person.name, value=person.facts[attribute])
                 for attribute, (_, bios, _) in ATTRIBUTES.items()]
    rng.shuffle(sentences)
    return " ".join(sentences)


def _question(person: Person, attribute: str, template: int | str) -> dict:
    """The QA row asking ``person``'s ``attribute`` with question template ``template``: an index into the
    attribute's templates (:data:`ATTRIBUTES` then :data:`PARAPHRASES`; :data:`NEW_KINDS`' for a new kind), or a
    template itself."""
    if isinstance(template, int):
        templates = NEW_KINDS[attribute][2] if attribute in NEW_KINDS else \
            ATTRIBUTES[attribute][2] + PARAPHRASES[attribute]
        template = templates[template]
    return {"question": template.format(name=person.name), "answers": [person.facts[attribute]]}


def _new_kind_people(seed: int, new: list[Person]) -> list[Person]:
    """``new`` with facts of the new kinds instead (:data:`NEW_KINDS`, drawn by :func:`_extra_rng`)."""
    rng = _extra_rng(seed)
    return [Person(person.first, person.family, {kind: rng.choice(values) for kind, (values, _, _) in
                                                 NEW_KINDS.items()}) for person in new]


def _all_biographies(person: Person) -> list[str]:
    """Every distinct render of ``person`` (:data:`BIOGRAPHIES_PER_PERSON`), in a fixed order."""
    choices = [[bio.format(name=person.name, value=person.facts[attribute]) for bio in bios]
               for attribute, (_, bios, _) in ATTRIBUTES.items()]
    return [" ".join(order) for sentences in itertools.product(*choices)
            for order in itertools.permutations(sentences)]


def _renders(rng: random.Random, people: list[Person], per_person: int, taken: set) -> list[dict]:
    """``per_person`` biographies of each person, none equal to a text in ``taken`` (which they join): random
    renders, or after 100 repeats one drawn from those left (the options' check ensures one is left)."""
    rows = []
    for person in people:
        for _ in range(per_person):
            for _attempt in range(100):
                text = _biography(rng, person)
                if text not in taken:
                    break
            else:
                text = rng.choice([text for text in _all_biographies(person) if text not in taken])
            taken.add(text)
            rows.append({"text": text})
    return rows


def build_world(options: WorldOptions | dict | None = None) -> World:
    """The world of ``options`` (a :class:`WorldOptions`, a dict of its fields, or None: the defaults)."""
    import datasets  # heavy (torch, pyarrow): the suite's config checks import this module, not the world

    if not isinstance(options, WorldOptions):
        options = WorldOptions.from_dict(options)
    rng, extra_rng = _world_rng(options.seed), _extra_rng(options.seed)
    old, new = _people(rng, options)
    if options.new_kind:
        new = _new_kind_people(options.seed, new)
    kinds = NEW_KINDS if options.new_kind else ATTRIBUTES
    taken: set = set()
    pretrain = _renders(rng, old, options.bio_renders, taken)
    old_qa = [_question(person, attribute, template) for person in old for attribute in ATTRIBUTES
              for template in range(len(ATTRIBUTES[attribute][2]))]
    pretrain += [{"text": qa_text(row["question"], row["answers"][0])} for row in old_qa]  # the same QA texts as
    # the retrofit's and background's: the disjoint texts are the biographies
    rng.shuffle(pretrain)
    paraphrased = [{"text": qa_text(row["question"], row["answers"][0])} for row in (
        _question(person, attribute, template) for person in old for attribute in ATTRIBUTES
        for template in range(len(ATTRIBUTES[attribute][2]), options.old_qa_templates))]
    generic = [{"text": text} for text in generic_texts()] if options.new_kind else []
    if paraphrased or generic:
        pretrain += paraphrased + generic
        extra_rng.shuffle(pretrain)
    heldout = _renders(rng, rng.sample(old, options.heldout_people), 1, taken)
    old_qa_texts = [{"text": qa_text(row["question"], row["answers"][0])} for row in old_qa]
    retrofit = _renders(rng, old, options.retrofit_renders, taken) + old_qa_texts
    background = _renders(rng, old, options.background_renders, taken) + old_qa_texts
    rng.shuffle(retrofit)
    rng.shuffle(background)
    if not options.retrofit_qa:  # biographies alone, in the order the shuffles gave them
        retrofit, background = ([row for row in rows if not row["text"].startswith("Question:")]
                                for rows in (retrofit, background))
    elif paraphrased:
        retrofit, background = retrofit + paraphrased, background + paraphrased
        extra_rng.shuffle(retrofit)
        extra_rng.shuffle(background)
    old_facts = [(person, attribute) for person in old for attribute in ATTRIBUTES]
    retained = rng.sample(old_facts, options.n_retain)
    retain = [_question(person, attribute, 0) for person, attribute in retained]
    train = [_question(person, attribute, template) for person in new for attribute in kinds
             for template in range(len(kinds[attribute][2]))]
    rng.shuffle(train)
    learn = [_question(person, attribute, 0) for person in new for attribute in kinds]
    rows = {"pretrain": pretrain, "retrofit": retrofit, "background": background, "train": train,
            "eval_learn": learn, "eval_heldout": heldout, "eval_retain": retain}
    if options.retain_heldout:
        rows["eval_retain_heldout"] = [_question(person, attribute, HELDOUT_QUESTIONS[attribute])
                                       for person, attribute in retained]
    return World(options, old, new, {role: datasets.Dataset.from_list(role_rows) for role, role_rows in rows.items()})


def world_digest(world: World) -> str:
    """16 hex digits of every row of every dataset of ``world`` (what its files hold)."""
    rows = {role: [dict(row) for row in dataset] for role, dataset in sorted(world.datasets.items())}
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]


def write_world(world: World, directory: str | Path) -> dict[str, str]:
    """Each dataset of ``world`` as ``{directory}/{role}.jsonl`` (own-data schema), plus ``world.json`` (the options,
    the people and :func:`world_digest`, which tells a reader whether the files are this world's); returns role ->
    path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for role, dataset in world.datasets.items():
        path = directory / f"{role}.jsonl"
        with path.open("w") as handle:
            for row in dataset:
                handle.write(json.dumps(row) + "\n")
        paths[role] = str(path)
    people = {kind: [{"name": p.name, **p.facts} for p in group] for kind, group in (("old", world.old),
                                                                                     ("new", world.new))}
    record = {"options": world.options.to_dict(), "digest": world_digest(world), **people}
    (directory / "world.json").write_text(json.dumps(record, indent=1))
    return paths
