"""The command line refuses what it cannot honour, in one line (exit 2), before a run starts and leaving nothing on
disk: non-finite floats and out-of-range integers of every option (flags and config files), unknown or absent
devices and backends, paths that are not datasets, run directories and adapters that are not what they claim,
crafted weights, a full disk, flags a run would ignore (issue 27 items 3, 7, 9); list flags take commas and spaces
alike and `smf suite --conditions` drops the ablation of conditions it no longer runs (issue 28 item 4)."""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from smf.cli import build_parser, main
from smf.options import flag, takes
from smf.commands.train import COMMANDS, config_from_args
from smf.train.config import RunConfig
from helpers import dry_run_names
from test_cli_smf import run_main

ROOT = Path(__file__).resolve().parents[1]


def one_line_error(code, err, message):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("smf") and "error: " in lines[0], err
    assert message in lines[0], lines[0]


def float_options(cls) -> list[str]:
    hints = typing.get_type_hints(cls)
    return [field.name for field in dataclasses.fields(cls)
            if float in (hints[field.name], *typing.get_args(hints[field.name]))]


def test_every_float_option_is_found():
    assert {"lr", "alpha_init", "weight_decay", "max_grad_norm", "lora_dropout"} <= set(float_options(RunConfig))


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
@pytest.mark.parametrize("name", float_options(RunConfig))
def test_every_float_option_is_finite_on_the_command_line_and_in_config_files(tmp_path, capsys, name, value):
    command = next(c for c in COMMANDS if name in takes(RunConfig, c))
    extra = ["--recipe", "lora"] if command == "train" else []
    code, err = run_main([command, *extra, "--output-dir", str(tmp_path / "run"), f"{flag(name)}={value}"], capsys)
    one_line_error(code, err, f"{flag(name)}: input should be")
    for spelling in (".inf", "-.inf", ".nan"):  # YAML's spellings, which yaml.safe_load reads as floats
        (tmp_path / "options.yaml").write_text(f"{name}: {spelling}\n")
        code, err = run_main([command, *extra, "--config", str(tmp_path / "options.yaml"), "--output-dir",
                              str(tmp_path / "run")], capsys)
        one_line_error(code, err, f"option '{name}': input should be a finite number")
    (tmp_path / "options.json").write_text(f'{{"{name}": Infinity}}')  # Python's json reads Infinity
    code, err = run_main([command, *extra, "--config", str(tmp_path / "options.json"), "--output-dir",
                          str(tmp_path / "run")], capsys)
    one_line_error(code, err, f"option '{name}': input should be a finite number")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, message", [
    (["train", "--recipe", "lora", "--seed", "-1"], "--seed: input should be greater than or equal to 0, got -1"),
    (["train", "--recipe", "lora", "--seed", str(2 ** 32)], "--seed: input should be less than 4294967296"),
    (["retrofit", "--data-seed", "-5"], "--data-seed: input should be greater than or equal to 0, got -5"),
    (["train", "--recipe", "lora", "--lora-dropout", "1"], "--lora-dropout: input should be less than 1"),
    (["retrofit", "--warmup-steps", "-1"], "--warmup-steps: input should be greater than or equal to 0"),
    (["retrofit", "--epochs", "0"], "--epochs: input should be greater than 0"),
])
def test_integer_and_bounded_options_out_of_range(tmp_path, capsys, argv, message):
    code, err = run_main([*argv, "--preset", "tiny", "--output-dir", str(tmp_path / "run")], capsys)
    one_line_error(code, err, message)
    assert not (tmp_path / "run").exists()


def test_suite_seeds_in_range(capsys):
    code, err = run_main(["suite", "--config", "tiny", "--dry-run", "--seeds", "0", "-3"], capsys)
    one_line_error(code, err, "seeds: input should be greater than or equal to 0, got -3")
    code, err = run_main(["suite", "--config", "tiny", "--dry-run", "--seeds", str(2 ** 32)], capsys)
    one_line_error(code, err, "seeds: input should be less than 4294967296")


@pytest.fixture
def no_triton_on_cpu(monkeypatch):
    """The Triton backend as it is on a machine without a GPU (the tests run its interpreter)."""
    from smf_kernels.backends import triton_impl

    monkeypatch.setattr(triton_impl, "interpreter_enabled", lambda: False)


@pytest.mark.usefixtures("no_triton_on_cpu")
@pytest.mark.parametrize("argv, message", [
    (["train", "--recipe", "lora", "--device", "foo"], "--device 'foo' is not a torch device"),
    (["train", "--recipe", "lora", "--device", "cuda:7"], "--device 'cuda:7': this machine has"),
    (["retrofit", "--device", "meta"], "--device 'meta': the meta device holds no data"),
    (["retrofit", "--backend", "bogus"], "argument --backend: invalid choice: 'bogus'"),
    (["retrofit", "--backend", "triton", "--device", "cpu"], "--backend triton cannot run on cpu (--device cpu)"),
    (["retrofit", "--oasst-path", "{d}/not-a-dataset"], "--oasst-path: '{d}/not-a-dataset' is a directory but not a "
                                                        "dataset saved by save_to_disk"),
    (["train", "--recipe", "lora", "--medmcqa-path", "/dev/null"], "--medmcqa-path: '/dev/null' is not a dataset "
                                                                   "file"),
    (["train", "--recipe", "lora", "--lr", "inf"], "--lr: input should be a finite number, got inf"),
])
def test_bad_values_fail_in_one_line_before_the_run_starts(tmp_path, capsys, argv, message):
    (tmp_path / "not-a-dataset").mkdir()
    argv = [arg.replace("{d}", str(tmp_path)) for arg in argv]
    code, err = run_main([*argv, "--preset", "tiny", "--output-dir", str(tmp_path / "run")], capsys)
    one_line_error(code, err, message.replace("{d}", str(tmp_path)))
    assert not (tmp_path / "run").exists()


def _run_dir(path: Path, run_config: str) -> Path:
    (path / "final").mkdir(parents=True)
    (path / "run_config.json").write_text(run_config)
    return path


def _adapter_with_backend_in_its_kwargs(path: Path) -> Path:
    from smf.model import attach_memories, save_memory_adapter
    from smf.tiny import tiny_model

    model = tiny_model()
    attach_memories(model, [1], "additive", n_keys=4, heads=2, topk=2, key_dim=8)
    model.config._name_or_path = "tiny"
    save_memory_adapter(model, path)
    config = json.loads((path / "memory_adapter.json").read_text())
    config["memory_kwargs"]["backend"] = "torch"
    (path / "memory_adapter.json").write_text(json.dumps(config))
    return path


class _RunsCodeWhenUnpickled:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _crafted_finetuned_model(path: Path, marker: Path) -> Path:
    from smf.tiny import tiny_model

    tiny_model().config.save_pretrained(path)
    torch.save({"lm_head.weight": _RunsCodeWhenUnpickled(marker)}, path / "pytorch_model.bin")
    return path


def _crafted_lora_adapter(path: Path, marker: Path) -> Path:
    from smf.model import apply_lora
    from smf.tiny import tiny_model

    apply_lora(tiny_model(), r=2, alpha=4, dropout=0.0).save_pretrained(path)
    for weights in path.glob("adapter_model.*"):
        weights.unlink()
    torch.save({"x": _RunsCodeWhenUnpickled(marker)}, path / "adapter_model.bin")
    return path


@pytest.mark.parametrize("make, argv, message", [
    (lambda d, m: _run_dir(d / "a", '{"model": "tiny"}'), [], "run_config.json is not a run's options: expected a "
                                                             "JSON object with 'recipe'"),
    (lambda d, m: _run_dir(d / "a", "[1, 2]"), [], "run_config.json is not a run's options"),
    (lambda d, m: _run_dir(d / "a", "{not json"), [], "run_config.json is not a run's options (not readable JSON"),
    (lambda d, m: _adapter_with_backend_in_its_kwargs(d / "a"), [], "memory_kwargs may hold only n_keys, heads, "
                                                                    "topk, key_dim, value_dim, not backend"),
    (lambda d, m: _crafted_finetuned_model(d / "a", m), [], "cannot be loaded (a pickle holding objects other than "
                                                            "tensors and plain values, refused unread"),
    (lambda d, m: _crafted_lora_adapter(d / "a", m), ["--model", "tiny"], "cannot be loaded (a pickle holding objects "
                                                                         "other than tensors"),
    (lambda d, m: d / "a", [], "--adapter: no such directory"),
])
def test_eval_of_an_adapter_that_is_not_what_it_claims_is_one_line(tmp_path, capsys, make, argv, message):
    marker = tmp_path / "code-ran"
    adapter = make(tmp_path, marker)
    code, err = run_main(["eval", "--config", "tiny", "--tasks", "medmcqa", "--adapter", str(adapter),
                          "--output-dir", str(tmp_path / "eval"), *argv], capsys)
    one_line_error(code, err, message)
    assert not marker.exists() and not (tmp_path / "eval").exists()


@pytest.mark.parametrize("argv, message", [
    (["retrofit", "--oasst-languages", "xx"], "--oasst-languages is not used by this run: the authors protocol takes "
                                              "the English replies"),
    (["background", "--n-examples", "10", "--adapter", "{d}"], "--n-examples is not used by this run: the authors "
                                                               "protocol draws the background examples from its "
                                                               "own pool"),
    (["retrofit", "--mode", "replacement", "--alpha-init", "0.5"], "--alpha-init is not used by this run: --mode "
                                                                   "replacement has no alpha"),
    (["train", "--recipe", "lora", "--rows-per-step", "8"], "--rows-per-step is not used by this run: only --recipe "
                                                            "sparse uses it (this run is --recipe lora)"),
    (["train", "--recipe", "full", "--backend", "torch"], "--backend is not used by this run"),
    (["train", "--recipe", "lora", "--background", "{d}"], "--background is not used by this run"),
    (["train", "--recipe", "sparse", "--lora-r", "4", "--adapter", "{d}", "--background", "{d}"],
     "--lora-r is not used by this run: only --recipe lora uses it"),
    (["train", "--recipe", "lora", "--update", "authors"], "--update is not used by this run: only --recipe sparse "
                                                           "uses it"),
    (["train", "--recipe", "full", "--update", "exact"], "--update is not used by this run: only --recipe sparse "
                                                         "uses it"),  # a flag at its default is ignored all the same
    (["train", "--recipe", "lora", "--count-reads", "all"], "--count-reads is not used by this run"),
    (["retrofit", "--oasst-languages", "en"], "--oasst-languages is not used by this run: the authors protocol"),
])
def test_a_flag_the_run_would_ignore_is_refused_with_the_reason(tmp_path, capsys, argv, message):
    argv = [arg.replace("{d}", str(tmp_path)) for arg in argv]
    code, err = run_main([*argv, "--preset", "tiny", "--output-dir", str(tmp_path / "run")], capsys)
    one_line_error(code, err, message)
    assert not (tmp_path / "run").exists()


def parse(argv):
    args = build_parser().parse_args(argv)
    return config_from_args(args, args.command)


def test_what_a_run_uses_is_accepted_and_a_config_file_key_it_ignores_is_logged(tmp_path, caplog):
    out = ["--output-dir", str(tmp_path / "run")]
    assert parse(["retrofit", "--preset", "tiny", "--protocol", "clean", "--oasst-languages", "de,en", *out]
                 ).oasst_languages == "de,en"
    assert parse(["train", "--preset", "tiny", "--recipe", "lora", "--lora-r", "4", *out]).lora_r == 4
    (tmp_path / "shared.yaml").write_text("rows_per_step: 8\nlora_r: 4\n")  # one file for several recipes
    assert parse(["train", "--config", str(tmp_path / "shared.yaml"), "--preset", "tiny", "--recipe", "lora", *out]
                 ).lora_r == 4
    assert "rows_per_step 8 is not used by this run: only --recipe sparse uses it" in caplog.text


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "medmcqa", "--wikitext-path", "{fixture}"], "--wikitext-path is not used: --tasks leaves out wikitext"),
    (["--tasks", "wikitext", "--triviaqa-examples", "3"], "--triviaqa-examples is not used: --tasks leaves out "
                                                          "triviaqa"),
    (["--backend", "torch"], "--backend is not used: the model evaluated has no memories (a base model)"),
])
def test_eval_flags_it_would_ignore_are_refused(tmp_path, capsys, argv, message):
    fixture = str(ROOT / "smf" / "assets" / "tiny" / "wikitext103_v1_test.jsonl")
    argv = [arg.replace("{fixture}", fixture) for arg in argv]
    code, err = run_main(["eval", "--config", "tiny", "--model", "tiny", "--output-dir", str(tmp_path / "eval"),
                          *argv], capsys)
    one_line_error(code, err, message)


def test_a_full_disk_is_one_line_naming_the_file_and_leaves_no_partial_file(tmp_path):
    """torch.save under a file-size limit (the stand-in for a full disk that needs no root): the OSError behind
    torch's inline_container.cc RuntimeError becomes one ConfigError, and the temporary file is gone."""
    script = f"""
import resource, signal, sys
from pathlib import Path
import torch
from smf.errors import ConfigError
from smf.train.checkpoint import atomic_save
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
try:
    atomic_save({{"x": torch.zeros(1_000_000)}}, Path({str(tmp_path / "checkpoint.pt")!r}))
except ConfigError as err:
    print(err)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.stdout.strip() == f"cannot write {tmp_path / 'checkpoint.pt'}: File too large", result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_write_refused_anywhere_in_a_run_is_one_line(tmp_path, capsys, monkeypatch):
    import smf.train.loop

    def disk_full(config):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos") from OSError(
            errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(smf.train.loop, "train", disk_full)
    code, err = run_main(["retrofit", "--preset", "tiny", "--output-dir", str(tmp_path / "run")], capsys)
    one_line_error(code, err, "a write failed: No space left on device; free space or choose another --output-dir")


# ---------------------------------------------------------------------------------------- issue 28 item 4
def test_suite_conditions_without_the_ablations_condition_drop_its_ablation(capsys):
    for argv in (["--seeds", "0", "--conditions", "base,lora"], ["--seeds", "0", "--conditions", "base", "lora"]):
        assert main(["--log-level", "ERROR", "suite", "--config", "tiny", "--dry-run", *argv]) == 0
        assert dry_run_names(capsys.readouterr().out) == ["base-seed0", "lora-seed0"]
    assert main(["suite", "--config", "tiny", "--dry-run", "--seeds", "0,1", "--conditions", "additive-kl"]) == 0
    assert dry_run_names(capsys.readouterr().out) == ["additive-kl-seed0", "additive-kl-authors-update-seed0",
                                                      "additive-kl-seed1", "additive-kl-authors-update-seed1"]
    assert main(["suite", "--config", "tiny", "--dry-run", "--seeds", "0", "--conditions", "additive-kl",
                 "--authors-update", "none"]) == 0
    assert dry_run_names(capsys.readouterr().out) == ["additive-kl-seed0"]
    code, err = run_main(["suite", "--config", "tiny", "--dry-run", "--conditions", "base", "--authors-update",
                          "additive-kl"], capsys)
    one_line_error(code, err, "authors_update: 'additive-kl' is not a sparse condition of this suite")
    code, err = run_main(["suite", "--config", "tiny", "--dry-run", "--conditions", "base,dense"], capsys)
    one_line_error(code, err, "argument --conditions: invalid choice: 'dense'")


def test_list_flags_take_commas_and_spaces_alike():
    parser = build_parser()
    for argv in (["--seeds", "0", "1"], ["--seeds", "0,1"], ["--seeds", "0,", "1"]):
        assert parser.parse_args(["suite", "--config", "tiny", *argv]).seeds == [0, 1]
    assert parser.parse_args(["eval", "--tasks", "medmcqa", "wikitext"]).tasks == ["medmcqa", "wikitext"]
    assert parser.parse_args(["eval", "--tasks", "medmcqa,wikitext"]).tasks == ["medmcqa", "wikitext"]
    assert parser.parse_args(["retrofit", "--layers", "2,4", "6"]).layers == [2, 4, 6]


def test_the_parser_and_the_kernels_read_one_declaration_of_their_words():
    """The rules and backends were restated in smf.vocabulary (smf_kernels' modules loaded torch); now both sides
    read smf_kernels.names."""
    from smf import vocabulary
    from smf_kernels import names
    from smf_kernels.backends import BACKENDS
    from smf_kernels.sparse.selection import RULES

    assert vocabulary.RULES is names.RULES is RULES
    assert vocabulary.BACKENDS is names.BACKENDS is BACKENDS


# ---------------------------------------------------------------------------------------- issue 28 item 5
def _help_entries(command: str) -> dict[str, str]:
    """flag -> its help text (argparse's wrapping undone), for ``smf command --help``."""
    parser = build_parser()
    subparsers = next(action for action in parser._actions if action.dest == "command")
    entries = {}
    for action in subparsers.choices[command]._actions:
        if action.option_strings and action.help:
            entries[action.option_strings[-1]] = action.help
    return entries


@pytest.mark.parametrize("command", ["retrofit", "background", "train", "suite", "eval", "report"])
def test_help_shows_at_most_one_default_per_option(command):
    for name, text in _help_entries(command).items():
        assert text.count("default:") + text.count("by default") <= 1, (name, text)


def test_help_shows_the_default_that_applies_and_the_tiny_presets():
    train, retrofit = _help_entries("train"), _help_entries("retrofit")
    assert ("(default: 3.1%% of each memory's slots, at least 1, at most 512: the paper's 512 of 16,384; --preset "
            "tiny: 32)"
            in train["--rows-per-step"])
    assert "(default: 0.0005 sparse, 0.0002 lora, 5e-05 full)" in train["--lr"]
    assert "(default: 3)" in train["--epochs"] and "(default: 2)" in retrofit["--epochs"]
    assert "(default: 60000; --preset tiny: 20)" in train["--n-examples"]
    assert "(default: the hub; --preset tiny: smf/assets/tiny/medmcqa_train.jsonl)" in train["--medmcqa-path"]
    assert "(default: additive)" in retrofit["--mode"] and "(default: the adapter's)" in train["--mode"]
    assert "(default: scaled to the model (docs/own-data.md#memory-sizes); 6,12,18 at Qwen-2.5-0.5B; --preset tiny: " \
        "2,4,6)" in retrofit["--layers"]


def test_the_parser_and_every_help_import_neither_torch_nor_the_model_code():
    """What makes `smf ... --help` fast, checked without timing it: building the parser and formatting every
    subcommand's help loads none of the heavy packages (the commands import them when they run)."""
    script = """
import sys
from smf.cli import build_parser
parser = build_parser()
parser.format_help()
for sub in next(a for a in parser._actions if a.dest == "command").choices.values():
    sub.format_help()
heavy = ("torch", "transformers", "datasets", "peft", "smf_kernels", "smf.model", "matplotlib", "safetensors")
light = ("smf_kernels", "smf_kernels.names")  # the kernels' words, which import nothing
print(sorted(m for m in sys.modules if m.startswith(heavy) and m not in light))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("content, message", [("{not json", "is not a readable suite config record"),
                                              ("[1]", "is not a suite config record: expected a JSON object")])
def test_report_of_a_suite_directory_with_a_damaged_record_is_one_line(tmp_path, capsys, content, message):
    from smf.suite.plan import SuiteLayout

    layout = SuiteLayout(tmp_path)
    layout.config_file.parent.mkdir(parents=True, exist_ok=True)
    layout.config_file.write_text(content)
    code, err = run_main(["report", "--suite-dir", str(tmp_path)], capsys)
    one_line_error(code, err, message)
