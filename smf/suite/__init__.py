"""The experiment suite: Table 1 of the paper (base + eight trained conditions x seeds), resumable.

``config`` (the suite YAML schema), ``plan`` (runs, stages, directory layout), ``runner`` (train,
evaluate, record, skip finished runs), ``evaluate`` (the three probes on one model), ``report``
(Table 1, figure, accounting, status) and ``commands`` (``smf suite``, ``smf report``, ``smf eval``).
"""
from smf.suite.config import EvalSettings, SuiteConfig, load_suite_config
from smf.suite.report import write_suite_report
from smf.suite.runner import SuiteRunner, run_suite

__all__ = ["EvalSettings", "SuiteConfig", "SuiteRunner", "load_suite_config", "run_suite", "write_suite_report"]
