"""Suite config: shipped configs, path resolution, and one clear error per kind of bad input (CLI exit 2)."""
import json
from pathlib import Path

import pytest
import yaml

import smf
from smf import cli
from smf.report import CONDITIONS
from smf.suite.config import TRAIN_KEYS, load_suite_config
from smf.errors import ConfigError
from smf.vocabulary import DEFAULT_MODEL, METRIC_OF_TASK

from helpers import dry_run_names

FIXTURES = Path(__file__).parent / "fixtures"
TINY_DATA = Path(smf.__file__).resolve().parent / "assets" / "tiny"  # package data


def _write(tmp_path: Path, **overrides) -> Path:
    """A small valid suite config (data given relative to the file) with ``overrides`` applied."""
    data_dir = tmp_path / "data"
    data_dir.mkdir(exist_ok=True)
    for name in ("oasst1_train", "medmcqa_train", "medmcqa_validation", "wikitext103_test", "triviaqa_validation"):
        (data_dir / f"{name}.jsonl").write_text((FIXTURES / f"{name}.jsonl").read_text())
    raw = {"name": "t", "model": "tiny", "output_dir": "out", "seeds": [0], "conditions": ["base", "lora"],
           "device": "cpu",
           "data": {"oasst": "../data/oasst1_train.jsonl", "medmcqa_train": "../data/medmcqa_train.jsonl",
                    "medmcqa_validation": "../data/medmcqa_validation.jsonl",
                    "wikitext": "../data/wikitext103_test.jsonl", "triviaqa": "../data/triviaqa_validation.jsonl"},
           "train": {"preset": "tiny"}, "eval": {"medmcqa_examples": 4}}
    raw.update(overrides)
    path = tmp_path / "configs" / "suite.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return path



def test_shipped_configs_load_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paper = load_suite_config("paper")
    assert paper.model == DEFAULT_MODEL and paper.seeds == (0, 1, 2) and paper.conditions == CONDITIONS
    assert (paper.eval.medmcqa_examples, paper.eval.triviaqa_examples) == (1000, 1000)
    assert paper.train["rows_per_step"] == 512 and paper.train["layers"] == [6, 12, 18]
    tiny = load_suite_config("tiny")
    assert tiny.model == "tiny" and tiny.seeds == (0, 1) and tiny.conditions == CONDITIONS
    # Data resolve against the config file's folder (smf/configs: the package data), the output against the
    # working directory.
    assert Path(tiny.data.medmcqa_validation) == TINY_DATA / "medmcqa_validation.jsonl"
    assert tiny.output_dir == (tmp_path / "runs" / "suite-tiny").resolve()


def test_relative_paths_and_yaml_numbers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, conditions=["lora", "base"], train={"preset": "tiny", "lr": "5e-4"})
    config = load_suite_config(str(path), {"seeds": [3, 1]})
    assert Path(config.data.oasst) == (tmp_path / "data" / "oasst1_train.jsonl").resolve()
    assert config.output_dir == (tmp_path / "out").resolve()
    assert config.conditions == ("base", "lora")  # the paper's order, whatever the file's
    assert config.seeds == (3, 1)
    assert config.train["lr"] == 5e-4  # YAML reads 5e-4 as a string; the trainer's coercion applies


@pytest.mark.parametrize("overrides, message", [
    ({"epochs": 3}, "unknown key 'epochs'; valid keys: name, model, output_dir, seeds"),
    ({"conditions": ["base", "sparse-kl"]}, "conditions: input should be 'base', 'replacement-kl', 'replacement-"),
    ({"train": {"learning_rate": 1e-3}}, "train: unknown key 'learning_rate'; valid keys: preset, layers"),
    ({"train": {"seed": 1}}, "train: option 'seed' is set by the suite for each run (seeds, conditions, model, "
                             "device and data are top-level keys); valid keys: preset, layers"),
    ({"stages": {"lora": {"n_keys": 8}}}, "stages.lora: option 'n_keys' does not apply to this stage; valid"),
    ({"stages": {"sparse2": {}}}, "stages: unknown key 'sparse2'; valid keys: retrofit, background, sparse, lora"),
    ({"data": {"wikitext": "../data/missing.jsonl"}}, "data.wikitext: no such path"),
    ({"data": {"wikitext": "/dev/null"}}, "data.wikitext: '/dev/null' is not a dataset file"),
    ({"data": {"medmcqa": "x"}}, "data: unknown key 'medmcqa'; valid keys: oasst, medmcqa_train"),
    ({"eval": {"tasks": ["medmcqa", "mmlu"]}},
     "eval.tasks: input should be 'medmcqa', 'wikitext', 'triviaqa', 'learn', 'heldout', 'retain' or "
     "'retain_heldout', got 'mmlu'"),
    ({"eval": {"wikitext_stride": 1024, "wikitext_window": 512}},
     "eval: wikitext_stride (1024) must be smaller than wikitext_window (512)"),
    ({"seeds": [0, 0]}, "seeds: (0, 0) repeats a value"),
    ({"model": "./no-such-model"}, "model: no such directory"),
    ({"train": {"preset": "tiny", "global_batch_size": 6}}, "--global-batch-size 6 is not a multiple"),
    ({"protocol": "paper"}, "protocol: input should be 'authors' or 'clean', got 'paper'"),
    ({"train": {"protocol": "clean"}}, "train: option 'protocol' is set by the suite"),
    ({"authors_update": ["lora"]}, "authors_update: 'lora' is not a sparse condition of this suite"),
    ({"conditions": ["base", "additive-kl"], "authors_update": ["additive-tfidf"]},
     "authors_update: 'additive-tfidf' is not a sparse condition of this suite; choose from additive-kl"),
])
def test_bad_config_raises_one_clear_error(tmp_path, overrides, message):
    path = _write(tmp_path, **overrides)
    with pytest.raises(ConfigError) as info:
        load_suite_config(str(path))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_valid_train_keys_are_listed():
    assert "lr" in TRAIN_KEYS and "rows_per_step" in TRAIN_KEYS and "seed" not in TRAIN_KEYS


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    bad = _write(tmp_path, conditions=["base", "dense"])
    assert cli.main(["suite", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("smf suite: error: conditions: input should be 'base', ") and err.count("\n") == 1
    assert err.rstrip().endswith("got 'dense'")
    assert cli.main(["suite", "--config", "no-such-config"]) == 2
    assert "shipped: factorial, factorial2, locality, newkind, paper, science, science_budget, science_confirm, science_pretrained, science_pretrained16k, stream, stream10, tiny" in capsys.readouterr().err
    assert cli.main(["report", "--suite-dir", str(tmp_path / "nowhere")]) == 2
    assert "is not a suite directory" in capsys.readouterr().err
    assert cli.main(["eval", "--model", "tiny", "--adapter", str(tmp_path / "nowhere")]) == 2
    assert "--adapter: no such directory" in capsys.readouterr().err


def test_dry_run_lists_the_plan_with_totals_and_runs_nothing(tmp_path, monkeypatch, capsys):
    from smf.suite.fingerprints import run_hash
    from smf.suite.plan import SuiteLayout, plan_runs

    monkeypatch.chdir(tmp_path)
    assert cli.main(["suite", "--config", "tiny", "--dry-run"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    runs = 2 * (len(CONDITIONS) + 1)  # + the authors'-update run of additive-kl per seed
    assert lines[0] == f"suite tiny: {runs} runs, seeds 0, 1, into {tmp_path / 'runs' / 'suite-tiny'}"
    names = dry_run_names(out)
    assert len(names) == runs and names[0] == "base-seed0" and names[-1] == "additive-kl-authors-update-seed1"
    assert lines[-1].startswith(f"total: {runs} runs, 0 done, {runs} to do; no time estimate")
    assert not (tmp_path / "runs").exists()
    # two finished runs (one written by other settings): the estimate is their mean times the runs to do
    config = load_suite_config("tiny")
    layout = SuiteLayout(config.output_dir)
    layout.results_dir.mkdir(parents=True)
    first, second = plan_runs(config)[:2]
    layout.results_path(first).write_text(json.dumps({
        "condition": first.condition, "seed": first.seed, "config_hash": run_hash(config, first),
        "metrics": {METRIC_OF_TASK[task]: 1.0 for task in config.eval.tasks},
        "timing": {"wall_s": 90.0, "eval_s": {task: 1.0 for task in config.eval.tasks}}}))
    layout.results_path(second).write_text(json.dumps({"config_hash": "other", "timing": {"wall_s": 1.0}}))
    assert cli.main(["suite", "--config", "tiny", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split() == ["base-seed0", "done"] and "refused: written with other settings" in lines[3]
    assert lines[-1].startswith(f"total: {runs} runs, 1 done, {runs - 2} to do, 1 refused; about 27 min 00 s left")
    assert cli.main(["suite", "--config", "science", "--dry-run"]) == 0  # its pretraining comes first
    assert capsys.readouterr().out.splitlines()[1:4] == [  # a base per seed (base_per_seed), each with its state
        f"before the runs of seed {seed}: its world and the model pretrained on it (bases/seed{seed}/): to do"
        for seed in (0, 1, 2)]


def test_additive_s_plans_the_additive_retrofit_and_the_ablation_its_own_train_dir(tmp_path):
    from smf.suite.plan import Run, SuiteLayout, plan_runs, sparse_stage_dirs, stage_config

    path = _write(tmp_path, conditions=["additive-kl", "additive+s-kl", "replacement-kl"],
                  authors_update=["additive+s-kl"], protocol="clean")
    suite = load_suite_config(str(path))
    layout = SuiteLayout(suite.output_dir)
    runs = plan_runs(suite)
    assert [run.name for run in runs] == ["replacement-kl-seed0", "additive-kl-seed0", "additive+s-kl-seed0",
                                          "additive+s-kl-authors-update-seed0"]
    dirs = {run.name: sparse_stage_dirs(layout, run, suite) for run in runs}
    assert dirs["additive+s-kl-seed0"] == dirs["additive-kl-seed0"] == dirs["additive+s-kl-authors-update-seed0"]
    assert dirs["replacement-kl-seed0"][0].name == "replacement-seed0"
    ablation = runs[3]
    sparse = stage_config(suite, "sparse", 0, layout.train_dir(ablation), mode=ablation.mode, rule=ablation.rule,
                          adapter=tmp_path, background=tmp_path, update="authors")
    assert (sparse.mode, sparse.update, sparse.protocol) == ("additive+s", "authors", "clean")
    assert layout.train_dir(ablation).name == "additive+s-kl-authors-update-seed0"
    assert Run("additive+s-kl", 0).retrofit_mode == "additive"


def test_the_confirmation_preset_is_the_science_preset_on_other_seeds():
    """suite_science_confirm.yaml copies the science preset (its grids frozen, as registered): only the name, the
    folder and the seeds may differ, so an edit to one preset that misses the other fails here."""
    configs = Path(__file__).parents[1] / "smf" / "configs"
    science, confirm = (yaml.safe_load((configs / f"suite_{name}.yaml").read_text())
                        for name in ("science", "science_confirm"))
    assert {key for key in science.keys() | confirm.keys() if science.get(key) != confirm.get(key)} == \
        {"name", "output_dir", "seeds"}
    assert set(science["seeds"]).isdisjoint(confirm["seeds"])
