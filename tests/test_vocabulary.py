"""One spelling per word (smf.vocabulary): old spellings still read, with a deprecation warning, from the
command line, config files, the Python API and adapters saved before the rename; suite fingerprints unchanged."""
import hashlib
import json

import pytest

from smf.cli import build_parser
from smf.errors import ConfigError
from smf.model import attach_memories, load_memory_adapter, memory_blocks, save_memory_adapter
from smf.suite.plan import options_fingerprint
from smf.tiny import TINY_MEMORY_KWARGS, tiny_model
from smf.train.commands import config_from_args
from smf.vocabulary import CONDITIONS, check_layers, split_condition


def parse(argv):
    args = build_parser().parse_args(argv)
    return config_from_args(args, args.command)


def test_old_spellings_on_the_command_line_and_in_files_map_to_the_one_spelling(tmp_path):
    with pytest.deprecated_call(match="'row-sparse' is deprecated; use 'row_sparse'"):
        config = parse(["train", "--optimizer", "row-sparse", "--recipe", "lora", "--output-dir", "x"])
    assert config.optimizer == "row_sparse"
    config_file = tmp_path / "old.yaml"
    config_file.write_text("mode: additive_s\noptimizer: dense-masked\n")
    with pytest.deprecated_call():
        config = parse(["train", "--config", str(config_file), "--recipe", "lora", "--output-dir", "x"])
    assert (config.mode, config.optimizer) == ("additive+s", "dense_masked")


def test_old_mode_spelling_in_the_api_and_in_saved_adapters(tmp_path):
    model = tiny_model()
    with pytest.deprecated_call(match="'additive_s' is deprecated"):
        attach_memories(model, (2,), "additive_s", **TINY_MEMORY_KWARGS)
    assert memory_blocks(model)[0].mode == "additive+s"
    save_memory_adapter(model, tmp_path)
    adapter = tmp_path / "memory_adapter.json"
    saved = json.loads(adapter.read_text())
    assert saved["mode"] == "additive+s"
    adapter.write_text(json.dumps({**saved, "mode": "additive_s"}))  # as written before the rename
    reloaded = tiny_model()
    with pytest.deprecated_call():
        load_memory_adapter(reloaded, tmp_path)
    assert memory_blocks(reloaded)[0].mode == "additive+s"


def test_suite_fingerprints_hash_the_spelling_they_were_written_with():
    old = hashlib.sha256(json.dumps({"lr": 0.1, "optimizer": "row-sparse"}, sort_keys=True).encode()).hexdigest()
    assert options_fingerprint({"optimizer": "row_sparse", "lr": 0.1}) == old[:16]


def test_conditions_and_layer_checks():
    assert CONDITIONS[0] == "base" and CONDITIONS[-2:] == ("lora", "full") and len(CONDITIONS) == 9
    assert split_condition("additive+s-tfidf") == ("additive+s", "tfidf")
    with pytest.raises(ConfigError, match="condition must be one of"):
        split_condition("lora")
    assert check_layers([6, 12], 24) == (6, 12)
    for layers, message in (([], "non-empty list"), ([1, 1], "distinct non-negative"), ([-2], "non-negative"),
                            ([3, 9], r"--layers \[3, 9\]: indices \[9\] are beyond the model, which has 8")):
        with pytest.raises(ConfigError, match=message):
            check_layers(layers, 8, argument="--layers")


def test_options_added_later_keep_old_fingerprints_at_their_old_behaviour():
    old = hashlib.sha256(json.dumps({"lr": 0.1}, sort_keys=True).encode()).hexdigest()[:16]
    assert options_fingerprint({"lr": 0.1, "count_reads": "all", "loss_on": "all", "train_data": None,
                                "batch_size": 1}) == old
    assert options_fingerprint({"lr": 0.1, "count_reads": "loss"}) != old
