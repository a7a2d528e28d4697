"""The run options grouped by section (smf.train.sections): each option declared once, RunConfig holding them in
the order run_config.json files have always had, and a flag of a section the run's stage does not take refused by
the section's absence alone (no per-option rule)."""
import dataclasses

import pytest

from smf.errors import ConfigError
from smf.options import takes
from smf.train.config import RECORDED_ORDER, RunConfig, build_config, refuse_unused
from smf.train.sections import SECTION_OF, SECTIONS, STAGE_SECTIONS
from smf.vocabulary import TRAIN_RECIPES


def test_every_option_is_declared_in_one_section_and_run_config_holds_them_in_the_recorded_order():
    declared = [spec.name for section in SECTIONS.values() for spec in dataclasses.fields(section)]
    assert len(declared) == len(set(declared))
    held = [spec.name for spec in dataclasses.fields(RunConfig)]  # recorded ones first, newer ones after
    assert held == list(RECORDED_ORDER) + [name for name in declared if name not in RECORDED_ORDER]
    assert sorted(held) == sorted(declared)
    for section in SECTIONS.values():  # the field as declared: default, help text, commands
        for spec in dataclasses.fields(section):
            field = RunConfig.__dataclass_fields__[spec.name]
            assert (field.default, dict(field.metadata)) == (spec.default, dict(spec.metadata))


def test_every_stage_takes_the_shared_sections_and_only_its_own_recipe_section():
    assert {name for sections in STAGE_SECTIONS.values() for name in sections} == set(SECTIONS)
    for stage, sections in STAGE_SECTIONS.items():
        assert {"run", "model", "data"} <= set(sections)
        assert ("lora" in sections) == (stage == "lora") and ("sparse" in sections) == (stage == "sparse")


@pytest.mark.parametrize("recipe", TRAIN_RECIPES)
def test_a_flag_of_a_section_the_recipe_does_not_take_is_refused_and_the_others_are_not(recipe, tmp_path):
    given = {"output_dir": str(tmp_path), "preset": "tiny", "recipe": recipe}
    if recipe == "sparse":
        given.update(adapter=str(tmp_path), background=str(tmp_path))
    config = build_config("train", {}, given)
    foreign = [name for name in takes(RunConfig, "train") if SECTION_OF[name] not in STAGE_SECTIONS[recipe]]
    assert foreign  # every recipe lacks another recipe's section
    for name in foreign:
        with pytest.raises(ConfigError, match=f"is not used by this run: only --recipe .* uses it \\(this run is "
                                              f"--recipe {recipe}\\)"):
            refuse_unused(config, "train", {name: RunConfig.__dataclass_fields__[name].default}, {})
    for name in ("lr", "epochs", "max_length", "seed", "save_every"):  # shared sections: taken by every recipe
        refuse_unused(config, "train", {name: getattr(config, name)}, {})


def test_a_section_check_runs_only_for_the_stages_that_take_it(tmp_path):
    with pytest.raises(ConfigError, match="--background .* is required for --recipe sparse"):
        build_config("train", {}, {"output_dir": str(tmp_path), "preset": "tiny", "adapter": str(tmp_path)})
    lora = build_config("train", {}, {"output_dir": str(tmp_path), "preset": "tiny", "recipe": "lora"})
    assert lora.background is None and lora.adapter is None


def test_an_option_added_after_the_recorded_order_leaves_fingerprints_alone_at_its_default(monkeypatch):
    """Planted: lora_r as if added now (not in the recorded order); suite directories written before it still
    match while it stays at its default, and a run that sets it is another run."""
    from smf.suite import fingerprints

    before = fingerprints.options_fingerprint({"lr": 0.1})
    assert fingerprints.options_fingerprint({"lr": 0.1, "lora_r": 16}) != before  # recorded: hashed at any value
    monkeypatch.setattr(fingerprints, "RECORDED_ORDER", tuple(name for name in RECORDED_ORDER if name != "lora_r"))
    assert fingerprints.options_fingerprint({"lr": 0.1, "lora_r": 16}) == before
    assert fingerprints.options_fingerprint({"lr": 0.1, "lora_r": 8}) != before


def test_help_lists_each_flag_under_its_section_naming_the_recipes_that_take_it(capsys):
    from smf.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    groups, title = {}, None
    for line in capsys.readouterr().out.splitlines():  # a group: its title at column 0, its flags indented
        title = line if line and not line.startswith(" ") else title
        groups.setdefault(title, []).append(line)
    flags = {title: " ".join(lines) for title, lines in groups.items()}
    lora = flags["lora options (--recipe lora):"]
    assert "--lora-r" in lora and "--lr " not in lora
    assert all(flag in flags["sparse options (--recipe sparse):"]
               for flag in ("--rule", "--update", "--rows-per-step", "--background"))
    assert "--lr " in flags["optimizer options:"] and "--lora-r" not in flags["optimizer options:"]  # every recipe's
