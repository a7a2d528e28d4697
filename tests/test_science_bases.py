"""The science preset's bases (smf.train.pretrain, smf.suite.science): the stopping rule, what identifies a base and
when one is reused, the shipped bases, unreadable cache files, and a world and base per seed."""
import json
import shutil

import pytest
import torch

from smf.data.world import WorldOptions
from smf.errors import ConfigError
from smf.suite.config import parse_suite_config
from smf.train import pretrain as module
from smf.train.pretrain import CHECKPOINT, FINAL, MARKER, PretrainOptions, pretrain_world

WORLD = {"seed": 5, "n_old": 24, "n_new": 4, "bio_renders": 2, "heldout_people": 4, "n_retain": 24}
TINY = {"hidden_size": 16, "intermediate_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
        "epochs": 2, "lr": 1e-2, "batch_size": 16, "warmup_steps": 2}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = tmp_path_factory.mktemp("base")
    return directory, pretrain_world(WorldOptions.from_dict(WORLD), PretrainOptions.from_dict(TINY), directory)


def test_marker_records_files_epochs_and_environment(base):
    directory, marker = base
    assert marker["files"] == module.file_digests(directory / FINAL) and "model.safetensors" in marker["files"]
    assert marker["epochs_trained"] <= TINY["epochs"] and marker["source"] == "pretrained here"
    assert marker["environment"]["torch"] and marker["environment"]["cpu"]
    assert marker["reached_target"] == (marker["old_qa_accuracy"] >= 0.98)
    assert not (directory / CHECKPOINT).exists()


def test_training_stops_at_the_first_epoch_reaching_the_target(tmp_path, monkeypatch):
    accuracies = iter([0.5, 0.97, 0.98, 0.99])
    monkeypatch.setattr(module, "old_qa_accuracy", lambda *args: next(accuracies))
    marker = pretrain_world(WorldOptions.from_dict(WORLD), PretrainOptions.from_dict({**TINY, "epochs": 6}), tmp_path)
    assert marker["epochs_trained"] == 3 and marker["reached_target"] and marker["old_qa_accuracy"] == 0.98


def test_a_base_whose_files_changed_is_refused_not_reused(base, tmp_path):
    directory, _ = base
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    world, options = WorldOptions.from_dict(WORLD), PretrainOptions.from_dict(TINY)
    assert pretrain_world(world, options, copy)["skipped"]
    tokenizer_file = copy / FINAL / "tokenizer.json"
    tokenizer_file.write_text(tokenizer_file.read_text()[:100])  # truncated
    with pytest.raises(ConfigError, match="differ from those"):
        pretrain_world(world, options, copy)
    with pytest.raises(ConfigError, match="other world or pretrain options, or by an older pretraining"):
        pretrain_world(world, PretrainOptions.from_dict({**TINY, "lr": 2e-2}), directory)


def test_the_fingerprint_covers_the_code_version_and_the_tokenizer(base, monkeypatch):
    directory, marker = base
    world, options = WorldOptions.from_dict(WORLD), PretrainOptions.from_dict(TINY)
    monkeypatch.setattr(module, "CODE_VERSION", module.CODE_VERSION + 1)
    with pytest.raises(ConfigError, match="older pretraining"):
        pretrain_world(world, options, directory)


def test_unreadable_and_foreign_checkpoints(tmp_path, caplog):
    world, options = WorldOptions.from_dict(WORLD), PretrainOptions.from_dict({**TINY, "epochs": 1})
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / CHECKPOINT).write_bytes(b"PK\x03\x04 truncated")
    marker = pretrain_world(world, options, tmp_path / "a")  # starts over, says so
    assert not marker["skipped"] and "cannot be read" in caplog.text
    (tmp_path / "b").mkdir()
    torch.save({"model": {}, "step": 3}, tmp_path / "b" / CHECKPOINT)  # no fingerprint
    with pytest.raises(ConfigError, match="other world or pretrain options"):
        pretrain_world(world, options, tmp_path / "b")
    (tmp_path / "c").mkdir()
    state = torch.load(tmp_path / "b" / CHECKPOINT, weights_only=True)
    from smf.data.world import build_world
    from smf.data.world_tokenizer import world_tokenizer
    texts = [row["text"] + "\n\n" for row in build_world(world).datasets["pretrain"]]
    fingerprint = module.pretrain_fingerprint(world, options, texts, world_tokenizer())
    torch.save({**state, "fingerprint": fingerprint, "model": {"lm_head.weight": torch.zeros(3, 3)},
                "optimizer": {}}, tmp_path / "c" / CHECKPOINT)
    with pytest.raises(ConfigError, match="does not hold this model's pretraining state"):
        pretrain_world(world, options, tmp_path / "c")


def test_a_shipped_base_of_the_same_fingerprint_is_copied(base, tmp_path, monkeypatch):
    directory, marker = base
    shipped = tmp_path / "assets"
    shutil.copytree(directory / FINAL, shipped / "base-test")
    (shipped / "base-test" / MARKER).write_text(json.dumps(marker))
    monkeypatch.setattr(module, "SHIPPED", shipped)
    world, options = WorldOptions.from_dict(WORLD), PretrainOptions.from_dict(TINY)
    copied = pretrain_world(world, options, tmp_path / "run")
    assert copied["skipped"] and (tmp_path / "run" / MARKER).is_file()
    assert json.loads((tmp_path / "run" / MARKER).read_text())["source"] == "shipped (base-test)"
    assert module.file_digests(tmp_path / "run" / FINAL) == marker["files"]
    remade = pretrain_world(world, PretrainOptions.from_dict({**TINY, "use_shipped": False}), tmp_path / "own")
    assert not remade["skipped"] and remade["fingerprint"] == marker["fingerprint"]


def test_every_seed_gets_its_own_world_and_base(tmp_path):
    from smf.suite.config import seed_config
    from smf.suite.science import prepare_science_inputs

    raw = {"name": "s", "output_dir": str(tmp_path), "seeds": [0, 1], "conditions": ["base", "additive-kl", "lora"],
           "device": "cpu", "base_per_seed": True, "world": {k: v for k, v in WORLD.items() if k != "seed"},
           "pretrain": {**TINY, "epochs": 1}, "lr_sweep": {"sparse": [1e-2], "lora": [1e-3]}}
    with pytest.raises(ConfigError, match="remove world.seed"):
        parse_suite_config({**raw, "world": WORLD}, tmp_path, check_paths=False)
    config = parse_suite_config(raw, tmp_path, check_paths=False)
    assert config.model == str(tmp_path / "bases" / "seed0" / "pretrain" / "final")
    one = seed_config(config, 1)
    assert one.model == str(tmp_path / "bases" / "seed1" / "pretrain" / "final")
    assert one.data.train == str(tmp_path / "bases" / "seed1" / "world" / "train.jsonl")
    assert one.world["seed"] == 1 and one.pretrain["seed"] == 1
    markers = prepare_science_inputs(config)
    assert markers[0]["fingerprint"] != markers[1]["fingerprint"]
    first, second = ((tmp_path / "bases" / f"seed{s}" / "world" / "train.jsonl").read_text() for s in (0, 1))
    assert first != second
    record = tmp_path / "bases" / "seed1" / "world" / "world.json"
    record.write_text(record.read_text()[:20])  # truncated: the world is written again, not reused
    prepare_science_inputs(config)
    assert json.loads(record.read_text())["options"]["seed"] == 1


def test_pretrain_options_refuse_unknown_keys_and_name_the_section():
    with pytest.raises(ConfigError, match="epochz"):
        PretrainOptions.from_dict({"epochz": 3})
    with pytest.raises(ConfigError, match=r"^pretrain: hidden_size \(30\) must be a multiple"):
        PretrainOptions.from_dict({"hidden_size": 30, "num_heads": 4})
    with pytest.raises(ConfigError, match="target_accuracy"):
        PretrainOptions.from_dict({"target_accuracy": 1.5})


def test_the_remake_command_pretrains_a_suite_configs_base_here(tmp_path, capsys):
    import yaml

    config = tmp_path / "suite.yaml"
    config.write_text(yaml.safe_dump({"base_per_seed": True, "world": {k: v for k, v in WORLD.items() if k != "seed"},
                                      "pretrain": {**TINY, "epochs": 1}}))
    assert module.main(["--config", str(config), "--seed", "5", "--output-dir", str(tmp_path / "base")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["source"] == "pretrained here" and (tmp_path / "base" / FINAL / "model.safetensors").is_file()
    again = pretrain_world(WorldOptions.from_dict(WORLD), PretrainOptions.from_dict({**TINY, "epochs": 1, "seed": 5}),
                           tmp_path / "base")
    assert again["skipped"] and again["fingerprint"] == printed["fingerprint"]  # the seed is the world's and the base's
    with pytest.raises(SystemExit):
        module.main(["--config", "no-such-config", "--output-dir", str(tmp_path / "x")])
