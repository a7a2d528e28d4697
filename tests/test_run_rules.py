"""The rules on a run's options (smf.train.rules, issue 60), each in one place and checked before any model loads: the
sparse stage's rules refused by the command line in one line (exit 2) with nothing on disk (those that read the
adapter or the number of processes by the trainer's start, before it writes or loads anything), the compiled step's
one-process rule one function for smf train, the step's planner and the HF Trainer, and what a sparse update
supports read off its registry entry."""
import json

import pytest
import torch

import smf.train.loop as loop
from smf.errors import ConfigError
from smf.train import sections
from smf.train.config import build_config
from smf.train.distributed import World
from smf.train.rules import RULES, check_run
from smf.vocabulary import RECIPE_KINDS, RECIPES, SPARSE_UPDATES, TRAIN_RECIPES, UPDATE_KINDS
from smf_kernels.sparse import plan_fill, updates
from test_cli_smf import run_main
from test_cli_reliability import one_line_error


def _adapter(path, mode: str):
    """A folder holding only a memory adapter's config, saved in ``mode`` (the rules read no more of it)."""
    path.mkdir()
    (path / "memory_adapter.json").write_text(json.dumps({"mode": mode, "layers": [2], "memory_kwargs": {},
                                                          "base_model": None}))
    return path


@pytest.mark.parametrize("flags, message", [
    (["--count-reads", "loss", "--update", "authors"],
     "--count-reads loss: the authors' update counts every position, padding included; use the exact sparse update"),
    (["--count-reads", "loss", "--compile"], "--count-reads loss is not available with --compile"),
    (["--mode", "additive+s"], "--mode additive+s cannot finetune an adapter retrofitted in mode 'replacement'"),
    (["--shard-memories", "--update", "authors"], "not of --recipe sparse --update authors (one process)"),
])
def test_a_sparse_rule_fails_in_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.setattr(loop, "build_setup", lambda *args: pytest.fail("the model loaded"))
    adapter = _adapter(tmp_path / "adapter", "replacement")
    (tmp_path / "background.safetensors").write_bytes(b"")
    code, err = run_main(["train", "--preset", "tiny", "--recipe", "sparse", "--adapter", str(adapter),
                          "--background", str(tmp_path / "background.safetensors"),
                          "--output-dir", str(tmp_path / "run"), *flags], capsys)
    one_line_error(code, err, message)
    assert not (tmp_path / "run").exists()


def _sparse_config(tmp_path, **options):
    adapter = _adapter(tmp_path / "adapter", "additive")
    (adapter / "background.safetensors").write_bytes(b"")  # the rules read no more of it than that it is there
    return build_config("train", {}, {"preset": "tiny", "recipe": "sparse", "adapter": str(adapter),
                                      "background": str(adapter), "output_dir": str(tmp_path / "run"),
                                      **options}).resolved("sparse")


@pytest.mark.parametrize("options, message", [
    ({"compile": True}, "--compile with --recipe sparse runs in one process"),
    ({"update": "authors"}, "--update authors runs in one process (the authors' single-GPU update); drop torchrun"),
])
def test_a_rule_of_the_world_refuses_before_the_trainer_loads_the_model(tmp_path, monkeypatch, options, message):
    config = _sparse_config(tmp_path, **options)  # one process: allowed
    monkeypatch.setattr(loop, "setup_distributed", lambda device: World(0, 2, torch.device("cpu")))
    monkeypatch.setattr(loop, "build_setup", lambda *args: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        loop.train(config)
    assert not (tmp_path / "run").exists()
    check_run(config, "train", 1)


def test_a_background_folder_without_statistics_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """It was refused only when the step was built, after the model had loaded (the check lived in recipes.py)."""
    monkeypatch.setattr(loop, "build_setup", lambda *args: pytest.fail("the model loaded"))
    adapter = _adapter(tmp_path / "adapter", "additive")
    code, err = run_main(["train", "--preset", "tiny", "--recipe", "sparse", "--adapter", str(adapter),
                          "--background", str(adapter), "--output-dir", str(tmp_path / "run")], capsys)
    one_line_error(code, err, f"--background {str(adapter)!r}: no background statistics file "
                              "(background.safetensors) there")
    assert not (tmp_path / "run").exists()


def test_a_global_batch_is_split_into_whole_micro_batches_on_every_process_before_the_model_loads(tmp_path,
                                                                                                   monkeypatch):
    config = build_config("train", {}, {"preset": "tiny", "recipe": "lora", "output_dir": str(tmp_path / "run"),
                                        "global_batch_size": 6, "micro_batch_size": 3}).resolved("lora")
    monkeypatch.setattr(loop, "setup_distributed", lambda device: World(0, 4, torch.device("cpu")))
    monkeypatch.setattr(loop, "build_setup", lambda *args: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match="--global-batch-size 6 is not a multiple of --micro-batch-size 3 x 4 "
                                          "processes"):
        loop.train(config)
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="--global-batch-size 6 is not a multiple of --micro-batch-size 4$"):
        build_config("train", {}, {"preset": "tiny", "recipe": "lora", "output_dir": str(tmp_path / "run"),
                                   "global_batch_size": 6, "micro_batch_size": 4})


def test_the_compiled_step_states_its_one_process_rule_once(tmp_path):
    with pytest.raises(ConfigError) as refused:
        check_run(_sparse_config(tmp_path, compile=True), "train", 2)
    with pytest.raises(ValueError) as planned:
        plan_fill(1, compiled=True, world=2)
    assert str(refused.value).startswith("--compile with --recipe sparse runs in one process: ")
    assert str(planned.value).startswith("a compiled sparse step runs in one process: ")
    assert str(refused.value).split(" runs in one process")[1] == str(planned.value).split(" runs in one process")[1]


def test_every_rule_lives_in_the_rules_module_and_guards_a_section():
    assert all(rule.section in sections.SECTIONS for rule in RULES)
    assert not any(hasattr(section, "check") for section in sections.SECTIONS.values())
    assert "raise " not in open(sections.__file__).read()  # the sections declare options; the rules refuse


@pytest.mark.parametrize("recipe", ["lora", "full"])
def test_the_memories_a_recipe_cannot_split_are_refused_by_its_registry_entry(tmp_path, capsys, recipe):
    code, err = run_main(["train", "--preset", "tiny", "--recipe", recipe, "--shard-memories",
                          "--output-dir", str(tmp_path / "run")], capsys)
    one_line_error(code, err, f"--shard-memories splits the memories of retrofit and --recipe sparse runs, not of "
                              f"--recipe {recipe}")
    assert not RECIPE_KINDS[recipe].shards_memories and RECIPE_KINDS["sparse"].shards_memories


def test_each_recipe_is_declared_once_with_what_it_does_with_memories():
    assert RECIPES == tuple(RECIPE_KINDS) == ("retrofit", "sparse", "lora", "full")
    assert TRAIN_RECIPES == ("sparse", "lora", "full")  # what smf train --recipe takes: its command
    assert [name for name, kind in RECIPE_KINDS.items() if not kind.trains_memories] == ["lora"]


def test_each_sparse_update_is_declared_once_with_what_it_supports():
    assert SPARSE_UPDATES == tuple(UPDATE_KINDS) == ("exact", "dense_masked", "authors")
    assert [kind.name for kind in UPDATE_KINDS.values() if kind.row_optimizer] == ["exact"]
    assert [kind.name for kind in UPDATE_KINDS.values() if kind.one_process] == ["authors"]


def test_each_update_names_the_kernels_kind_the_step_composes_and_what_that_kind_steps():
    """recipes.py switched on the names (UPDATES: name -> step class, optimizer); the entry now names the kind."""
    for kind in UPDATE_KINDS.values():
        kernel = getattr(updates, kind.kernel)
        assert issubclass(kernel, updates.UpdateKind) and kernel is not updates.UpdateKind
        assert kernel.rows == kind.row_optimizer, kind.name  # rows through step_rows: a row optimizer
    assert len({kind.kernel for kind in UPDATE_KINDS.values()}) == len(UPDATE_KINDS)
