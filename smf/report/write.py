"""Write the whole results report (Table 1 in three formats and the Pareto figure) to a folder."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from smf.report.intervals import with_intervals
from smf.report.pareto import plot_pareto
from smf.report.table import summarize, to_csv, to_latex, to_markdown


def write_report(records: Sequence[dict], out_dir: str | Path, *, include_paper: bool = False,
                 model: str | None = None, labels: dict[str, str] | None = None,
                 intervals: bool = False) -> list[Path]:
    """From per-run records (see :mod:`smf.report.table`) write ``table1.md``, ``table1.csv``,
    ``table1.tex``, ``pareto.png`` and ``pareto.pdf`` into ``out_dir``; returns the paths.

    ``include_paper``: put the paper's numbers beside ours (only meaningful on the paper's model);
    ``model``: the model the runs used, naming the base row; ``labels``: metric key -> column and axis title;
    ``intervals``: ± and the error bars are 95% intervals of the mean (:mod:`smf.report.intervals`), not the std.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = summarize(records)
    if not summaries:
        raise ValueError("records must hold at least one run")
    if intervals:
        summaries = with_intervals(summaries, records)
    paths = []
    for name, render in (("table1.md", to_markdown), ("table1.csv", to_csv), ("table1.tex", to_latex)):
        path = out_dir / name
        path.write_text(render(summaries, include_paper=include_paper, model=model, labels=labels), encoding="utf-8")
        paths.append(path)
    return paths + plot_pareto(summaries, out_dir / "pareto", model=model, labels=labels)
