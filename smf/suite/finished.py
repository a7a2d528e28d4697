"""Whether a planned run of a suite is finished: the one rule that the runner (what it still runs), its dry run and
status file, and ``smf report`` (what it reads) share.

A run is done when its results file is a regular file holding a record of this configuration (its run hash, with
the paths inside the folder relative to it or, written before issue 57, absolute: :func:`smf.suite.fingerprints.run_hashes`)
that passes :func:`smf.report.records.check_results_record`; ``foreign`` when the file names another configuration's
hash (the runner refuses to overwrite it); ``damaged`` when it is unreadable, not a record, or lacks a field (a file
left half-written or edited: the runner computes the run again and replaces it); ``to do`` when there is none.
"""
from __future__ import annotations

from dataclasses import dataclass

from smf.errors import ConfigError
from smf.files import read_json_object
from smf.report.records import check_results_record
from smf.suite.config import SuiteConfig
from smf.suite.fingerprints import run_hashes
from smf.suite.plan import Run, SuiteLayout


@dataclass(frozen=True)
class RunState:
    """``state`` ("done", "foreign", "damaged" or "to do"), the record of a done run, and why for the others."""

    state: str
    record: dict | None = None
    why: str | None = None


def run_state(layout: SuiteLayout, config: SuiteConfig, run: Run) -> RunState:
    """The state of ``run`` of ``config`` in the suite folder of ``layout`` (see the module docstring)."""
    path = layout.results_path(run)
    if not path.exists() and not path.is_symlink():
        return RunState("to do")
    if not path.is_file():  # a directory, or a pipe (reading one would wait forever)
        return RunState("damaged", why=f"{path} is not a suite results file: not a regular file")
    try:
        record = read_json_object(path, "suite results file")
        recorded = record.get("config_hash")
        if isinstance(recorded, str) and recorded not in run_hashes(config, run):
            return RunState("foreign", why=f"{path} was written by a suite with other settings")
        check_results_record(path, record, run, config.eval.tasks)
    except ConfigError as err:
        return RunState("damaged", why=str(err))
    return RunState("done", record)
