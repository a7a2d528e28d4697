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

from pydantic import NonNegativeInt, PositiveInt

from smf.options import OPTIONS_CONFIG, checked, mapping, section_names

__all__ = ["ATTRIBUTES", "FIRST_NAMES", "FAMILY_NAMES", "Person", "World", "WorldOptions", "build_world",
           "chance_accuracy", "qa_text", "world_digest", "world_words", "write_world"]

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
        return asdict(self)

    def sizes(self) -> dict[str, int]:
        """Rows of each dataset of the world (the module docstring's table), known without building it."""
        questions = sum(len(templates) for _, _, templates in ATTRIBUTES.values())
        old_qa = self.n_old * questions
        return {"pretrain": self.n_old * self.bio_renders + old_qa,
                "retrofit": self.n_old * self.retrofit_renders + old_qa,
                "background": self.n_old * self.background_renders + old_qa, "train": self.n_new * questions,
                "eval_learn": self.n_new * len(ATTRIBUTES), "eval_heldout": self.heldout_people,
                "eval_retain": self.n_retain}


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


def world_words() -> list[str]:
    """Every word any world text can hold, in a fixed order (the world tokenizer's vocabulary)."""
    words = ["Question:", "Answer:", "\n", *FIRST_NAMES, *FAMILY_NAMES]
    for values, bios, questions in ATTRIBUTES.values():
        words += list(values)
        for template in bios + questions:
            words += [word for word in template.split() if not word.startswith("{")]
    return list(dict.fromkeys(words))


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


def _question(person: Person, attribute: str, template: int) -> dict:
    return {"question": ATTRIBUTES[attribute][2][template].format(name=person.name),
            "answers": [person.facts[attribute]]}


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
    rng = _world_rng(options.seed)
    old, new = _people(rng, options)
    taken: set = set()
    pretrain = _renders(rng, old, options.bio_renders, taken)
    old_qa = [_question(person, attribute, template) for person in old for attribute in ATTRIBUTES
              for template in range(len(ATTRIBUTES[attribute][2]))]
    pretrain += [{"text": qa_text(row["question"], row["answers"][0])} for row in old_qa]  # the same QA texts as
    # the retrofit's and background's: the disjoint texts are the biographies
    rng.shuffle(pretrain)
    heldout = _renders(rng, rng.sample(old, options.heldout_people), 1, taken)
    old_qa_texts = [{"text": qa_text(row["question"], row["answers"][0])} for row in old_qa]
    retrofit = _renders(rng, old, options.retrofit_renders, taken) + old_qa_texts
    background = _renders(rng, old, options.background_renders, taken) + old_qa_texts
    rng.shuffle(retrofit)
    rng.shuffle(background)
    old_facts = [(person, attribute) for person in old for attribute in ATTRIBUTES]
    retain = [_question(person, attribute, 0) for person, attribute in rng.sample(old_facts, options.n_retain)]
    train = [_question(person, attribute, template) for person in new for attribute in ATTRIBUTES
             for template in range(len(ATTRIBUTES[attribute][2]))]
    rng.shuffle(train)
    learn = [_question(person, attribute, 0) for person in new for attribute in ATTRIBUTES]
    rows = {"pretrain": pretrain, "retrofit": retrofit, "background": background, "train": train,
            "eval_learn": learn, "eval_heldout": heldout, "eval_retain": retain}
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
