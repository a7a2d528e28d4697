"""The learning-rate sweep as a frontier figure: every (method, rate) mean point, learning (y) against each forgetting
metric (x), each method's rates joined by a line, 95% intervals as error bars; the base model as a square. With a
suite's ``variants``, each variant of a condition is a method of its own, coloured apart.
Written by the suite report beside ``lr_sweep.md`` as ``pareto_sweep.png`` (docs/science.md)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from smf.report.paper_results import HIGHER_IS_BETTER, display_name, metric_title  # noqa: E402
from smf.report.pareto import FAMILY_COLOURS  # noqa: E402
from smf.report.paper_results import FAMILIES  # noqa: E402

LINE_STYLES = {"kl": "-", "tfidf": "--"}


def plot_sweep(rows: list[dict], base: dict | None, out_path: Path, *, learning: str, forgetting: list[str],
               model: str | None = None, labels: dict | None = None) -> Path:
    """``rows``: :func:`smf.suite.science.sweep_rows` rows (one variant each, rates in any order); ``base``: the base
    model's (mean, half-width) per metric, or None. One panel per metric of ``forgetting``. Returns the PNG path."""
    figure, axes = plt.subplots(1, len(forgetting), figsize=(6.5 * len(forgetting) + 3, 5), squeeze=False)
    groups: dict[str, list[dict]] = {}
    for row in rows:
        name = display_name(row["condition"], model, row.get("variant")) + (
            "" if row.get("reads", "all") == "all" else f" ({row['reads']} reads)")
        groups.setdefault(name, []).append(row)
    variants = list(dict.fromkeys(row["variant"] for row in rows if row.get("variant")))
    variant_colours = plt.get_cmap("tab20")
    for axis, metric in zip(axes[0], forgetting):
        for name, points in groups.items():
            points = sorted(points, key=lambda row: row["lr"])
            condition = points[0]["condition"]
            family = FAMILIES.get(condition, "Base")
            style = LINE_STYLES.get(condition.rsplit("-", 1)[-1], "-")
            if points[0].get("reads", "all") != "all":
                style = ":"
            xs = [p["metrics"][metric][0] for p in points]
            ys = [p["metrics"][learning][0] for p in points]
            colour = FAMILY_COLOURS.get(family, "#000") if not points[0].get("variant") else \
                variant_colours(variants.index(points[0]["variant"]) % variant_colours.N)
            axis.errorbar(xs, ys, xerr=[p["metrics"][metric][1] for p in points],
                          yerr=[p["metrics"][learning][1] for p in points], color=colour,
                          linestyle=style, marker="o", markersize=4, capsize=2, label=name, alpha=0.85)
            for x, y, point in zip(xs, ys, points):
                axis.annotate(f"{point['lr']:g}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6)
        if base is not None:
            axis.plot(base[metric][0], base[learning][0], "s", color=FAMILY_COLOURS["Base"], markersize=8,
                      label=display_name("base", model))
        axis.set_xlabel(metric_title(metric, labels) + (" (→ better)" if HIGHER_IS_BETTER[metric] else " (← better)"))
        axis.set_ylabel(metric_title(learning, labels) + " (↑ better)")
        if not HIGHER_IS_BETTER[metric]:
            axis.set_xscale("log")
        axis.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    figure.suptitle("Learning-rate sweep: every rate of every method (mean ± 95% interval over seeds; rates labelled)")
    figure.tight_layout()
    out_path = Path(out_path)
    figure.savefig(out_path, dpi=130)
    plt.close(figure)
    return out_path
