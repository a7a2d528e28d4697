"""``smf suite --jobs N`` (smf.suite.jobs): the tasks and their dependencies (each shared retrofit and background
stage once, before the runs that need it), and a reduced tiny suite with a schedule sweep run in two worker
processes giving results files equal to one process's, byte for byte but for their timing and CPU fields (and the
directory they name); a second call finds everything done."""
import json
import math
from pathlib import Path

import yaml

from smf.suite.config import load_suite_config
from smf.suite.jobs import Task, run_tasks
from smf.suite.plan import plan_runs
from smf.suite.runner import SuiteRunner, run_suite
from test_suite_run import _config_file

SCHEDULES = {"sparse": {1: [2e-2], 2: [2e-2]}, "full": {1: [1e-3], 2: [1e-3]}}


def _suite(root: Path, conditions=("base", "additive-kl", "additive-tfidf", "full")):
    root.mkdir(parents=True, exist_ok=True)
    path = _config_file(root, root / "suite", list(conditions))
    raw = yaml.safe_load(path.read_text())
    raw.update(authors_update=[], schedule_sweep=SCHEDULES)
    path.write_text(yaml.safe_dump(raw))
    return load_suite_config(str(path))


def _comparable(path: Path, root: Path) -> str:
    record = json.loads(path.read_text().replace(str(root), "ROOT"))
    record.pop("timing")
    record.pop("finished_at")
    return json.dumps(record, indent=2)


def test_tasks_share_each_stage_and_wait_for_it(tmp_path):
    config = _suite(tmp_path)
    tasks = SuiteRunner(config).tasks(plan_runs(config))
    keys = [task.key for task in tasks]
    stages = [key for key in keys if key[0] != "run"]
    assert [kind for kind, _ in stages] == ["retrofit", "background"]  # one additive retrofit for both rules
    assert keys.index(stages[0]) < keys.index(stages[1]) < keys.index(("run", "additive-kl-lr0.02-seed0"))
    by_run = {task.run: task for task in tasks if task.run}
    assert by_run["additive-tfidf-ep2-lr0.02-seed0"].needs == (stages[1],)
    assert by_run["full-ep2-lr0.001-seed0"].needs == () and by_run["base-seed0"].needs == ()
    assert tasks[keys.index(stages[1])].needs == (stages[0],)


def test_a_failing_task_stops_what_needs_it():
    """Workers of the standard library only (math.sqrt; int as the initializer): no torch to import."""
    tasks = [Task(("a",), 4.0), Task(("b",), -1.0), Task(("c",), 9.0, needs=(("b",),), run="c"), Task(("d",), 16.0)]
    finished = {}
    failure = run_tasks(tasks, 2, math.sqrt, int, (), lambda task, result: finished.update({task.key: result}))
    assert failure[0].key == ("b",) and isinstance(failure[1], ValueError)
    assert ("c",) not in finished and finished.get(("a",)) == 2.0


def test_two_processes_give_the_results_of_one(tmp_path):
    conditions = ("base", "additive-tfidf", "full")
    one, two = _suite(tmp_path / "one", conditions), _suite(tmp_path / "two", conditions)
    run_suite(one)
    run_suite(two, jobs=2)
    names = sorted(path.name for path in (one.output_dir / "results").glob("*.json"))
    assert names == sorted(path.name for path in (two.output_dir / "results").glob("*.json")) and len(names) == 5
    for name in names:
        assert _comparable(one.output_dir / "results" / name, tmp_path / "one") == \
            _comparable(two.output_dir / "results" / name, tmp_path / "two"), name
    record, shorter = (json.loads((two.output_dir / "results" / f"additive-tfidf{ep}-lr0.02-seed0.json").read_text())
                       for ep in ("-ep2", ""))
    assert record["epochs"] == 2 and "epochs" not in shorter  # 1 epoch: the stage's configured schedule
    assert record["cost"]["steps"] == 2 * shorter["cost"]["steps"] > 0
    assert record["cost"]["flops"] > shorter["cost"]["flops"] > 0
    assert record["timing"]["cpu_s"] > 0 and record["sparse_steps"]["row_change"] > 0
    assert record["sparse_steps"]["row_change_vs_start"] > 0
    assert len(run_suite(two, jobs=2)) == 5  # resumable: nothing left to do, every result read back
