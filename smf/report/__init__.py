"""Results report: Table 1 (Markdown / CSV / LaTeX), the Pareto figure, the sweep and matched-learning tables,
parameter accounting, the check of a results record. A suite directory's whole report is :mod:`smf.suite.report`
(it reads the suite's plan) and ``smf report`` is :mod:`smf.commands.report`. Names are imported from their modules
on first use (:mod:`smf._lazy`)."""
from smf._lazy import lazy_exports
from smf.vocabulary import CONDITIONS

_EXPORTS = {
    **dict.fromkeys(("AccountingRow", "accounting_markdown", "parameter_accounting"), "accounting"),
    **dict.fromkeys(("DISPLAY_NAMES", "PAPER_MODEL_ID", "PAPER_TABLE1"), "paper_results"),
    **dict.fromkeys(("pareto_front", "plot_pareto"), "pareto"),
    **dict.fromkeys(("Summary", "paper_summaries", "summarize", "to_csv", "to_latex", "to_markdown"), "table"),
    "write_report": "write",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted({"CONDITIONS", *_EXPORTS})
