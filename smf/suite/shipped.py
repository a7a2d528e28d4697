"""A suite's per-run results as one compact JSON file shipped in the repository (issue 58: every table on
docs/science.md recomputable without training), and the report drawn from it.

``smf report --suite-dir DIR --pack FILE`` writes the file: the recorded suite config (``suite_config.json``, without
the paths of the machine that ran it), the
hypotheses' registration record (``hypotheses_registered.json``, or null), each distinct environment once, and every
finished run's results record (:meth:`smf.suite.runner.SuiteRunner.run_one`) without its ``artefact`` (a local path),
its ``model`` written relative to the suite folder where the base lies inside it (``<suite>/bases/seed5/pretrain/final``,
as run hashes write it: :func:`portable_model`), and with its ``environment`` replaced by an index into the
environments (a few hundred bytes a run; a stream run's stages without their per-stage seconds, ``train_s`` and
``eval_s``, whose sums the run's ``timing`` keeps).
``smf report --results FILE --out DIR`` reads it back, checks every record as a suite directory's are checked
(:func:`smf.report.records.check_results_record`; the ``config_hash`` is kept but not recomputed: the world's files,
which it covers, lie in the directory the runs ran in) and writes the tables the records alone give
(:func:`smf.suite.report.write_result_tables`: Table 1, the sweep, matched learning with the hypotheses, the
environment, a stream's report) and ``report.md`` into DIR. The science diagnostics and locality reports need the
stages' files and are not drawn from it.
"""
from __future__ import annotations

import json
from pathlib import Path

from smf.errors import ConfigError
from smf.files import read_json_object, write_json_atomic
from smf.report.records import check_results_record
from smf.suite.config import SuiteConfig, seed_config, suite_config_from_dict
from smf.suite.fingerprints import IN_SUITE, in_suite
from smf.suite.plan import Run, SuiteLayout, plan_runs
from smf.suite.report import collect_results, load_suite_dir, write_report_page, write_result_tables

FORMAT = "smf-suite-results/1"
DROPPED = ("artefact",)  # where the run's model lay on the machine that ran it
STAGE_DROPPED = ("train_s", "eval_s")  # a stream stage's seconds (the run's timing holds their sums)


def pack_suite(suite_dir: str | Path) -> dict:
    """The packed results of the suite in ``suite_dir`` (the module docstring); ConfigError when a results file
    is refused or was written by other settings (a packed file holds what the report of the directory holds)."""
    layout = SuiteLayout(Path(suite_dir))
    config = load_suite_dir(suite_dir)
    results, refused, foreign = collect_results(layout, config)
    if refused or foreign:
        name, why = next(iter({**refused, **foreign}.items()))
        raise ConfigError(f"--pack: {len(refused) + len(foreign)} results file(s) of {suite_dir} cannot be packed "
                          f"(first: {name}: {why})")
    environments, runs = [], []
    for record in results:
        environment = record.get("environment")
        if environment not in environments:
            environments.append(environment)
        runs.append({**{key: value for key, value in record.items() if key not in DROPPED},
                     **({"model": portable_model(record, config)} if "model" in record else {}),
                     **({"stream": _compact_stream(record["stream"])} if record.get("stream") else {}),
                     "environment": environments.index(environment)})
    registered = read_json_object(layout.hypotheses_file, "hypotheses record") \
        if layout.hypotheses_file.is_file() else None
    return {"format": FORMAT, "suite": _portable(read_json_object(layout.config_file, "suite config record")),
            "registered": registered, "environments": environments, "runs": runs}


def portable_model(record: dict, config: SuiteConfig) -> str:
    """The ``model`` of the results ``record`` of a run of ``config``, relative to the suite folder where the base lies
    inside it (:func:`smf.suite.fingerprints.in_suite`), also where the record was written in the folder before it
    moved (or in another folder, and copied in): there its path ends as the run's planned base does; a hub id or a
    base outside the folder as it is."""
    root = Path(config.output_dir).absolute()
    planned = in_suite(seed_config(config, record["seed"]).model, root)
    inside = Path(planned.removeprefix(IN_SUITE + "/")).parts if planned.startswith(IN_SUITE + "/") else None
    recorded = in_suite(record["model"], root)
    if inside and Path(recorded).is_absolute() and Path(recorded).parts[-len(inside):] == inside:
        return planned
    return recorded


def _compact_stream(stream: dict) -> dict:
    """A results record's ``stream`` without each stage's :data:`STAGE_DROPPED` seconds."""
    return {**stream, "stages": [{key: value for key, value in stage.items() if key not in STAGE_DROPPED}
                                 for stage in stream["stages"]]}


def _portable(suite: dict) -> dict:
    """The recorded suite config ``suite`` without the paths of the machine that ran it: the output directory
    (set again by :func:`read_packed`) and, for a suite with a world, the data and model paths derived from it."""
    derived = ("output_dir", "data", "model") if suite.get("world") else ("output_dir",)
    return {key: value for key, value in suite.items() if key not in derived}


def write_packed(suite_dir: str | Path, path: str | Path) -> Path:
    """Write :func:`pack_suite` of ``suite_dir`` to ``path`` as compact JSON (one line, keys in the records'
    order); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(pack_suite(suite_dir), separators=(",", ":"), ensure_ascii=False) + "\n",
                    encoding="utf-8")
    return path


def read_packed(path: str | Path, out_dir: str | Path) -> tuple[SuiteConfig, list[dict], dict | None]:
    """(config, results, registration record) of the packed file ``path``, the config's output directory set to
    ``out_dir`` (where its report goes); ConfigError naming the file and the first wrong field or run."""
    packed = read_json_object(path, "packed suite results", ("format", "suite", "registered", "environments",
                                                              "runs"))
    if packed["format"] != FORMAT:
        raise ConfigError(f"{path}: field format must be {FORMAT!r}, got {packed['format']!r}")
    if not isinstance(packed["runs"], list) or not isinstance(packed["environments"], list):
        raise ConfigError(f"{path}: fields runs and environments must be lists")
    if not isinstance(packed["suite"], dict):
        raise ConfigError(f"{path}: field suite must be the recorded suite config, an object")
    config = suite_config_from_dict({**_portable(packed["suite"]), "output_dir": str(out_dir)})
    planned = {run.name: run for run in plan_runs(config)}
    results = []
    for index, record in enumerate(packed["runs"]):
        where = f"{path} (runs[{index}])"
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: a run must be a JSON object, got {type(record).__name__}")
        environment = record.get("environment")
        if not isinstance(environment, int) or isinstance(environment, bool) \
                or not 0 <= environment < len(packed["environments"]):
            raise ConfigError(f"{where}: field environment must be an index into environments "
                              f"(0 to {len(packed['environments']) - 1}), got {environment!r}")
        try:
            run = Run.of_results(record)
        except KeyError as missing:
            raise ConfigError(f"{where}: field {missing.args[0]} must be present, got nothing") from None
        if planned.get(run.name) != run:
            raise ConfigError(f"{where}: run {run.name} is not a run of the packed suite config")
        record = {**record, "environment": packed["environments"][environment]}
        check_results_record(where, record, run, config.eval.tasks)
        results.append(record)
    return config, results, packed["registered"]


def write_packed_report(path: str | Path, out_dir: str | Path) -> list[Path]:
    """The report of the packed file ``path`` in ``out_dir`` (the module docstring): the result tables, the
    registration record beside them (the hypotheses section reads it there) and ``report.md``; returns the paths."""
    out_dir = Path(out_dir)
    config, results, registered = read_packed(path, out_dir)
    if not results:
        raise ConfigError(f"{path} holds no run to report")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    if registered is not None:
        write_json_atomic(SuiteLayout(out_dir).hypotheses_file, registered)
        paths.append(SuiteLayout(out_dir).hypotheses_file)
    paths += write_result_tables(config, results, out_dir)
    return paths + [write_report_page(config, out_dir)]
