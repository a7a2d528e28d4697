"""Results report: Table 1 (Markdown / CSV / LaTeX), the Pareto figure, parameter accounting; a suite
directory's whole report (:mod:`smf.report.suite_dir`) and ``smf report`` (:mod:`smf.report.command`)."""
from smf.report.accounting import AccountingRow, accounting_markdown, parameter_accounting, paper_qwen_config
from smf.report.paper_results import DISPLAY_NAMES, PAPER_MODEL_ID, PAPER_TABLE1
from smf.report.pareto import pareto_front, plot_pareto
from smf.report.table import Summary, paper_summaries, summarize, to_csv, to_latex, to_markdown
from smf.report.write import write_report
from smf.vocabulary import CONDITIONS

__all__ = [
    "AccountingRow", "CONDITIONS", "DISPLAY_NAMES", "PAPER_MODEL_ID", "PAPER_TABLE1", "Summary",
    "accounting_markdown", "paper_qwen_config", "paper_summaries", "parameter_accounting", "pareto_front",
    "plot_pareto", "summarize", "to_csv", "to_latex", "to_markdown", "write_report",
]
