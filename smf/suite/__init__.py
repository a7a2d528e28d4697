"""The experiment suite: Table 1 of the paper (base + eight trained conditions x seeds), resumable.

``config`` (the suite YAML schema), ``plan`` (runs, stages, directory layout), ``runner`` (train,
evaluate, record, skip finished runs), ``status`` (done / failed / pending runs) and ``commands``
(``smf suite``). What a suite directory reports is :mod:`smf.report.suite_dir`; the evaluation of one
model is :mod:`smf.eval.tasks`. Names are imported from their modules on first use (:mod:`smf._lazy`).
"""
import warnings

from smf._lazy import lazy_exports

_EXPORTS = {"EvalSettings": "config", "SuiteConfig": "config", "load_suite_config": "config",
            "SuiteRunner": "runner", "run_suite": "runner"}
_exported, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name == "write_suite_report":  # moved to smf.report with the rest of the report
        warnings.warn("smf.suite.write_suite_report is deprecated; use smf.report.suite_dir.write_suite_report",
                      DeprecationWarning, stacklevel=2)
        from smf.report.suite_dir import write_suite_report

        return write_suite_report
    return _exported(name)
