"""Confidence intervals for Table 1: a summary's spread replaced by the half-width of the 95% Student-t interval of
the mean over seeds (the science preset reports these; docs/science.md)."""
from __future__ import annotations

import math

from smf.report.table import Summary


# The 0.975 quantile of Student's t by degrees of freedom (standard tables).
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}


def t_quantile(seeds: int) -> float:
    """The 0.975 quantile of Student's t with ``seeds - 1`` degrees of freedom (``seeds`` >= 2); between the
    tabulated degrees of freedom, the next lower one's (a slightly wider interval)."""
    if seeds < 2:
        raise ValueError(f"an interval needs at least 2 seeds, got {seeds}")
    return T_975[max(df for df in T_975 if df <= seeds - 1)]


def with_intervals(summaries: list[Summary], records: list[dict]) -> list[Summary]:
    """``summaries`` (of :func:`smf.report.table.summarize` over ``records``) with each std replaced by the 95%
    interval's half-width, t(n-1) * std / sqrt(n) over the n seeds that measured the metric (None for one seed)."""
    result = []
    for summary in summaries:
        stats = {}
        for metric, cell in summary.stats.items():
            n = sum(1 for r in records if (r["condition"], r.get("variant")) == (summary.condition, summary.variant)
                    and r.get(metric) is not None)
            stats[metric] = None if cell is None else (
                cell[0], t_quantile(n) * cell[1] / math.sqrt(n) if n > 1 else None)
        result.append(Summary(summary.condition, summary.n_seeds, stats, summary.variant))
    return result
