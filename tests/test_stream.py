"""A stream of tasks (``stream:``, smf/suite/stream.py) on a reduced world: the new people split into tasks that
partition the world's new-fact sets; every stage starts from the previous stage's result (sparse: its memories;
LoRA: the merged model; full: its weights), checked on the start model's logits; every stage is evaluated on the old
facts and on every task's own questions; the report draws the per-stage tables, matched learning on the last task
and the forgetting curves; a stream killed in its second stage resumes there and writes the same files as an
unbroken one; bad ``stream:`` options are refused in one line. No test says which method forgets less."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from smf import cli
from smf.data.stream_tasks import StreamOptions, split_people, stream_task_rows, task_name
from smf.data.world import WorldOptions, build_world
from smf.errors import ConfigError
from smf.model.loading import load_model
from smf.suite import runner as runner_module
from smf.suite.config import load_suite_config, parse_suite_config
from smf.suite.plan import Run, SuiteLayout, sparse_stage_dirs
from smf.suite.stream import StreamLayout
from smf.train import loop

WORLD = {"n_old": 40, "n_new": 9, "bio_renders": 4, "heldout_people": 10, "n_retain": 40}  # seed: the run's (3)
PRETRAIN = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
            "epochs": 3, "lr": 1e-2, "batch_size": 16, "warmup_steps": 10}
SEED, TASKS = 3, 3
CONDITIONS = ["base", "additive+s-tfidf", "lora", "full"]
RATES = {"sparse": [1e-2], "lora": [1e-3]}
SCHEDULES = {"full": {2: [1e-3]}}  # a schedule configuration: 2 epochs per stage (the stages' configured: 1)
PROBE = "Question: Where was Abel Aldmoor born ?\nAnswer:"


def _raw(output_dir: Path, conditions=CONDITIONS, **changes) -> dict:
    raw = yaml.safe_load((Path(__file__).parents[1] / "smf" / "configs" / "suite_stream.yaml").read_text())
    for key in ("variants", "schedule_sweep", "hypotheses"):  # one rate per method at the stage's epochs
        raw.pop(key, None)
    raw.update(output_dir=str(output_dir), seeds=[SEED], world=WORLD, pretrain=PRETRAIN, conditions=conditions,
               lr_sweep=RATES, schedule_sweep=SCHEDULES)
    raw["train"].update(layers=[0, 1], n_keys=8, topk=4, key_dim=16, rows_per_step=16, n_background=20,
                        global_batch_size=8, micro_batch_size=8, save_every=1)
    raw["stages"] = {"retrofit": {"epochs": 1}, "sparse": {"epochs": 1}, "lora": {"epochs": 1}, "full": {"epochs": 1}}
    raw.update(changes)
    return raw


def _config(directory: Path, raw: dict):
    path = directory / "stream.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_suite_config(str(path))


def _logits(model, tokenizer) -> torch.Tensor:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(**tokenizer(PROBE, return_tensors="pt")).logits
    model.train(was_training)
    return logits


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    """The reduced stream suite run once: (config, results by run name, start logits of every trained stage by its
    output directory, in the order the stages trained)."""
    from smf.suite.runner import run_suite

    root = tmp_path_factory.mktemp("stream")
    config = _config(root, _raw(root / "suite"))
    starts = {}
    real_build_setup = loop.build_setup

    def spy(run_config, world):
        setup = real_build_setup(run_config, world)
        if run_config.recipe in ("sparse", "lora", "full"):
            starts[Path(run_config.output_dir)] = _logits(setup.model, setup.tokenizer)
        return setup

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "build_setup", spy)
        results = run_suite(config)
    return config, {Run(r["condition"], r["seed"], lr=r.get("lr"), epochs=r.get("epochs")).name: r
                    for r in results}, starts


def _trained_runs(config):
    return [Run("full", SEED, lr=1e-3, epochs=2) if condition == "full" else
            Run(condition, SEED, lr=RATES["lora" if condition == "lora" else "sparse"][0])
            for condition in CONDITIONS if condition != "base"]


def test_tasks_partition_the_new_facts():
    world = build_world({**WORLD, "seed": SEED})
    per_task = stream_task_rows(world, TASKS)
    groups = split_people(world.new, TASKS)
    assert [len(group) for group in groups] == [3, 3, 3] and sum(groups, []) == world.new
    for role in ("train", "eval_learn"):
        rows = [row for task in per_task for row in task[role]]
        assert sorted(map(json.dumps, rows)) == sorted(json.dumps(dict(row)) for row in world.datasets[role])
        for group, task in zip(groups, per_task):
            names = {person.name for person in group}
            assert task[role] and all(any(name in row["question"] for name in names) for row in task[role])
    assert [len(group) for group in split_people(world.new, 4)] == [3, 2, 2, 2]
    assert StreamOptions(tasks=3).train_rows(9) == 18


def test_each_stage_starts_from_the_previous_stages_result(stream):
    config, _, starts = stream
    own = runner_module.seed_config(config, SEED)
    layout, streams = SuiteLayout(config.output_dir), StreamLayout(config.output_dir, TASKS)
    for run in _trained_runs(config):
        dirs = [streams.stage_dir(run, stage) for stage in range(1, TASKS + 1)]
        assert dirs[-1] == layout.train_dir(run) and all(directory in starts for directory in dirs)
        first = sparse_stage_dirs(layout, run, own)[0] if run.recipe == "sparse" else None
        for stage, directory in enumerate(dirs, start=1):
            recorded = json.loads((directory / "run_config.json").read_text())
            assert recorded["train_data"].endswith(f"task{task_name(stage - 1)}/train.jsonl")
            assert recorded["epochs"] == (run.epochs or 1)  # a schedule configuration's epochs, every stage
            previous = first if stage == 1 else dirs[stage - 2]
            if run.recipe == "sparse":
                assert Path(recorded["adapter"]) == previous
            elif stage > 1:
                expected = previous / "final" if run.recipe == "full" else streams.merged_dir(run, stage - 1)
                assert Path(recorded["model"]) == expected
            model, tokenizer = load_model(own.model, previous)
            torch.testing.assert_close(starts[directory], _logits(model, tokenizer), rtol=1e-5, atol=1e-5)
            if stage > 1:  # it learned something in the stage before: the chain is not the start model's
                assert not torch.equal(starts[directory], starts[dirs[stage - 2]])


def test_a_schedule_configuration_trains_its_epochs_in_every_stage(stream):
    """A schedule_sweep configuration's epochs reach every stage of its stream (not the stage's configured ones)."""
    from types import SimpleNamespace

    from smf.suite.stream import StreamRun

    config, _, _ = stream
    runner = SimpleNamespace(config=config, layout=SuiteLayout(config.output_dir), device=torch.device("cpu"),
                             shared_markers=lambda run: {})
    for run in _trained_runs(config):  # the configuration's epochs (the stage's configured 1 without), every stage
        streamed = StreamRun(runner, run, lambda stage, run_config: {})
        assert [streamed.stage_config(stage)[0].epochs for stage in (1, 2, 3)] == [run.epochs or 1] * 3
        # a configuration of 3 epochs (stage 1: later stages start from directories this run never trained)
        swept = StreamRun(runner, dataclasses.replace(run, epochs=3), lambda stage, run_config: {})
        assert swept.stage_config(1)[0].epochs == 3 and swept.stage_config(1)[0].lr == run.lr


def test_every_stage_is_evaluated_on_old_facts_and_every_task(stream):
    config, results, _ = stream
    world = build_world({**WORLD, "seed": SEED})
    groups = [{person.name for person in group} for group in split_people(world.new, TASKS)]
    streams = StreamLayout(config.output_dir, TASKS)
    task_dir = config.output_dir / "bases" / f"seed{SEED}" / "world" / f"stream-{TASKS}tasks"
    for run in [Run("base", SEED), *_trained_runs(config)]:
        result = results[run.name]
        stages = result["stream"]["stages"]
        assert [s["stage"] for s in stages] == ([0] if run.recipe is None else [1, 2, 3])
        for stage in stages:
            assert set(stage["metrics"]) == {"heldout_ppl", "retain_acc"} and list(stage["tasks"]) == ["A", "B", "C"]
            eval_dir = streams.eval_dir(run, stage["stage"])
            assert (eval_dir / "retain.jsonl").is_file() and (eval_dir / "heldout.jsonl").is_file()
            for index, names in enumerate(groups):
                rows = [json.loads(line) for line in
                        (eval_dir / f"task{task_name(index)}" / "learn.jsonl").read_text().splitlines()]
                asked = [json.loads(line)["question"] for line in (
                    task_dir / f"task{task_name(index)}" / "eval_learn.jsonl").read_text().splitlines()]
                assert {name for question in asked for name in names if name in question} == names
                assert len(rows) == len(asked) == 3 * len(names)  # every fact of the task's people, once
                correct = sum(row["correct"] for row in rows) / len(rows)
                assert stage["tasks"][task_name(index)] == pytest.approx(correct)
        assert result["metrics"]["learn_acc"] == stages[-1]["tasks"]["C"]
        assert result["metrics"]["retain_acc"] == stages[-1]["metrics"]["retain_acc"]
        assert result["timing"]["cpu_s"] > 0 and result.get("epochs") == run.epochs  # the envelope's schedule
        if run.recipe is None:
            assert result["cost"] is None
        else:  # the whole stream's cost: every stage's steps, tokens and flops summed (smf.suite.cost)
            records = [json.loads(line) for k in (1, 2, 3)
                       for line in (streams.stage_dir(run, k) / "train_log.jsonl").read_text().splitlines()]
            assert result["cost"]["steps"] == len(records) > 0
            assert result["cost"]["tokens"] == sum(r["tokens"] for r in records)
            assert result["timing"]["train_cpu_s"] > 0  # every stage's training CPU seconds, summed


def test_report_has_stage_tables_matched_learning_and_forgetting_curves(stream):
    from smf.suite.report import write_suite_report

    config, results, _ = stream
    written = {path.name for path in write_suite_report(config.output_dir)}
    assert {"stream.md", "stream.json", "stream_forgetting.png", "table1.md", "matched_learning.md"} <= written
    report = json.loads((config.output_dir / "stream.json").read_text())
    assert [row["method"][0] for row in report["stages"]] == ["additive+s-tfidf", "lora", "full"]
    assert all(list(row["stages"]) == ["0", "1", "2", "3"] for row in report["stages"])
    assert list(report["matched_learning"]) == ["retain_acc", "task A", "task B", "earlier tasks (mean)"]
    from smf.suite.stream_report import EARLIER_MEAN, matched_records
    records = matched_records(list(results.values()), ["A", "B", "C"])
    assert records and all(record["metrics"][EARLIER_MEAN] == pytest.approx(
        (record["metrics"]["task A"] + record["metrics"]["task B"]) / 2) for record in records)
    page = (config.output_dir / "report.md").read_text()
    assert "A stream of tasks" in page and "stream_forgetting.png" in page


def test_the_packed_results_redraw_the_stream_report(stream, tmp_path):
    from smf.suite.report import write_suite_report
    from smf.suite.shipped import write_packed, write_packed_report

    config, _, _ = stream
    write_suite_report(config.output_dir)
    packed = write_packed(config.output_dir, tmp_path / "results.json")
    stages = [stage for run in json.loads(packed.read_text())["runs"] for stage in run["stream"]["stages"]]
    assert stages and not any({"train_s", "eval_s"} & set(stage) for stage in stages)  # compact: no stage seconds
    written = {path.name for path in write_packed_report(packed, tmp_path / "report")}
    assert {"stream.md", "stream.json", "stream_forgetting.png"} <= written
    for name in ("stream.md", "stream.json"):  # the records alone give it: the same as the suite folder's
        assert (tmp_path / "report" / name).read_text() == (config.output_dir / name).read_text()


def test_killed_stream_resumes_in_its_stage_with_the_same_files(stream, tmp_path, monkeypatch):
    from smf.suite.runner import run_suite

    reference, _, _ = stream
    conditions = ["additive+s-tfidf", "lora"]
    config = _config(tmp_path, _raw(tmp_path / "suite", conditions))
    runs = [run for run in _trained_runs(config) if run.condition in conditions]
    trained, steps = [], []
    real_train, real_run_step = runner_module.train, loop.run_step

    def spy_train(run_config):
        trained.append((Path(run_config.output_dir).parent.name, Path(run_config.output_dir).name, run_config.resume))
        steps.clear()
        return real_train(run_config)

    def dies_in_stage_two(*args, **kwargs):
        if trained[-1][1].startswith("stage2") and len(steps) == 1:
            raise KeyboardInterrupt("killed")
        steps.append(1)
        return real_run_step(*args, **kwargs)

    monkeypatch.setattr(runner_module, "train", spy_train)
    monkeypatch.setattr(loop, "run_step", dies_in_stage_two)
    with pytest.raises(KeyboardInterrupt):
        run_suite(config)
    streams = StreamLayout(config.output_dir, TASKS)
    assert streams.record_path(runs[0], 1).is_file() and not streams.record_path(runs[0], 2).exists()
    monkeypatch.setattr(loop, "run_step", real_run_step)
    trained.clear()
    run_suite(config)
    sparse = [entry for entry in trained if runs[0].name in entry[:2]]  # the last stage trains in train/{run}
    assert sparse == [(runs[0].name, "stage2-taskB", True), ("train", runs[0].name, False)]  # resumed in stage 2
    ours, theirs = SuiteLayout(config.output_dir), SuiteLayout(reference.output_dir)
    for run in runs:
        for stage in range(1, TASKS + 1):
            mine = json.loads(streams.record_path(run, stage).read_text())
            same = json.loads(StreamLayout(reference.output_dir, TASKS).record_path(run, stage).read_text())
            assert (mine["metrics"], mine["tasks"]) == (same["metrics"], same["tasks"])
        for path in sorted((ours.eval_dir(run)).rglob("*.jsonl")):
            assert path.read_bytes() == (theirs.eval_dir(run) / path.relative_to(ours.eval_dir(run))).read_bytes()
        finals = sorted((ours.train_dir(run) / "final").glob("*.safetensors"))
        assert finals and all(path.read_bytes() == (theirs.train_dir(run) / "final" / path.name).read_bytes()
                              for path in finals)


@pytest.mark.parametrize("stream, message", [
    ({"tasks": 1}, "stream: option 'tasks'"),
    ({"tasks": 27}, "stream: option 'tasks'"),
    ({"tasks": "three"}, "stream: option 'tasks'"),
    ({"task": 3}, "stream: unknown key 'task'"),
    (3, "stream must be a mapping"),
    ({"tasks": 10}, "exceeds world.n_new 9"),
    ({"tasks": 4}, "fewer than one global batch of 16"),
])
def test_bad_stream_options_are_refused_in_one_line(tmp_path, stream, message):
    raw = _raw(tmp_path / "suite", stream=stream)
    raw["train"].update(global_batch_size=16, micro_batch_size=16)  # 9 new people in 4 tasks: 12 rows in the smallest
    with pytest.raises(ConfigError, match=message) as refused:
        parse_suite_config(raw, tmp_path, check_paths=False)
    assert "\n" not in str(refused.value)


def test_stream_needs_a_world_and_the_learn_evaluation(tmp_path, capsys):
    raw = _raw(tmp_path / "suite")
    raw["eval"]["tasks"] = ["heldout", "retain"]
    with pytest.raises(ConfigError, match="eval.tasks .* must include learn"):
        parse_suite_config(raw, tmp_path, check_paths=False)
    without_world = {key: value for key, value in _raw(tmp_path / "suite").items()
                     if key not in ("world", "pretrain", "base_per_seed")}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**without_world, "model": "tiny"}))
    assert cli.main(["suite", "--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "smf suite: error: stream needs world" in err


def test_stream_preset_shares_the_science_bases_and_sweep():
    from smf.suite.plan import plan_runs

    configs = Path(__file__).parents[1] / "smf" / "configs"
    science = yaml.safe_load((configs / "suite_science.yaml").read_text())
    raw = yaml.safe_load((configs / "suite_stream.yaml").read_text())
    # the shipped bases are copied (the same worlds and pretraining), and the methods, SMF configurations and
    # schedule sweep are the science preset's
    same = ("seeds", "conditions", "world", "pretrain", "train", "stages", "eval", "base_per_seed", "variants",
            "schedule_sweep", "matched_learning")
    assert {key: raw[key] for key in same} == {key: science[key] for key in same}
    config = load_suite_config("stream")
    assert config.stream == {"tasks": 3} and len(plan_runs(config)) == 5 * (1 + 4 * 6)
    assert {h["a"] for h in config.hypotheses.values()} == {"additive+s-tfidf/paper-like", "additive-tfidf/large-step"}


def test_a_suite_without_a_stream_records_no_stream_key(tmp_path):
    """A suite directory recorded before streams existed keeps matching its config (smf.suite.fingerprints.merged_plan)."""
    raw = _raw(tmp_path / "suite")
    del raw["stream"]
    assert "stream" not in parse_suite_config(raw, tmp_path, check_paths=False).to_dict()
    assert parse_suite_config(_raw(tmp_path / "suite"), tmp_path, check_paths=False).to_dict()["stream"] == {"tasks": 3}
