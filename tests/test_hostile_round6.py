"""Issue 57's hostile pass over what round 6 built: suites stopped or moved, ``SMF_KERNELS_BACKEND``, flags of a
section a stage does not take, damaged results, one key in two spellings, options a base pretrained with memories
ignores, saves that wrote nothing and ``benchmarks/gpu_run.py``. Each case failed (a traceback, a wrong cause, a
silent success) before this pass."""
from pathlib import Path

import pytest

from smf.cli import main
from smf.model import save_tokenizer
from smf.tiny import tiny_tokenizer
from test_cli_smf import run_main


def cli_refuses(argv, capsys, message):
    """``smf argv`` ends with one line naming ``message``, exit 2."""
    code, err = run_main(argv, capsys)
    err = err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


# ------------------------------------------------------------------------------------ one key in two spellings
@pytest.mark.parametrize("name, text, message", [
    ("train.yaml", "output_dir: a\nlr: 0.1\noutput-dir: b\n",
     "duplicate key 'output-dir' at line 3 (first 'output_dir' at line 1)"),
    ("train.json", '{"output-dir": "a", "output_dir": "b"}', "duplicate key 'output_dir' (first 'output-dir'"),
])
def test_a_key_in_both_spellings_is_refused_by_name(tmp_path, capsys, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    cli_refuses(["train", "--config", str(path)], capsys, message)


def test_a_suite_key_in_both_spellings_is_refused_by_name_and_line(tmp_path, capsys):
    path = tmp_path / "suite.yaml"
    path.write_text("name: t\nworld:\n  n_old: 40\n  n-old: 41\n")
    cli_refuses(["suite", "--config", str(path), "--output-dir", str(tmp_path / "s"), "--dry-run"], capsys,
                "duplicate key 'n-old' at line 4 (first 'n_old' at line 3)")


# -------------------------------------------------------------------------------- saves that wrote nothing
def test_save_tokenizer_into_a_file_raises(tmp_path):
    path = tmp_path / "model"
    path.write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="it is a file, not a folder"):
        save_tokenizer(tiny_tokenizer(), path)


def test_save_tokenizer_whose_subfolder_is_a_file_raises(tmp_path):
    from smf.model import attach_memories
    from smf.tiny import TINY_MEMORY_KWARGS, tiny_model
    model = tiny_model()
    attach_memories(model, (2,), "additive", **TINY_MEMORY_KWARGS)
    model.save_pretrained(tmp_path)
    (tmp_path / "tokenizer").write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="tokenizer'.*it is a file"):
        save_tokenizer(tiny_tokenizer(), tmp_path)


# ------------------------------------------------------------------- SMF_KERNELS_BACKEND and flags of other stages
@pytest.mark.parametrize("argv", [["retrofit", "--preset", "tiny"], ["suite", "--config", "tiny"]])
def test_an_unknown_backend_in_the_environment_is_one_line(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.setenv("SMF_KERNELS_BACKEND", "bogus")
    cli_refuses([*argv, "--output-dir", str(tmp_path / "out")], capsys,
                "the environment variable SMF_KERNELS_BACKEND=bogus cannot run on cpu (--device cpu): unknown "
                "backend 'bogus'")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    (["retrofit", "--rule", "kl"], "--rule (smf retrofit does not take it: only smf train --recipe sparse uses it)"),
    (["background", "--lr", "1e-3"], "--lr (smf background does not take it: only smf retrofit and smf train use it)"),
    (["train", "--layers", "2"], "--layers (smf train does not take it: only smf retrofit uses it)"),
])
def test_a_flag_of_another_stage_is_named_with_the_stage_that_takes_it(capsys, argv, message):
    cli_refuses(argv, capsys, message)


# ------------------------------------------------------------------------- one rule for a finished result
def _tiny_suite(tmp_path):
    from smf.suite.config import load_suite_config
    from smf.suite.plan import SuiteLayout, plan_runs
    config = load_suite_config("tiny", {"output_dir": str(tmp_path / "suite")})
    layout = SuiteLayout(config.output_dir)
    layout.results_dir.mkdir(parents=True)
    return config, layout, plan_runs(config)[0]


def _whole_record(config, run) -> dict:
    from smf.suite.fingerprints import run_hash
    from smf.vocabulary import METRIC_OF_TASK
    return {"condition": run.condition, "seed": run.seed, "config_hash": run_hash(config, run),
            "metrics": {METRIC_OF_TASK[task]: 1.0 for task in config.eval.tasks},
            "timing": {"wall_s": 9.0, "eval_s": {task: 1.0 for task in config.eval.tasks}}}


@pytest.mark.parametrize("damage", ["{}", "no metrics", "[1, 2"])
def test_a_damaged_result_is_neither_done_nor_from_other_settings(tmp_path, capsys, damage):
    import json
    from smf.suite.report import collect_results
    from smf.suite.runner import SuiteRunner
    config, layout, run = _tiny_suite(tmp_path)
    record = _whole_record(config, run)
    layout.results_path(run).write_text(json.dumps(record))
    assert run not in SuiteRunner(config).pending()  # the baseline: a whole record is done
    record.pop("metrics")
    layout.results_path(run).write_text({"{}": "{}", "no metrics": json.dumps(record), "[1, 2": "[1, 2"}[damage])
    assert run in SuiteRunner(config).pending()  # computed again, as the report refuses it
    results, refused, foreign = collect_results(layout, config)
    assert run.name in refused and not foreign and not results
    code = main(["suite", "--config", "tiny", "--output-dir", str(config.output_dir), "--dry-run"])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(run.name + " "))
    assert code == 0 and "to do (its results file is damaged" in line and "other settings" not in line


# ------------------------------------------------------------ options a base pretrained with memories would ignore
def _science_suite(tmp_path, **overrides):
    from smf.suite.config import parse_suite_config
    raw = {"name": "h", "output_dir": str(tmp_path / "suite"), "seeds": [0], "device": "cpu",
           "conditions": ["base", "additive-tfidf", "lora"],
           "world": {"seed": 3, "n_old": 40, "n_new": 8, "bio_renders": 4, "heldout_people": 10, "n_retain": 40},
           "pretrain": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2,
                        "num_kv_heads": 1, "memory": {"layers": [1], "n_keys": 8, "heads": 2, "topk": 4, "key_dim": 8}},
           "train": {"n_keys": 8, "rows_per_step": 4, "global_batch_size": 2, "micro_batch_size": 2},
           "lr_sweep": {"sparse": [1e-2, 1e-1], "lora": [1e-3, 1e-2]}, **overrides}
    return parse_suite_config(raw, tmp_path)


def test_an_alpha_init_other_than_the_pretrained_one_is_refused(tmp_path):
    from smf.errors import ConfigError
    train = {"n_keys": 8, "rows_per_step": 4, "global_batch_size": 2, "micro_batch_size": 2}
    assert _science_suite(tmp_path, train={**train, "alpha_init": 1.0}).train["alpha_init"] == 1.0  # the same: kept
    with pytest.raises(ConfigError, match="train: option 'alpha_init' is 0.01 but pretrain.memory.alpha_init is 1.0"):
        _science_suite(tmp_path, train={**train, "alpha_init": 0.01})
    with pytest.raises(ConfigError, match="stages.retrofit: option 'alpha_init' is 0.5"):
        _science_suite(tmp_path, stages={"retrofit": {"alpha_init": 0.5}})


# ---------------------------------------------------------------------------------- a suite stopped or killed
WORKER_MODULE = '''
import os, sys, time
from pathlib import Path

def slow(path):
    Path(path + ".started").write_text(str(os.getpid()))
    time.sleep(6)
    Path(path + ".done").write_text("written after the suite stopped")

if __name__ == "__main__":
    from smf.suite.jobs import Task, run_tasks
    tasks = [Task((name,), str(Path(sys.argv[1]) / name)) for name in ("a", "b")]
    run_tasks(tasks, 2, slow, int, (), lambda task, result: None)
'''


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGHUP", "SIGINT", "SIGKILL"])
def test_a_stopped_suite_stops_its_workers(tmp_path, signum):
    """SIGTERM, SIGHUP, SIGINT to the main process end it and its workers at once; after SIGKILL (nothing runs in
    the main process) the workers see their parent gone and exit: no task writes after the stop."""
    import os
    import signal
    import subprocess
    import sys
    import time
    (tmp_path / "jobs_script.py").write_text(WORKER_MODULE)
    root = Path(__file__).resolve().parents[1]
    main_process = subprocess.Popen([sys.executable, str(tmp_path / "jobs_script.py"), str(tmp_path)], cwd=tmp_path,
                                    env={**os.environ, "PYTHONPATH": f"{root}:{tmp_path}"})
    started = [tmp_path / "a.started", tmp_path / "b.started"]
    deadline = time.monotonic() + 120
    while not all(path.is_file() and path.read_text() for path in started):
        assert main_process.poll() is None and time.monotonic() < deadline, "the workers never started"
        time.sleep(0.1)
    main_process.send_signal(getattr(signal, signum))
    code = main_process.wait(timeout=30)
    assert code == (-9 if signum == "SIGKILL" else 128 + getattr(signal, signum))
    workers = [int(path.read_text()) for path in started]
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in workers):
        assert time.monotonic() < deadline, "a worker outlived the suite"
        time.sleep(0.1)
    time.sleep(7)  # past the tasks' end: nothing was written
    assert not list(tmp_path.glob("*.done"))


def _state(pid: int) -> str:
    """The state word of process ``pid`` (``zombie``: ended, not yet reaped), or "" once it is gone."""
    try:
        return {"Z": "zombie"}.get(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0], "running")
    except OSError:
        return ""


# ----------------------------------------------------------------------------------------- a suite folder moved
def test_a_world_suites_run_hashes_do_not_depend_on_where_its_folder_is(tmp_path):
    """The world's files and the pretrained base lie inside the suite folder: they are hashed relative to it, so a
    folder copied elsewhere keeps its finished runs; a record hashed with absolute paths (written before) is still
    done in place."""
    import json
    from smf.suite.finished import run_state
    from smf.suite.fingerprints import options_fingerprint, run_hash, stage_fingerprints
    from smf.suite.plan import SuiteLayout, plan_runs
    here, there = _science_suite(tmp_path / "a"), _science_suite(tmp_path / "b")
    for run in plan_runs(here):
        assert run_hash(here, run) == run_hash(there, run)
        assert run_hash(here, run, relative=False) != run_hash(there, run, relative=False)  # what moved before
    options = [{"model": str(config.output_dir / "pretrain" / "final"), "lr": 1e-3, "data_seed": 0,
                "train_data": str(config.output_dir / "world" / "train.jsonl")} for config in (here, there)]
    assert stage_fingerprints(options[0], here.output_dir)[0] == stage_fingerprints(options[1], there.output_dir)[0]
    assert stage_fingerprints(options[0], here.output_dir)[1] != stage_fingerprints(options[1], there.output_dir)[1]
    outside = {"model": "Qwen/Qwen2-0.5B", "lr": 1e-3, "train_data": "/data/medmcqa.jsonl"}  # unchanged
    assert stage_fingerprints(outside, here.output_dir) == (options_fingerprint(outside),) * 2
    layout = SuiteLayout(here.output_dir)
    layout.results_dir.mkdir(parents=True)
    base = plan_runs(here)[0]
    record = {**_whole_record(here, base), "config_hash": run_hash(here, base, relative=False)}
    layout.results_path(base).write_text(json.dumps(record))
    assert run_state(layout, here, base).state == "done", run_state(layout, here, base).why


def test_a_world_suite_moved_elsewhere_keeps_its_finished_runs(tmp_path, monkeypatch, caplog):
    """A small world suite (its world and pretrained base inside the folder) run, then moved: the same config on
    the new folder finds every run and stage finished (nothing trains or evaluates again), keeps the recorded plan,
    and its report reads every run."""
    import json
    import shutil
    import yaml
    from smf.suite import runner as runner_module
    from smf.suite.runner import SuiteRunner
    raw = {"name": "mv", "seeds": [0], "device": "cpu", "conditions": ["base", "lora"],
           "world": {"seed": 3, "n_old": 40, "n_new": 8, "bio_renders": 4, "heldout_people": 10, "n_retain": 40},
           "pretrain": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2,
                        "num_kv_heads": 1, "epochs": 1},
           "train": {"global_batch_size": 8, "micro_batch_size": 8}, "stages": {"lora": {"epochs": 1}},
           "lr_sweep": {"lora": [1e-3]}}
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(raw))
    first, moved = tmp_path / "first", tmp_path / "elsewhere" / "moved"
    assert main(["--log-level", "WARNING", "suite", "--config", str(tmp_path / "suite.yaml"), "--output-dir",
                 str(first), "--no-report"]) == 0
    results = sorted(path.name for path in (first / "results").glob("*.json"))
    assert len(results) == 2
    moved.parent.mkdir()
    shutil.move(first, moved)

    def forbidden(*args, **kwargs):
        raise AssertionError("a finished run of the moved folder ran again")
    monkeypatch.setattr(runner_module, "train", forbidden)
    monkeypatch.setattr(SuiteRunner, "evaluate", forbidden)
    caplog.set_level("INFO")
    assert main(["suite", "--config", str(tmp_path / "suite.yaml"), "--output-dir", str(moved)]) == 0
    assert json.loads((moved / "suite_config.json").read_text())["conditions"] == ["base", "lora"]
    status = json.loads((moved / "suite_status.json").read_text())
    assert [row["status"] for row in status] == ["done", "done"]
    from smf.suite.plan import SuiteLayout
    from smf.suite.report import collect_results, load_suite_dir
    found, refused, foreign = collect_results(SuiteLayout(moved), load_suite_dir(moved))
    assert len(found) == 2 and not refused and not foreign
    assert "report of 2 runs" in caplog.text and "other settings" not in caplog.text


# ---------------------------------------------------------------------------------------- benchmarks/gpu_run.py
def _gpu_run():
    import sys
    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import gpu_run
    return gpu_run


def test_a_failure_by_design_is_expected_and_leaves_exit_status_0(tmp_path, monkeypatch):
    """The authors' layer in bf16 fails on CUDA by design (ATen's embedding_bag backward): recorded as expected, the
    run exits 0; any other failure of that item, or of another, still exits 1."""
    import sys
    gpu_run = _gpu_run()
    reason = {"expected": "RuntimeError: \"_embedding_bag_per_sample_weights_backward_cuda\" not implemented for "
                          "'BFloat16'", "other": "RuntimeError: CUDA out of memory"}
    for case, code in (("expected", 0), ("other", 1)):
        line = {"item": "authors/bf16", "event": "failed", "reason": reason[case]}

        def worker_command(stage, dry_run, jsonl, line=line):
            script = f"import json; open({str(jsonl)!r}, 'a').write(json.dumps({line!r}) + '\\n')"
            return ["authors/bf16"], lambda left: [sys.executable, "-c", script]
        monkeypatch.setattr(gpu_run, "worker_command", worker_command)
        out = tmp_path / case
        assert gpu_run.main(["--out", str(out), "--dry-run", "--stages", "layer"]) == code
        summary = (out / "summary.md").read_text()
        assert ("failed as expected (by design: ATen has no bf16" in summary) == (case == "expected")


def test_gpu_runs_out_where_nothing_can_be_written_is_one_line(capsys):
    gpu_run = _gpu_run()
    with pytest.raises(SystemExit) as exited:
        gpu_run.parse_args(["--out", "/proc/gpu_run_out", "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and err[-1] == ("gpu_run.py: error: --out '/proc/gpu_run_out': cannot write there "
                                                  "(No such file or directory)")


def test_ext_tests_run_file_by_file_in_the_budget_left(tmp_path, monkeypatch):
    """A file that outlasts the time left costs itself and the files after it, each named; the files before it keep
    their outcome."""
    gpu_run = _gpu_run()
    for name, body in (("test_quick.py", "def test_a():\n    pass\n"),
                       ("test_slow.py", "import time\n\ndef test_b():\n    time.sleep(60)\n"),
                       ("test_late.py", "def test_c():\n    pass\n")):
        (tmp_path / name).write_text(body)
    monkeypatch.setattr(gpu_run, "EXT_TESTS", tuple(str(tmp_path / name)
                                                   for name in ("test_quick.py", "test_slow.py", "test_late.py")))
    with pytest.raises(gpu_run.StageFailed) as failed:
        gpu_run.ext_tests(gpu_run.child_env(False), 25, tmp_path / "log", dry_run=False)
    files = failed.value.result["files"]
    assert "1 passed" in files[str(tmp_path / "test_quick.py")]
    assert files[str(tmp_path / "test_slow.py")].startswith("timed out after")
    assert files[str(tmp_path / "test_late.py")] == "not run: the run's --budget ran out"
    assert str(failed.value) == (f"2 of 3 test files did not pass: {tmp_path / 'test_slow.py'}, "
                                 f"{tmp_path / 'test_late.py'}")


@pytest.mark.parametrize("versions, expected", [({"triton": "3.6.0", "numpy": "2.4.6"}, True),
                                                ({"triton": "3.7.1", "numpy": "2.4.6"}, False),
                                                ({"triton": "3.6.0", "numpy": "2.3.5"}, False)])
def test_a_dry_run_runs_the_interpreted_items_and_expects_only_the_interpreter_bug(tmp_path, monkeypatch, versions,
                                                                                    expected):
    """Triton 3.6's interpreter raises under numpy >= 2.4 in a kernel looping over a runtime integer, not in every
    kernel (the lookup runs on the stock image's stack): a dry run runs every Triton item, counts a failure with that
    error as expected (exit 0) only under those versions, and any other failure, a Triton item's too, as a failure."""
    import importlib.metadata
    import json
    import sys
    gpu_run = _gpu_run()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions[name])
    assert (gpu_run.interpreter_bug() is not None) == expected
    bug = f"InterpreterError: TypeError('{gpu_run.INTERPRETER_BUG}')"
    outcomes = {"triton/fp32": None, "triton/bf16": bug, "torch/bf16": bug, "torch/fp32": None}

    def worker_command(stage, dry_run, jsonl):
        script = ("import json, sys; outcomes = json.loads(sys.argv[2]); [open(sys.argv[1], 'a').write(json.dumps("
                  "{'item': item, 'event': 'failed', 'reason': outcomes[item]} if outcomes[item] else "
                  "{'item': item, 'event': 'done', 'result': dict(zip(('backend', 'dtype'), item.split('/')), "
                  "tokens=6, step_ms=1.0, kernel_ms=1.0, launches=1, profiler_failed=None, check=None)}) + '\\n') "
                  "for item in sys.argv[3:]]")
        return list(outcomes), lambda left: [sys.executable, "-c", script, str(jsonl), json.dumps(outcomes), *left]
    monkeypatch.setattr(gpu_run, "worker_command", worker_command)
    out = tmp_path / "out"
    status = gpu_run.main(["--out", str(out), "--dry-run", "--stages", "layer"])
    from guarded import final_rows
    rows = final_rows(out / "layer.jsonl")
    assert list(rows) == list(outcomes)  # each item once, in the order it finished
    assert rows["triton/fp32"]["event"] == "done"  # run and checked, not skipped
    assert (rows["triton/bf16"].get("expected") is not None) == expected and rows["triton/bf16"]["reason"] == bug
    assert "expected" not in rows["torch/bf16"]  # not a Triton item: the same error counts
    assert status == 1  # torch/bf16's failure
    outcomes["torch/bf16"] = None
    assert gpu_run.main(["--out", str(tmp_path / "again"), "--dry-run", "--stages", "layer"]) == (0 if expected else 1)


def test_a_cuda_home_without_headers_builds_the_cpu_extension(tmp_path, monkeypatch, caplog):
    """torch guesses CUDA_HOME from an nvcc on the PATH, a wrapper without the toolkit too: no cuda_runtime.h
    there, the extension builds its CPU kernels, with a warning, instead of failing to compile."""
    import torch
    from torch.utils import cpp_extension
    from smf_kernels import build_ext
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))
    (extension,) = build_ext.setup_extensions()
    assert not any(source.endswith(".cu") for source in extension.sources)
    assert "holds no include/cuda_runtime.h" in caplog.text
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda_runtime.h").write_text("")
    (extension,) = build_ext.setup_extensions()
    assert any(source.endswith(".cu") for source in extension.sources)
