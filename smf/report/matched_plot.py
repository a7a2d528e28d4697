"""The matched-learning answer as a figure (``matched_learning.png``, beside ``matched_learning.md``): left, the old
knowledge each method keeps at each learning level (mean ± 95% interval over the seeds that measured it); right, the
difference to full finetuning paired by seed, with zero marked. One line per method, offset a little along x so that
intervals do not hide one another; a level no seed of a method measured is left out of its line, one that only some
seeds measured is a hollow marker without an interval (its mean is over those seeds)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from smf.report.pareto import BASELINE_MARKERS, FAMILY_COLOURS, RULE_MARKERS  # noqa: E402
from smf.report.paper_results import FAMILIES, SELECTION_RULES  # noqa: E402


def plot_matched(rows: list[dict], levels: list[str], labels: dict[tuple, str], out_path: Path, *, learn_title: str,
                 kept_title: str) -> Path:
    """``rows``: :func:`smf.report.matched_learning.matched_learning` rows; ``labels``: method key -> legend label.
    Returns the PNG path."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    spread = 0.5 / max(len(rows), 1)
    variants = sorted({tuple(row["method"])[3:] for row in rows}, key=str)
    for index, row in enumerate(rows):
        method = tuple(row["method"])
        condition = method[0]
        colour = FAMILY_COLOURS.get(FAMILIES.get(condition, "Base"), "#000")
        if len(variants) > 1:
            colour = plt.get_cmap("tab20")(variants.index(method[3:]) % 20)
        rule = SELECTION_RULES.get(condition)
        marker = RULE_MARKERS[rule] if rule else BASELINE_MARKERS.get(condition, "s")
        offset = (index - (len(rows) - 1) / 2) * spread
        seeds = len(row["seeds"])
        for axis, key in ((left, None), (right, "vs_reference")):
            points = [(position + offset, cell if key is None else cell.get(key))
                      for position, cell in enumerate(row["levels"][level] for level in levels)]
            points = [(x, cell) for x, cell in points if cell and cell.get("mean") is not None]
            if not points:
                continue
            axis.plot([x for x, _ in points], [cell["mean"] for _, cell in points], color=colour, linewidth=1.2,
                      alpha=0.9, marker=marker, markersize=6, label=labels[method] if axis is left else None)
            whole = [(x, cell) for x, cell in points if cell.get("measured", cell.get("pairs")) == seeds]
            axis.errorbar([x for x, _ in whole], [cell["mean"] for _, cell in whole],
                          yerr=[cell["half_width"] or 0.0 for _, cell in whole], color=colour, linestyle="",
                          capsize=3, alpha=0.9)
            part = [(x, cell) for x, cell in points if cell.get("measured", cell.get("pairs")) != seeds]
            axis.plot([x for x, _ in part], [cell["mean"] for _, cell in part], linestyle="", marker=marker,
                      markersize=9, markerfacecolor="white", markeredgecolor=colour)
    for axis, title in ((left, f"{kept_title} kept"), (right, f"{kept_title} kept − full finetuning (paired by seed)")):
        axis.set_xticks(range(len(levels)), [f"{learn_title} = {level}" for level in levels])
        axis.set_ylabel(title)
        axis.grid(alpha=0.3)
    right.axhline(0.0, color="black", linewidth=0.8)
    left.set_ylim(-0.05, 1.05)
    low, high = right.get_ylim()
    right.set_ylim(max(low, -1.05), min(high, 1.05))
    left.legend(fontsize=7, loc="lower left")
    figure.suptitle("Forgetting at matched learning (mean ± 95% interval over seeds; each seed's own sweep "
                    "interpolated; hollow: not every seed reached the level)")
    figure.tight_layout()
    out_path = Path(out_path)
    figure.savefig(out_path, dpi=130)
    plt.close(figure)
    return out_path
