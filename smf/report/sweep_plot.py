"""The learning-rate sweep as a frontier figure: every (method, rate) mean point, learning (y) against each forgetting
metric (x), each method's rates joined by a line, 95% intervals as light error bars; the base model as a square.
With a suite's ``variants``, each variant of a condition is a method of its own, coloured apart.
Written by the suite report beside ``lr_sweep.md`` as ``pareto_sweep.png`` (docs/science.md).

Colour = method family (as in the Pareto figure); marker = selection rule (circle KL, triangle TF-IDF) or baseline
(diamond LoRA, plus full finetuning); line = solid, or dotted for a ``count_reads: loss`` variant, whose markers are
hollow. Each point's rate is written beside it at the first of eight spots that crosses no other rate label and no
marker; a rate with no free spot is left out (the table in ``lr_sweep.md`` has every one)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402

from smf.report.paper_results import FAMILIES, HIGHER_IS_BETTER, display_name, metric_title  # noqa: E402
from smf.report.pareto import BASELINE_MARKERS, FAMILY_COLOURS  # noqa: E402

RULE_MARKERS = {"kl": "o", "tfidf": "^"}  # the Pareto figure's markers, by the condition's suffix
# Where a rate label may go, in points from its marker, with its alignment: right, above, left, below, diagonals.
LABEL_SPOTS = (((5, 2), "left", "bottom"), ((0, 6), "center", "bottom"), ((-5, 2), "right", "bottom"),
               ((0, -6), "center", "top"), ((5, -2), "left", "top"), ((-5, -2), "right", "top"),
               ((6, 6), "left", "bottom"), ((-6, -6), "right", "top"))
MARKER_PIXELS = 9  # the square around a marker that labels avoid


def _marker(condition: str) -> str:
    return BASELINE_MARKERS.get(condition) or RULE_MARKERS.get(condition.rsplit("-", 1)[-1], "o")


def _place_rate_labels(figure, axis, points: list[tuple[float, float, str]]) -> None:
    """Write each (x, y, text) beside its point at the first of :data:`LABEL_SPOTS` whose box crosses no
    marker and no label placed before; drop it when every spot is taken."""
    renderer = figure.canvas.get_renderer()
    centres = [axis.transData.transform((x, y)) for x, y, _ in points]
    half = MARKER_PIXELS / 2
    taken = [Bbox.from_bounds(px - half, py - half, MARKER_PIXELS, MARKER_PIXELS) for px, py in centres]
    frame = axis.get_window_extent(renderer)
    for x, y, text in points:
        label = axis.annotate(text, (x, y), textcoords="offset points", xytext=LABEL_SPOTS[0][0], fontsize=6,
                              zorder=4)
        for offset, ha, va in LABEL_SPOTS:
            label.xyann = offset
            label.set_ha(ha)
            label.set_va(va)
            box = label.get_window_extent(renderer)
            if frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1) and \
                    not any(box.overlaps(other) for other in taken):
                taken.append(box.padded(1))
                break
        else:
            label.remove()


def plot_sweep(rows: list[dict], base: dict | None, out_path: Path, *, learning: str, forgetting: list[str],
               model: str | None = None, labels: dict | None = None) -> Path:
    """``rows``: :func:`smf.suite.science.sweep_rows` rows (one variant each, rates in any order); ``base``: the base
    model's (mean, half-width) per metric, or None. One panel per metric of ``forgetting``. Returns the PNG path."""
    figure, axes = plt.subplots(1, len(forgetting), figsize=(7 * len(forgetting) + 3, 6), squeeze=False)
    groups: dict[str, list[dict]] = {}
    for row in rows:
        name = display_name(row["condition"], model, row.get("variant")) + (
            "" if row.get("reads", "all") == "all" else f" ({row['reads']} reads)")
        name += f", {row['epochs']} epochs" if row.get("epochs") else ""  # one line per schedule
        groups.setdefault(name, []).append(row)
    variants = list(dict.fromkeys(row["variant"] for row in rows if row.get("variant")))
    variant_colours = plt.get_cmap("tab20")
    rate_labels = {}
    for axis, metric in zip(axes[0], forgetting):
        rate_labels[axis] = []
        for name, points in groups.items():
            points = sorted(points, key=lambda row: row["lr"])
            condition = points[0]["condition"]
            colour = FAMILY_COLOURS.get(FAMILIES.get(condition, "Base"), "#000")
            variant = points[0].get("reads", "all") != "all"
            xs = [p["metrics"][metric][0] for p in points]
            ys = [p["metrics"][learning][0] for p in points]
            if points[0].get("variant"):
                colour = variant_colours(variants.index(points[0]["variant"]) % variant_colours.N)
            axis.errorbar(xs, ys, xerr=[p["metrics"][metric][1] or 0.0 for p in points],
                          yerr=[p["metrics"][learning][1] or 0.0 for p in points], color=colour,
                          linestyle=":" if variant else "-", marker=_marker(condition), markersize=6,
                          markerfacecolor="white" if variant else colour, markeredgecolor=colour, capsize=2,
                          elinewidth=0.8, ecolor=(*matplotlib.colors.to_rgb(colour), 0.35), label=name, alpha=0.9,
                          zorder=3)
            rate_labels[axis] += [(x, y, f"{point['lr']:g}") for x, y, point in zip(xs, ys, points)]
        if base is not None:
            axis.plot(base[metric][0], base[learning][0], "s", color=FAMILY_COLOURS["Base"], markersize=8,
                      label=display_name("base", model), zorder=3)
        axis.set_xlabel(metric_title(metric, labels) + (" (→ better)" if HIGHER_IS_BETTER[metric] else " (← better)"))
        axis.set_ylabel(metric_title(learning, labels) + " (↑ better)")
        if not HIGHER_IS_BETTER[metric]:
            axis.set_xscale("log")
        axis.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    figure.suptitle("Learning-rate sweep: every rate of every method (mean ± 95% interval over seeds; rates "
                    "labelled where there is room, all in lr_sweep.md)")
    figure.tight_layout()
    figure.canvas.draw()  # final limits, then the rate labels go where they cross nothing
    for axis, points in rate_labels.items():
        _place_rate_labels(figure, axis, points)
    out_path = Path(out_path)
    figure.savefig(out_path, dpi=130)
    plt.close(figure)
    return out_path
