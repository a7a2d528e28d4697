"""One spelling per word (smf.vocabulary): old spellings still read, with a deprecation warning, from the
command line, config files and adapters saved before the rename (user files; the Python API takes the one
spelling); suite fingerprints unchanged."""
import hashlib
import json

import pytest

from smf.cli import build_parser
from smf.errors import ConfigError
from smf.model import attach_memories, load_memory_adapter, memory_blocks, save_memory_adapter
from smf.suite.fingerprints import options_fingerprint
from smf.tiny import TINY_MEMORY_KWARGS, tiny_model
from smf.commands.train import config_from_args
from smf.vocabulary import CONDITIONS, check_layers, split_condition


def parse(argv):
    args = build_parser().parse_args(argv)
    return config_from_args(args, args.command)


def test_old_spellings_on_the_command_line_and_in_files_map_to_the_one_spelling(tmp_path):
    with pytest.deprecated_call(match="'additive_s' is deprecated; use 'additive\\+s'"):
        config = parse(["retrofit", "--mode", "additive_s", "--output-dir", "x"])
    assert config.mode == "additive+s"
    config_file = tmp_path / "old.yaml"
    config_file.write_text("mode: additive_s\noptimizer: dense-masked\n")
    with pytest.deprecated_call():
        config = parse(["train", "--config", str(config_file), "--recipe", "lora", "--output-dir", "x"])
    assert (config.mode, config.update) == ("additive+s", "dense_masked")


@pytest.mark.parametrize("old, update", [({"optimizer": "row_sparse", "sparse_backward": "read-rows"}, "exact"),
                                         ({"optimizer": "authors", "fused_update": True}, "authors"),
                                         ({"fused_update": False}, "exact")])
def test_a_config_file_with_the_options_update_replaced_loads_with_one_warning(tmp_path, caplog, old, update):
    config_file = tmp_path / "old.json"
    config_file.write_text(json.dumps({"recipe": "lora", **old}))
    with pytest.warns(DeprecationWarning, match="replaced by 'update'") as caught:
        config = parse(["train", "--config", str(config_file), "--output-dir", "x"])
    assert config.update == update
    assert len([w for w in caught if "replaced by 'update'" in str(w.message)]) == 1


def test_suite_fingerprints_hash_the_spelling_they_were_written_with(tmp_path):
    old = hashlib.sha256(json.dumps({"lr": 0.1, "optimizer": "row-sparse", "sparse_backward": "deferred",
                                     "fused_update": False}, sort_keys=True).encode()).hexdigest()
    assert options_fingerprint({"optimizer": "row_sparse", "sparse_backward": "deferred", "fused_update": False,
                                "lr": 0.1}) == old[:16]
    assert options_fingerprint({"update": "exact", "lr": 0.1}) == old[:16]  # what a run writes now
    for update, optimizer in (("authors", "authors"), ("dense_masked", "dense_masked")):
        for compile_ in (False, True):
            written_before = {"optimizer": optimizer, "sparse_backward": "selected-rows" if compile_ else "deferred",
                              "fused_update": False, "compile": compile_}
            assert options_fingerprint({"update": update, "compile": compile_}) == options_fingerprint(written_before)


def test_old_mode_spelling_in_saved_adapters(tmp_path):
    model = tiny_model()
    attach_memories(model, (2,), "additive+s", **TINY_MEMORY_KWARGS)
    save_memory_adapter(model, tmp_path)
    adapter = tmp_path / "memory_adapter.json"
    saved = json.loads(adapter.read_text())
    assert saved["mode"] == "additive+s"
    adapter.write_text(json.dumps({**saved, "mode": "additive_s"}))  # as written before the rename
    reloaded = tiny_model()
    with pytest.deprecated_call():
        load_memory_adapter(reloaded, tmp_path)
    assert memory_blocks(reloaded)[0].mode == "additive+s"


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
                                "batch_size": 1, "fsdp": False}) == old
    assert options_fingerprint({"lr": 0.1, "count_reads": "loss"}) != old
