"""World options that cannot be built are refused by their check, in one line naming the options (issue 42 item 3):
every options value the check accepts builds, biographies up to the distinct limit included, and `smf suite` refuses
an unbuildable world before anything is written."""
import itertools

import pytest
import yaml

from smf.data.world import BIOGRAPHIES_PER_PERSON, WorldOptions, _all_biographies, build_world
from smf.errors import ConfigError
from test_cli_reliability import one_line_error
from test_cli_smf import run_main


@pytest.mark.parametrize("options, message", [
    ({"n_old": 2, "n_new": 3, "heldout_people": 1, "n_retain": 1}, "world: n_new 3: only 0 new names combine"),
    ({"bio_renders": 170}, "world: bio_renders + retrofit_renders + background_renders + 1 held-out = 173"),
    ({"bio_renders": 100, "retrofit_renders": 30, "background_renders": 32},
     f"world: bio_renders + retrofit_renders + background_renders + 1 held-out = 163 biographies of one person exceed "
     f"the {BIOGRAPHIES_PER_PERSON}"),
    ({"n_old": 5, "heldout_people": 6, "n_retain": 1}, "world: heldout_people 6 exceeds n_old 5"),
    ({"bio_render": 8}, "world: unknown key 'bio_render'; valid keys: seed, n_old"),  # a typo was ignored
])
def test_an_unbuildable_world_is_refused_by_its_options(options, message):
    with pytest.raises(ConfigError) as refused:
        WorldOptions.from_dict(options)
    assert str(refused.value).startswith(message)


def test_every_accepted_small_world_builds():
    """Small worlds over seeds and sizes: the check refuses exactly those build_world could not build (it raises
    nothing else), so each accepted one builds with the sizes asked."""
    accepted = refused = 0
    for seed, n_old, n_new in itertools.product((0, 1), (1, 2, 4), (1, 3, 9)):
        raw = {"seed": seed, "n_old": n_old, "n_new": n_new, "heldout_people": 1, "n_retain": 1}
        try:
            WorldOptions.from_dict(raw)
        except ConfigError:
            refused += 1
            continue
        world = build_world(raw)
        accepted += 1
        assert len(world.new) == n_new and len(world.old) == n_old
    assert accepted and refused


def test_biographies_up_to_the_distinct_limit_build_and_differ():
    """One more render than the limit is refused; the limit itself builds (the last renders, which random draws
    rarely find, drawn from those left), every render distinct."""
    renders = {"retrofit_renders": 1, "background_renders": 1, "bio_renders": BIOGRAPHIES_PER_PERSON - 3}
    raw = {"n_old": 4, "n_new": 1, "heldout_people": 4, "n_retain": 1, **renders}
    with pytest.raises(ConfigError, match="exceed"):
        WorldOptions.from_dict({**raw, "bio_renders": BIOGRAPHIES_PER_PERSON - 2})
    world = build_world(raw)
    texts = [row["text"] for role in ("pretrain", "retrofit", "background", "eval_heldout")
             for row in world.datasets[role] if not row["text"].startswith("Question:")]
    assert len(texts) == len(set(texts)) == 4 * BIOGRAPHIES_PER_PERSON
    assert len(set(_all_biographies(world.old[0]))) == BIOGRAPHIES_PER_PERSON


def test_suite_refuses_an_unbuildable_world_in_one_line(tmp_path, capsys):
    config = {"output_dir": str(tmp_path / "out"), "seeds": [0], "conditions": ["base"], "device": "cpu",
              "world": {"n_old": 2, "n_new": 3, "heldout_people": 1, "n_retain": 1}}
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(config))
    for dry_run in (["--dry-run"], []):
        code, err = run_main(["suite", "--config", str(tmp_path / "suite.yaml"), *dry_run], capsys)
        one_line_error(code, err, "world: n_new 3: only 0 new names")
    assert not (tmp_path / "out").exists()


def test_world_sizes_are_those_it_builds():
    options = WorldOptions.from_dict({"seed": 3, "n_old": 12, "n_new": 5, "bio_renders": 2, "retrofit_renders": 2,
                                      "background_renders": 3, "heldout_people": 4, "n_retain": 7})
    assert options.sizes() == {role: len(rows) for role, rows in build_world(options).datasets.items()}


def test_suite_refuses_a_world_whose_train_set_is_short_of_one_batch(tmp_path, capsys):
    """Before: refused by the trainer after pretraining, the base run, the retrofit and the background."""
    config = {"model": "tiny", "output_dir": str(tmp_path / "out"), "seeds": [0], "device": "cpu",
              "conditions": ["base", "additive-kl"], "protocol": "clean",
              "world": {"n_old": 40, "n_new": 2, "heldout_people": 10, "n_retain": 40},
              "train": {"global_batch_size": 16, "micro_batch_size": 4}}
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(config))
    code, err = run_main(["suite", "--config", str(tmp_path / "suite.yaml"), "--dry-run"], capsys)
    one_line_error(code, err, "world: the train set: 12 rows, fewer than one global batch of 16; lower "
                              "global_batch_size (train or stages.sparse) or add rows")
