"""The experiment suite: Table 1 of the paper (base + eight trained conditions x seeds), resumable.

``config`` (the suite YAML schema), ``plan`` (runs, stages, directory layout), ``fingerprints``
(whether what a suite directory holds came from a config), ``runner`` (train, evaluate, record, skip finished
runs), ``status`` (done / failed / pending runs) and ``report`` (what a suite directory reports, from
:mod:`smf.report`'s tables and figures); ``smf suite`` is :mod:`smf.commands.suite`. The evaluation of one model is
:mod:`smf.eval.tasks`. Names are imported from their modules on first use
(:mod:`smf._lazy`).
"""
from smf._lazy import lazy_exports

_EXPORTS = {"EvalSettings": "config", "SuiteConfig": "config", "load_suite_config": "config",
            "SuiteRunner": "runner", "run_suite": "runner", "write_suite_report": "report"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
