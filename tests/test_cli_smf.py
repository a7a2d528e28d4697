"""The smf command line: help for every subcommand, config file < flags precedence, shipped configs,
and one-line errors with exit code 2 for bad input."""
import subprocess
import sys
from pathlib import Path

import pytest

from smf.cli import build_parser, main
from smf.commands.train import COMMANDS, config_from_args
from smf.options import takes
from smf.train.config import RunConfig, build_config, read_config_file

CONFIGS = Path(__file__).resolve().parents[1] / "smf" / "configs"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_lists_every_option_with_its_default(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    options = takes(RunConfig, command)
    assert options and "--config FILE" in text
    for name in options:
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
        after = text.split(flag + " ", 1)[-1] if name == "resume" else text.split(flag, 2)[-1]
        assert "(default:" in after, flag


def parse(argv):
    args = build_parser().parse_args(argv)
    return config_from_args(args, args.command)


def test_flags_override_the_config_file_which_overrides_the_preset(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("preset: tiny\nlr: 3e-3\nepochs: 5\nmode: replacement\noutput-dir: from-file\n"
                           "rule: kl\n")  # rule is a train option: skipped for retrofit
    config = parse(["retrofit", "--config", str(config_file), "--epochs", "7", "--n-keys", "8", "--topk", "2"])
    assert (config.lr, config.mode, config.output_dir) == (3e-3, "replacement", "from-file")  # file
    assert (config.epochs, config.n_keys, config.topk) == (7, 8, 2)  # flags
    assert (config.heads, config.model, config.warmup_steps) == (2, "tiny", 2)  # preset
    assert config.max_grad_norm == 1.0 and config.rule == RunConfig().rule  # default
    assert parse(["retrofit", "--config", str(config_file), "--output-dir", "flag"]).output_dir == "flag"


def test_shipped_paper_config_spells_out_the_defaults_and_tiny_config_loads(tmp_path):
    for command in COMMANDS:
        options = read_config_file(CONFIGS / "paper.yaml", command)
        sizes = {"layers": [6, 12, 18], "n_keys": 128, "heads": 4, "topk": 16, "key_dim": 256}  # the scaled defaults
        assert build_config(command, options, {"output_dir": "x", "adapter": str(tmp_path),
                                               "background": str(tmp_path)}) == \
            RunConfig(output_dir="x", adapter=str(tmp_path), background=str(tmp_path),
                      **(sizes if command == "retrofit" else {}),
                      **({"rows_per_step": 512} if command == "train" else {}))  # the default's value at 16,384 slots
        assert RunConfig(output_dir="x").resolved("retrofit") == RunConfig(output_dir="x", **sizes).resolved("retrofit")
    tiny = build_config("train", read_config_file(CONFIGS / "tiny.yaml", "train"),
                        {"output_dir": "x", "recipe": "lora"}).resolved("lora")
    assert (tiny.model, tiny.lr, tiny.epochs, Path(tiny.medmcqa_path).is_file()) == ("tiny", 2e-4, 2, True)


def run_main(argv, capsys):
    try:
        code = main(["--log-level", "ERROR", *argv])
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["train", "--recipe", "lora", "--preset", "tiny", "--medmcqa-path", "/no/such.jsonl", "--output-dir", "{d}"],
     "--medmcqa-path: no such path '/no/such.jsonl'"),
    (["retrofit", "--mode", "bogus", "--output-dir", "{d}"], "argument --mode: invalid choice: 'bogus'"),
    (["train", "--recipe", "dpo", "--output-dir", "{d}"], "argument --recipe: invalid choice: 'dpo'"),
    (["retrofit", "--config", "{d}/bad_mode.yaml"],
     "bad_mode.yaml': option 'mode': input should be 'replacement', 'additive' or 'additive+s', got 'bogus'"),
    (["retrofit", "--n-keys", "0", "--output-dir", "{d}"], "--n-keys: input should be greater than 0, got 0"),
    (["retrofit", "--config", "{d}/unknown_key.yaml"], "unknown key 'learning_rate'"),
    (["retrofit", "--config", "{d}/missing.yaml", "--output-dir", "{d}"], "--config: no such file"),
    (["retrofit", "--config", "{d}/list.yaml"], "list.yaml' must be a mapping, got list"),
    (["retrofit", "--preset", "tiny", "--layers", "2", "9", "--output-dir", "{d}/run"],
     "indices [9] are beyond the model, which has 8 decoder layers"),
    (["train", "--recipe", "sparse", "--preset", "tiny", "--output-dir", "{d}"], "--adapter (the retrofit run "),
    (["background", "--preset", "tiny", "--adapter", "{d}", "--output-dir", "{d}"], "holds no memory adapter"),
    (["retrofit", "--preset", "tiny", "--micro-batch-size", "3", "--output-dir", "{d}"], "not a multiple"),
])
def test_bad_input_gives_one_line_and_exit_code_2(tmp_path, capsys, argv, message):
    (tmp_path / "bad_mode.yaml").write_text(f"mode: bogus\noutput-dir: {tmp_path}\n")
    (tmp_path / "unknown_key.yaml").write_text("learning_rate: 0.1\n")
    (tmp_path / "list.yaml").write_text("- 1\n")
    code, err = run_main([arg.replace("{d}", str(tmp_path)) for arg in argv], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("smf") and "error: " in lines[0], err
    assert message in lines[0]


def test_console_script_error_has_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "smf.cli", "train", "--recipe", "sparse", "--preset", "tiny",
                             "--adapter", str(tmp_path / "nowhere"), "--output-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == f"smf train: error: --adapter: no such directory '{tmp_path / 'nowhere'}'"


def test_a_removed_update_option_is_refused_with_what_replaced_it(capsys):
    code, err = run_main(["train", "--recipe", "sparse", "--optimizer=row_sparse", "--fused-update"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "unrecognized arguments" in err and "--optimizer is now --update (row_sparse -> exact" in err
    assert "--fused-update is gone" in err and "--sparse-backward" not in err


def _subcommands() -> dict:
    parser = build_parser()
    return next(action for action in parser._actions if action.dest == "command").choices


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_a_misspelt_option_is_named_with_the_closest_option_of_its_subcommand(command, capsys):
    parser = _subcommands()[command]
    option = max((name for name in parser._option_string_actions if name.startswith("--")), key=len)
    typo = option[:-2] + option[-1] + option[-2]  # the last two letters swapped
    required = [word for action in parser._actions if action.required for word in (action.option_strings[0], "x")]
    code, err = run_main([command, *required, typo, "8"], capsys)
    assert (code, err) == (2, f"smf {command}: error: unrecognized argument {typo} (did you mean {option}?)\n")


def test_unknown_words_without_a_close_option_are_named_as_given(capsys):
    assert run_main(["train", "--zzz", "1", "--rows-per-stpe=8"], capsys) == (
        2, "smf train: error: unrecognized arguments --zzz, --rows-per-stpe=8 (did you mean --rows-per-step?)\n")
    assert run_main(["eval", "extra"], capsys) == (2, "smf eval: error: unrecognized argument extra\n")


def test_threads_one_for_a_small_model_unless_given_and_the_flags_take_them(monkeypatch, tmp_path):
    import json

    import torch

    from smf.commands.suite import overrides_from_args
    from smf.threads import use_threads

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    (tmp_path / "narrow").mkdir()
    (tmp_path / "narrow" / "config.json").write_text(json.dumps({"hidden_size": 128}))
    (tmp_path / "wide").mkdir()
    (tmp_path / "wide" / "config.json").write_text(json.dumps({"hidden_size": 896}))
    use_threads(None, "tiny")
    use_threads(3, "tiny")
    use_threads(None, str(tmp_path / "narrow"))  # a local model of hidden size 128: small too
    use_threads(None, str(tmp_path / "wide"))  # larger models, and hub ids (never read), keep torch's default
    use_threads(None, "Qwen/Qwen2.5-0.5B")
    use_threads(2, "Qwen/Qwen2.5-0.5B")
    assert calls == [1, 3, 1, 2]
    parser = build_parser()
    assert config_from_args(parser.parse_args(["train", "--preset", "tiny", "--recipe", "lora", "--output-dir",
                                               "x", "--threads", "2"]), "train").threads == 2
    assert overrides_from_args(parser.parse_args(["suite", "--config", "tiny", "--threads", "2"]))["threads"] == 2
    assert parser.parse_args(["eval", "--model", "tiny", "--threads", "4"]).threads == 4
