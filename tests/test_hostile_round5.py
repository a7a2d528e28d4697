"""Issue 50's hostile pass over what round 5 built: the study options (schedule_sweep, hypotheses, variants'
conditions, the hypotheses record), streams, pretraining with memories (and ``python -m smf.train.pretrain``), world
options, ``--jobs``, rows_per_step, duplicated keys and ``benchmarks/gpu_run.py``'s options. Each case is an input a
careless or hostile user would give, with its expected one-line outcome: a ConfigError (CLI: ``smf <cmd>: error:
...``, exit 2, nothing written) naming the option, or the documented behaviour. The cases marked "fixed" were
accepted silently, misnamed or a traceback before this pass."""
import logging
import math
import sys
from pathlib import Path

import pytest
import yaml

from smf.cli import main
from smf.data.stream_tasks import StreamOptions, stream_task_rows
from smf.data.world import WorldOptions, build_world
from smf.errors import ConfigError
from smf.train import pretrain
from smf.suite.config import parse_suite_config
from smf.suite.jobs import Task, run_tasks
from smf.suite.plan import SuiteLayout, plan_runs
from smf.suite.report import hypotheses_section
from smf_kernels.sparse import SparseMemoryController
from smf_kernels.sparse.selection import default_rows_per_step
from helpers import MemoryLM
from test_cli_smf import run_main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_run  # noqa: E402

WORLD = {"seed": 3, "n_old": 40, "n_new": 8, "bio_renders": 4, "heldout_people": 10, "n_retain": 40}
PRETRAIN = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}
MEMORY = {"layers": [1], "n_keys": 8, "heads": 2, "topk": 4, "key_dim": 8}
TRAIN = {"n_keys": 8, "rows_per_step": 4, "global_batch_size": 2, "micro_batch_size": 2}
SWEEP = {"sparse": [1e-2, 1e-1], "lora": [1e-3, 1e-2]}
HYPOTHESIS = {"a": "additive-tfidf", "b": "lora", "level": 0.5, "threshold": 0.1, "statement": "sparse keeps more"}
TINY_TRAIN = str(Path(__file__).resolve().parents[1] / "smf" / "configs" / "tiny.yaml")


def parse(tmp_path, **overrides):
    """A small science suite (world, pretraining, one sparse condition and LoRA) with ``overrides``, validated."""
    raw = {"name": "h", "output_dir": str(tmp_path / "suite"), "seeds": [0], "device": "cpu",
           "conditions": ["base", "additive-tfidf", "lora"], "world": WORLD, "pretrain": PRETRAIN, "train": TRAIN,
           "lr_sweep": SWEEP, **overrides}
    return parse_suite_config(raw, tmp_path)


def refused(tmp_path, message, **overrides):
    """The one-line ConfigError ``parse`` raises for ``overrides``, checked to contain ``message``."""
    with pytest.raises(ConfigError) as err:
        parse(tmp_path, **overrides)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "suite").exists()


def test_the_small_suite_itself_is_accepted(tmp_path):
    """The baseline the cases below break one thing of (else they would test nothing)."""
    config = parse(tmp_path, stream={"tasks": 2}, matched_learning=[0.5], hypotheses={"h": HYPOTHESIS})
    assert config.stream == {"tasks": 2} and config.hypotheses["h"]["level"] == 0.5


# ------------------------------------------------------------------------------------------------ schedule_sweep
@pytest.mark.parametrize("schedule, message", [
    ({0: [1e-3, 1e-2]}, "schedule_sweep.lora.0.[key]: input should be greater than 0, got '0'"),
    ({-1: [1e-3, 1e-2]}, "schedule_sweep.lora.-1.[key]: input should be greater than 0, got '-1'"),  # fixed: '_1'
    ({"ten": [1e-3, 1e-2]}, "schedule_sweep.lora.ten.[key]: input should be a valid integer"),
    ({2.5: [1e-3, 1e-2]}, "schedule_sweep.lora.2.5.[key]: input should be a valid integer"),
    ({3: [1e-3, 1e-3]}, "schedule_sweep.lora: give epochs -> distinct positive learning rates"),
    ({3: [-1e-3, 1e-2]}, "schedule_sweep.lora.3: input should be greater than 0, got -0.001"),
    ({3: [math.inf, 1e-2]}, "schedule_sweep.lora.3: input should be a finite number, got inf"),
    ({3: [math.nan, 1e-2]}, "schedule_sweep.lora.3: input should be a finite number, got nan"),
    ({3: 1e-3}, "schedule_sweep.lora.3: input should be a valid tuple"),
    ([1e-3, 1e-2], "schedule_sweep.lora must be a mapping, got list"),
    ({}, "schedule_sweep.lora: give epochs -> distinct positive learning rates"),
])
def test_a_bad_schedule_is_refused_by_name(tmp_path, schedule, message):
    refused(tmp_path, message, lr_sweep={"sparse": SWEEP["sparse"]}, schedule_sweep={"lora": schedule})


def test_a_schedule_for_an_unknown_recipe_or_beside_its_lr_sweep_is_refused(tmp_path):
    refused(tmp_path, "schedule_sweep: unknown recipe 'lorra'", schedule_sweep={"lorra": {3: [1e-3, 1e-2]}})
    refused(tmp_path, "schedule_sweep.lora and lr_sweep.lora cannot both be given",
            schedule_sweep={"lora": {3: [1e-3, 1e-2]}})


@pytest.mark.parametrize("schedule", [{0: [1e-2, 1e-1]}, {"ten": [1e-2, 1e-1]}, [1e-2, 1e-1], {3: [math.inf, 1e-1]}])
def test_a_variants_bad_schedule_is_refused_by_name(tmp_path, schedule):
    refused(tmp_path, "variants.v.schedule_sweep: give positive finite learning rates per positive number of epochs",
            lr_sweep={"lora": SWEEP["lora"]}, variants={"v": {"schedule_sweep": schedule}})


# ------------------------------------------------------------------------------------------------- hypotheses
@pytest.mark.parametrize("change, message", [
    ({"a": "magic"}, "hypotheses.h.a: 'magic' is not a trained method of this suite"),
    ({"a": "additive-tfidf/"}, "hypotheses.h.a: 'additive-tfidf/' is not a trained method"),  # fixed: accepted
    ({"a": "additive-tfidf/v"}, "hypotheses.h.a: 'additive-tfidf/v' is not a trained method"),  # no variant v
    ({"b": "base"}, "hypotheses.h.b: 'base' is not a trained method"),
    ({"b": "additive-tfidf"}, "hypotheses.h: a and b are the same method"),
    ({"level": 0.9}, "hypotheses.h.level: 0.9 is not a matched_learning level (0.5)"),
    ({"level": "0.5"}, "hypotheses.h.level: give a number, got '0.5'"),
    ({"level": True}, "hypotheses.h.level: give a number, got True"),
    ({"threshold": 0}, "hypotheses.h.threshold: give the smallest difference a - b that matters, nonzero"),
    ({"threshold": 2}, "hypotheses.h.threshold: give the smallest difference"),
    ({"threshold": math.nan}, "hypotheses.h.threshold: give the smallest difference"),
    ({"statement": "  "}, "hypotheses.h.statement: give a non-empty string"),
    ({"levle": 0.5}, "hypotheses.h: unknown key 'levle'; valid keys: a, b, level, threshold, statement"),
])
def test_a_bad_hypothesis_is_refused_by_name(tmp_path, change, message):
    refused(tmp_path, message, matched_learning=[0.5], hypotheses={"h": {**HYPOTHESIS, **change}})


@pytest.mark.parametrize("hypotheses, message", [
    ([HYPOTHESIS], "hypotheses must be a mapping of name -> hypothesis, got list"),
    ({"h": [HYPOTHESIS]}, "hypotheses.h must be a mapping, got list"),
    ({"h": {"a": "lora"}}, "hypotheses.h: b, level, threshold, statement required"),
    ({"H": HYPOTHESIS}, "hypotheses.H: a hypothesis's name: lower-case letters"),
])
def test_a_malformed_hypotheses_section_is_refused(tmp_path, hypotheses, message):
    refused(tmp_path, message, matched_learning=[0.5], hypotheses=hypotheses)


def test_hypotheses_without_matched_learning_are_refused(tmp_path):
    refused(tmp_path, "hypotheses are evaluated at matched learning: give matched_learning",
            hypotheses={"h": HYPOTHESIS})


# --------------------------------------------------------------------------------------- variants' conditions
@pytest.mark.parametrize("conditions", [["magic"], ["lora"], [], ["additive-tfidf", "additive-tfidf"], 3])
def test_a_variants_conditions_that_are_not_distinct_sparse_conditions_are_refused(tmp_path, conditions):
    refused(tmp_path, "variants.v.conditions: give distinct sparse conditions", lr_sweep={"lora": SWEEP["lora"]},
            variants={"v": {"lr_sweep": SWEEP["sparse"], "conditions": conditions}})


def test_a_sparse_condition_in_no_variant_is_refused(tmp_path):
    refused(tmp_path, "conditions: additive-tfidf run in no variant", lr_sweep={"lora": SWEEP["lora"]},
            conditions=["base", "additive-kl", "additive-tfidf", "lora"],
            variants={"v": {"lr_sweep": SWEEP["sparse"], "conditions": ["additive-kl"]}})


# ------------------------------------------------------------------------------------------------------ stream
@pytest.mark.parametrize("stream, message", [
    ({"tasks": 0}, "stream: option 'tasks': input should be greater than or equal to 2, got 0"),
    ({"tasks": 1}, "stream: option 'tasks': input should be greater than or equal to 2, got 1"),
    ({"tasks": 27}, "stream: option 'tasks': input should be less than or equal to 26, got 27"),
    ({"tasks": 9}, "stream: option 'tasks' 9 exceeds world.n_new 8"),
    ({"tasks": "three"}, "stream: option 'tasks': input should be a valid integer"),
    ({"tasks": 2.5}, "stream: option 'tasks': input should be a valid integer, got a number with a fractional part"),
    ({"tasks": 2, "order": "random"}, "stream: unknown key 'order'; valid keys: tasks"),
    (3, "stream must be a mapping, got int"),
    (0, "stream must be a mapping, got int"),  # fixed: read as no stream
    (False, "stream must be a mapping, got bool"),  # fixed: read as no stream
    ([], "stream must be a mapping, got list"),  # fixed: read as no stream
])
def test_a_bad_stream_is_refused_by_name(tmp_path, stream, message):
    refused(tmp_path, message, stream=stream)


def test_a_stream_without_a_world_or_too_small_for_a_batch_is_refused(tmp_path):
    refused(tmp_path, "stream needs world: it splits the world's new people into tasks", stream={"tasks": 2},
            world=None, pretrain=None, model="tiny")
    refused(tmp_path, "stream: the smallest of 4 tasks has 12 training rows, fewer than one global batch of 64",
            stream={"tasks": 4}, train={**TRAIN, "global_batch_size": 64, "micro_batch_size": 8})


def test_a_new_kind_worlds_stream_counts_its_own_templates(tmp_path):
    """fixed: the smallest task's rows were counted with the old attributes' templates (12 instead of 8 here), so a
    global batch larger than a task was accepted."""
    world = build_world(WorldOptions(**{**WORLD, "new_kind": True}))
    assert min(len(task["train"]) for task in stream_task_rows(world, 3)) == \
        StreamOptions(tasks=3).train_rows(WORLD["n_new"], new_kind=True) == 8
    refused(tmp_path, "stream: the smallest of 3 tasks has 8 training rows, fewer than one global batch of 10",
            world={**WORLD, "new_kind": True}, stream={"tasks": 3}, train={**TRAIN, "global_batch_size": 10})


def test_a_variants_batch_larger_than_a_task_is_refused(tmp_path):
    """fixed: only train's and stages' batch sizes were checked."""
    refused(tmp_path, "stream: the smallest of 2 tasks has 24 training rows, fewer than one global batch of 32 "
                      "(variants.big)", stream={"tasks": 2}, lr_sweep={"lora": SWEEP["lora"]},
            variants={"big": {"global_batch_size": 32, "micro_batch_size": 8, "lr_sweep": SWEEP["sparse"]}})


@pytest.mark.parametrize("content, message", [("{not json", "is not a readable hypotheses record"),
                                              ('{"hypotheses": {}}', "expected a JSON object with 'registered_at'")])
def test_a_damaged_hypotheses_record_is_named_by_the_report(tmp_path, content, message):
    """fixed: the report read it with json.loads (a JSONDecodeError or KeyError traceback)."""
    config = parse(tmp_path, matched_learning=[0.5], hypotheses={"h": HYPOTHESIS})
    record = SuiteLayout(config.output_dir).hypotheses_file
    record.parent.mkdir(parents=True)
    record.write_text(content)
    with pytest.raises(ConfigError, match=f"^{record}.*{message}"):
        hypotheses_section(config, {"configurations": [], "compute": []}, [])


# ----------------------------------------------------------------------------------------------- pretrain.memory
@pytest.mark.parametrize("change, message", [
    ({"layers": [2]}, "memory: layers [2] are beyond the model's 2 decoder layers (valid: 0 to 1)"),
    ({"layers": [-1]}, "option 'memory.layers': input should be greater than or equal to 0, got -1"),
    ({"layers": []}, "option 'memory.layers': tuple should have at least 1 item"),
    ({"layers": [1, 1]}, "option 'memory.layers': (1, 1) repeats a value"),
    ({"n_keys": 0}, "option 'memory.n_keys': input should be greater than 0, got 0"),
    ({"topk": 9}, "memory: topk (9) must be at most n_keys (8)"),
    ({"key_dim": 7}, "option 'memory.key_dim': input should be a multiple of 2, got 7"),
    ({"alpha_init": math.inf}, "option 'memory.alpha_init': input should be a finite number"),
    ({"value_dim": 8}, "option 'memory.value_dim': unexpected keyword argument"),
])
def test_a_bad_pretrain_memory_is_refused_by_name(tmp_path, change, message):
    refused(tmp_path, message, pretrain={**PRETRAIN, "memory": {**MEMORY, **change}})


@pytest.mark.parametrize("overrides, message", [
    ({"conditions": ["base", "replacement-tfidf", "lora"]}, "conditions ['replacement-tfidf']: a base pretrained "
                                                            "with its memories (pretrain.memory) has additive"),
    ({"train": {**TRAIN, "n_keys": 16}}, "train: option 'n_keys' is 16 but pretrain.memory.n_keys is 8"),
    ({"stages": {"retrofit": {"topk": 2}}},  # fixed: accepted, the runs loaded the pretrained memories
     "stages.retrofit: option 'topk' is 2 but pretrain.memory.topk is 4"),
    ({"lr_sweep": {"lora": SWEEP["lora"]}, "variants": {"v": {"n_keys": 16, "lr_sweep": SWEEP["sparse"]}}},
     "variants.v: option 'n_keys' is 16 but pretrain.memory.n_keys is 8"),  # fixed: the runs ignored it
    ({"pretrain": {**PRETRAIN, "memory": [1]}}, "option 'memory': input should be a dictionary"),
    ({"pretrain": 0}, "pretrain must be a mapping, got int"),  # fixed: read as no pretraining ("model is required")
])
def test_what_a_base_with_pretrained_memories_cannot_run_is_refused(tmp_path, overrides, message):
    refused(tmp_path, message, **{"pretrain": {**PRETRAIN, "memory": MEMORY}, **overrides})


def test_pretrained_memories_of_the_trains_sizes_are_accepted(tmp_path):
    config = parse(tmp_path, pretrain={**PRETRAIN, "memory": MEMORY}, train={**TRAIN, "layers": [1], "topk": 4},
                   stages={"retrofit": {"n_keys": 8}})
    assert config.pretrain["memory"]["n_keys"] == 8


# ------------------------------------------------------------------------------------------------- world options
@pytest.mark.parametrize("change, message", [
    ({"new_kind": True, "n_new": 500}, "world: n_new 500: only 464 new names combine name parts of the 40 old"),
    ({"old_qa_templates": 1}, "world: option 'old_qa_templates': input should be greater than or equal to 2, got 1"),
    ({"old_qa_templates": 9}, "world: option 'old_qa_templates': input should be less than or equal to 4, got 9"),
    ({"retain_heldout": 2}, "world: option 'retain_heldout': input should be a valid boolean"),
    ({"new_kinds": True}, "world: unknown key 'new_kinds'"),
])
def test_a_bad_world_option_is_refused_by_name(tmp_path, change, message):
    refused(tmp_path, message, world={**WORLD, **change})


def test_eval_retain_heldout_needs_the_world_option(tmp_path):
    refused(tmp_path, "eval.tasks ['retain_heldout']", eval={"tasks": ["learn", "retain_heldout"]})
    config = parse(tmp_path, world={**WORLD, "retain_heldout": True}, eval={"tasks": ["learn", "retain_heldout"]})
    assert config.data.eval_retain_heldout


# ----------------------------------------------------------------------------------------- the CLI: --jobs, flags
def cli_refuses(argv, capsys, message, out: Path):
    code, err = run_main(argv, capsys)
    err = err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not out.exists()


@pytest.mark.parametrize("jobs", ["0", "-1", "two", "1.5"])
def test_jobs_that_are_not_a_positive_integer_are_refused(tmp_path, capsys, jobs):
    out = tmp_path / "suite"
    cli_refuses(["suite", "--config", "tiny", "--output-dir", str(out), "--jobs", jobs, "--dry-run"], capsys,
                f"smf suite: error: argument --jobs: expected a positive integer, got '{jobs}'", out)


def test_more_jobs_than_runs_is_accepted_and_the_dry_run_writes_nothing(tmp_path, capsys):
    out = tmp_path / "suite"
    code, _ = run_main(["suite", "--config", "tiny", "--output-dir", str(out), "--jobs", "99", "--dry-run"], capsys)
    assert code == 0 and not out.exists()


@pytest.mark.parametrize("config, conditions", [("science", ["base", "full"]), ("science", ["base"]),
                                                ("science_pretrained", ["base", "lora"])])
def test_a_world_suite_narrowed_to_its_baselines_lists_their_runs(tmp_path, capsys, config, conditions):
    """fixed: refused, naming its variants ("this suite has none") or its world's background file ("not used"),
    neither of which the call gave; a subset of a suite's conditions is documented (docs/cli.md)."""
    out = tmp_path / "suite"
    code = main(["--log-level", "ERROR", "suite", "--config", config, "--output-dir", str(out), "--seeds", "0",
                 "--conditions", *conditions, "--dry-run"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    listed = [line.split()[0] for line in printed.out.splitlines()
              if line.endswith("to do") and not line.startswith("before")]
    assert listed and all(name.startswith(tuple(conditions)) for name in listed) and not out.exists()


def test_variants_of_a_suite_without_sparse_conditions_have_no_runs(tmp_path):
    """What ``--conditions base lora`` makes of a suite with variants (documented: a subset's variants have no runs)."""
    config = parse(tmp_path, conditions=["base", "lora"], lr_sweep={"lora": SWEEP["lora"]},
                   variants={"v": {"lr_sweep": SWEEP["sparse"]}})
    assert [run.name for run in plan_runs(config)] == ["base-seed0", "lora-lr0.001-seed0", "lora-lr0.01-seed0"]


def test_more_jobs_than_tasks_runs_every_task():
    finished = {}
    failure = run_tasks([Task(("a",), 4.0), Task(("b",), 9.0, (("a",),))], 8, math.sqrt, int, (),
                        lambda task, result: finished.update({task.key: result}))
    assert failure is None and finished == {("a",): 2.0, ("b",): 3.0}


@pytest.mark.parametrize("tasks, message", [  # fixed: a cycle left its tasks unrun and returned "no failure"
    ([Task(("a",), 1.0, (("b",),)), Task(("b",), 1.0, (("a",),))], "wait on each other (a cycle of needs)"),
    ([Task(("a",), 1.0, (("a",),))], "wait on each other"),
    ([Task(("a",), 1.0), Task(("a",), 4.0)], "a key given twice"),  # fixed: the second was never awaited
])
def test_tasks_that_could_never_all_run_are_refused_before_any_worker(tasks, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_tasks(tasks, 2, math.sqrt, int, (), lambda task, result: None)


@pytest.mark.parametrize("rows", ["0", "-3", "1.5", "lots"])
def test_rows_per_step_on_the_command_line_must_be_a_positive_integer(tmp_path, capsys, rows):
    out = tmp_path / "out"
    message = "--rows-per-step: input should be greater than 0" if rows in ("0", "-3") else \
        f"argument --rows-per-step: invalid int value: '{rows}'"
    cli_refuses(["train", "--config", TINY_TRAIN, "--recipe", "sparse", "--output-dir", str(out),
                 "--rows-per-step", rows], capsys, message, out)


def test_rows_per_step_for_a_lora_run_is_refused_as_unused(tmp_path, capsys):
    out = tmp_path / "out"
    cli_refuses(["train", "--config", TINY_TRAIN, "--recipe", "lora", "--output-dir", str(out), "--rows-per-step", "8"],
                capsys, "--rows-per-step is not used by this run: only --recipe sparse uses it", out)


def test_a_misspelt_flag_is_named_with_the_closest_one(tmp_path, capsys):
    out = tmp_path / "out"
    cli_refuses(["train", "--config", TINY_TRAIN, "--output-dir", str(out), "--rows-per-stpe", "4"], capsys,
                "smf train: error: unrecognized argument --rows-per-stpe (did you mean --rows-per-step?)", out)


@pytest.mark.parametrize("rows", [0, -3, 2.5, True, "8"])
def test_the_controller_refuses_a_rows_per_step_that_is_not_a_positive_int(rows):
    model = MemoryLM(40, 16, n_keys=4, heads=2, topk=2, key_dim=8)
    with pytest.raises(ValueError, match=r"rows_per_step must be a positive int or None, got"):
        SparseMemoryController(model, rows_per_step=rows)


def test_the_default_rows_per_step_is_the_papers_share_and_at_least_one(caplog):
    assert [default_rows_per_step(slots) for slots in (4, 256, 441, 16_384)] == [1, 8, 13, 512]
    model = MemoryLM(40, 16, n_keys=4, heads=2, topk=2, key_dim=8)  # 16 slots
    assert set(SparseMemoryController(model).layer_rows.values()) == {1}
    with caplog.at_level(logging.WARNING, logger="smf_kernels.sparse.selection"):
        SparseMemoryController(model, rows_per_step=16)  # T = every slot: allowed, with the documented warning
    assert "is not below the number of slots" in caplog.text


# ------------------------------------------------------------------------------------------- duplicated YAML keys
@pytest.mark.parametrize("text, message", [
    ("name: t\nworld:\n  n_old: 40\n  n_new: 8\n  n_new: 9\n", "duplicate key 'n_new' at line 5 (first at line 4)"),
    ("name: t\nschedule_sweep:\n  full:\n    3: [1e-5]\n    3: [2e-5]\n",
     "duplicate key 3 at line 5 (first at line 4)"),
    ("name: t\nhypotheses:\n  h:\n    a: full\n    a: lora\n", "duplicate key 'a' at line 5 (first at line 4)"),
    # fixed: two keys on one line (a flow mapping, as the shipped configs write schedules) were not compared
    ("name: t\nschedule_sweep:\n  full: {10: [1e-5], 10: [2e-5]}\n", "duplicate key 10 at line 3 (first at line 3)"),
    ("name: t\nvariants: [{a: {rows_per_step: 2}, a: {rows_per_step: 4}}]\n", "duplicate key 'a' at line 2"),
])
def test_a_key_twice_in_a_nested_section_is_refused_by_name_and_line(tmp_path, capsys, text, message):
    path = tmp_path / "suite.yaml"
    path.write_text(text)
    cli_refuses(["suite", "--config", str(path), "--output-dir", str(tmp_path / "suite"), "--dry-run"], capsys,
                message, tmp_path / "suite")


# ------------------------------------------------------------------------------------------ benchmarks/gpu_run.py
@pytest.mark.parametrize("extra, message", [
    (["--budget", "0"], "--budget must be a finite number > 0 seconds, got 0.0"),
    (["--budget", "-5"], "--budget must be a finite number > 0 seconds, got -5.0"),
    (["--budget", "nan"], "--budget must be a finite number > 0 seconds, got nan"),  # fixed: accepted
    (["--budget", "inf"], "--budget must be a finite number > 0 seconds, got inf"),  # fixed: accepted
    (["--budget", "ten"], "argument --budget: invalid float value: 'ten'"),
    (["--stages", "layer", "layer"], "--stages layer: given twice"),  # fixed: the stage ran twice into one file
    (["--stages", "magic"], "argument --stages: invalid choice: 'magic'"),
])
def test_gpu_runs_bad_options_are_refused_in_one_line(tmp_path, capsys, extra, message):
    out = tmp_path / "gpu"
    with pytest.raises(SystemExit) as exited:
        gpu_run.parse_args(["--out", str(out), "--dry-run", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and err[-1].startswith("gpu_run.py: error: ") and message in err[-1]
    assert not out.exists()


def test_gpu_runs_out_must_not_be_a_file(tmp_path, capsys):
    path = tmp_path / "results.md"
    path.write_text("kept\n")
    with pytest.raises(SystemExit) as exited:
        gpu_run.parse_args(["--out", str(path), "--dry-run"])
    assert exited.value.code == 2 and "must be a new or empty folder" in capsys.readouterr().err
    assert path.read_text() == "kept\n"


def test_gpu_runs_out_under_a_file_is_refused_before_mkdir(tmp_path, capsys):
    """fixed: accepted, then main's mkdir raised NotADirectoryError (a traceback)."""
    path = tmp_path / "results.md"
    path.write_text("kept\n")
    with pytest.raises(SystemExit) as exited:
        gpu_run.parse_args(["--out", str(path / "gpu"), "--dry-run"])
    assert exited.value.code == 2 and f"{str(path)!r} is a file, not a folder" in capsys.readouterr().err
    assert path.read_text() == "kept\n"


# ----------------------------------------------------------------------------- python -m smf.train.pretrain
def science_without(tmp_path, **changes) -> str:
    """The science preset's file with ``changes`` (None: the key removed)."""
    raw = yaml.safe_load((pretrain.CONFIGS / "suite_science.yaml").read_text())
    raw.update(changes)
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({key: value for key, value in raw.items() if value is not None}))
    return str(path)


@pytest.mark.parametrize("config, extra, message", [
    ("paper", [], "--config 'paper': no world and pretrain sections"),  # fixed: pretrained a default world's base
    ({"base_per_seed": None}, ["--seed", "3"], "--seed 3: suite.yaml has no base_per_seed"),  # fixed: ignored
    ({"world": [1]}, [], "world must be a mapping, got list"),  # fixed: a TypeError traceback
    ({}, ["--seed", "-1"], "world: option 'seed': input should be greater than or equal to 0, got -1"),
])
def test_pretrains_command_refuses_what_it_would_ignore(tmp_path, capsys, config, extra, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        pretrain.main(["--config", config if isinstance(config, str) else science_without(tmp_path, **config),
                       *extra, "--output-dir", str(out)])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and message in err
    assert not out.exists()
