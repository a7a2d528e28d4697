"""The paper's Pareto figure: MedMCQA accuracy against each forgetting probe, two panels (own data,
docs/own-data.md: ``learn_acc`` against ``heldout_ppl`` and ``retain_acc``, titled by the suite's ``labels``).

Left: MedMCQA accuracy (y) vs WikiText perplexity (x), top-left best. Right: MedMCQA accuracy
(y) vs TriviaQA accuracy (x), top-right best. One point per condition with seed-std error bars;
colour = method family; sparse methods: circle = KL, triangle = TF-IDF; the non-sparse
baselines get their own markers (in the legend) and a text label placed up and to the right of
the error bars' ends; a dashed line joins each panel's empirical Pareto frontier. Accuracy axes
stay within [0, 1] whatever the error bars and margins.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402

from smf.report.paper_results import FAMILIES, HIGHER_IS_BETTER, SELECTION_RULES, metric_title  # noqa: E402
from smf.report.paper_results import display_name  # noqa: E402
from smf.report.table import Summary  # noqa: E402

FAMILY_COLOURS = {"Base": "#555555", "Replacement": "#d62728", "Additive": "#1f77b4", "Additive +S": "#2ca02c",
                  "LoRA": "#ff7f0e", "Full finetune": "#9467bd"}
RULE_MARKERS = {"KL": "o", "TF-IDF": "^"}
BASELINE_MARKERS = {"base": "s", "lora": "D", "full": "P"}


def pareto_front(xs: Sequence[float], ys: Sequence[float], *, maximize_x: bool, maximize_y: bool) -> list[int]:
    """Indices of the points no other point dominates (at least as good on both axes, better on one),
    ordered by increasing x."""
    if len(xs) != len(ys):
        raise ValueError(f"xs and ys must have the same length, got {len(xs)} and {len(ys)}")
    sx, sy = (1 if maximize_x else -1), (1 if maximize_y else -1)

    def dominates(a: int, b: int) -> bool:
        at_least = sx * xs[a] >= sx * xs[b] and sy * ys[a] >= sy * ys[b]
        better = sx * xs[a] > sx * xs[b] or sy * ys[a] > sy * ys[b]
        return at_least and better

    front = [i for i in range(len(xs)) if not any(dominates(j, i) for j in range(len(xs)) if j != i)]
    return sorted(front, key=lambda i: xs[i])


def _label_offsets(xy: Sequence[tuple[float, float]], near: float = 0.03) -> list[int]:
    """For each labelled point, how many earlier labelled points lie within ``near`` of it (as a
    fraction of the axis ranges): labels of coinciding points are stacked instead of overprinted."""
    xs, ys = [p[0] for p in xy], [p[1] for p in xy]
    span_x, span_y = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    return [sum(abs(x - px) <= near * span_x and abs(y - py) <= near * span_y for px, py in xy[:i])
            for i, (x, y) in enumerate(xy)]


def _clamp_accuracy_axis(get_limits, set_limits) -> None:
    low, high = get_limits()
    set_limits(max(low, 0.0), min(high, 1.0))


def _place_labels(figure, axis) -> None:
    """Move each baseline label to the first of its four candidate spots (beside the ends of its x error
    bar, above or below) whose box crosses no error bar and no marker of the panel; keep the first spot
    when none is clear."""
    renderer = figure.canvas.get_renderer()
    obstacles = [Bbox(axis.transData.transform(segment)).padded(1.5) for collection in axis.collections
                 for segment in collection.get_segments()]
    for line in axis.lines:  # markers (and the frontier's vertices)
        if line.get_marker() not in (None, "None", ""):
            obstacles += [Bbox.from_bounds(px - 6, py - 6, 12, 12)
                          for px, py in axis.transData.transform(line.get_xydata())]
    for label in [text for text in axis.texts if hasattr(text, "anchors")]:
        for xy, (dx, dy), ha, va in [*label.anchors, label.anchors[0]]:  # the last try is the fallback
            label.xy, label.xyann = xy, (dx, dy + (label.stack if dy > 0 else -label.stack))
            label.set_ha(ha)
            label.set_va(va)
            if not any(label.get_window_extent(renderer).overlaps(box) for box in obstacles):
                break


def _draw_panel(axis, summaries: Sequence[Summary], x_metric: str, maximize_x: bool, model: str | None,
                y_metric: str = "medmcqa_acc", labels: dict[str, str] | None = None) -> None:
    points = [s for s in summaries if s.stats[y_metric] is not None and s.stats[x_metric] is not None]
    labelled = [s for s in points if SELECTION_RULES.get(s.condition) is None]
    stacked = dict(zip((s.condition for s in labelled), _label_offsets(
        [(s.stats[x_metric][0], s.stats[y_metric][0]) for s in labelled]))) if labelled else {}
    for summary in points:
        (x, x_std), (y, y_std) = summary.stats[x_metric], summary.stats[y_metric]
        x_std = x_std or 0.0  # None: one seed, no spread
        colour = FAMILY_COLOURS[FAMILIES[summary.condition]]
        rule = SELECTION_RULES.get(summary.condition)
        marker = RULE_MARKERS[rule] if rule else BASELINE_MARKERS[summary.condition]
        axis.errorbar(x, y, xerr=x_std, yerr=y_std, fmt=marker, color=colour, markersize=9, capsize=3,
                      markeredgecolor="black", markeredgewidth=0.6, zorder=3)
        if rule is None:  # first placed beside the end of the x error bar; _place_labels moves it if needed
            label = axis.annotate(display_name(summary.condition, model), (x + x_std, y), textcoords="offset points",
                                  xytext=(6, 5 + 11 * stacked[summary.condition]), ha="left", va="bottom",
                                  fontsize=9, color=colour, zorder=4)
            label.anchors = [((x + x_std, y), (6, 5), "left", "bottom"), ((x + x_std, y), (6, -5), "left", "top"),
                             ((x - x_std, y), (-6, 5), "right", "bottom"), ((x - x_std, y), (-6, -5), "right", "top")]
            label.stack = 11 * stacked[summary.condition]
    if points:
        xs = [s.stats[x_metric][0] for s in points]
        ys = [s.stats[y_metric][0] for s in points]
        front = pareto_front(xs, ys, maximize_x=maximize_x, maximize_y=True)
        axis.plot([xs[i] for i in front], [ys[i] for i in front], linestyle="--", color="black", linewidth=1,
                  alpha=0.7, zorder=2)
    axis.set_xlabel(f"{metric_title(x_metric, labels)} ({'higher' if maximize_x else 'lower'} is better)")
    axis.set_ylabel(f"{metric_title(y_metric, labels)} (higher is better)")
    axis.grid(alpha=0.3)
    axis.margins(x=0.12, y=0.1)
    axis.set_xlim(axis.get_xlim()[0], axis.get_xlim()[1] + 0.12 * (axis.get_xlim()[1] - axis.get_xlim()[0]))
    _clamp_accuracy_axis(axis.get_ylim, axis.set_ylim)
    if HIGHER_IS_BETTER[x_metric]:  # an accuracy
        _clamp_accuracy_axis(axis.get_xlim, axis.set_xlim)


def draw_pareto(summaries: Sequence[Summary], *, title: str | None = None, model: str | None = None,
                labels: dict[str, str] | None = None):
    """The two-panel figure (a matplotlib Figure; close it with ``plt.close``). ``model`` names the base
    point after the model used; ``labels`` (metric key -> title) name the axes."""
    if not summaries:
        raise ValueError("summaries must hold at least one condition")
    learn, perplexity, retained = summaries[0].stats  # the records' metrics, in the paper's order of roles
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 5.2))
    _draw_panel(left, summaries, perplexity, maximize_x=False, model=model, y_metric=learn, labels=labels)
    left.set_title("Task gain vs language-modelling forgetting (top-left best)")
    _draw_panel(right, summaries, retained, maximize_x=True, model=model, y_metric=learn, labels=labels)
    right.set_title("Task gain vs knowledge forgetting (top-right best)")
    families = dict.fromkeys(FAMILIES[s.condition] for s in summaries)
    handles = [Line2D([], [], linestyle="", marker="s", markersize=10, color=FAMILY_COLOURS[f], label=f)
               for f in families]
    handles += [Line2D([], [], linestyle="", marker=marker, markersize=9, color="white", markeredgecolor="black",
                       label=f"sparse, {rule} selection") for rule, marker in RULE_MARKERS.items()]
    handles += [Line2D([], [], linestyle="", marker=BASELINE_MARKERS[s.condition], markersize=9, color="white",
                       markeredgecolor="black", label=display_name(s.condition, model))
                for s in summaries if s.condition in BASELINE_MARKERS]
    handles.append(Line2D([], [], linestyle="--", color="black", label="empirical Pareto frontier"))
    figure.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), frameon=False, fontsize=9)
    if title:
        figure.suptitle(title)
    figure.tight_layout(rect=(0, 0.1, 1, 1))
    figure.canvas.draw()  # final limits and text sizes, then labels go where they cross nothing
    for axis in (left, right):
        _place_labels(figure, axis)
    return figure


def plot_pareto(summaries: Sequence[Summary], path_stem: str | Path, *, title: str | None = None,
                model: str | None = None, labels: dict[str, str] | None = None) -> list[Path]:
    """:func:`draw_pareto` written to ``{path_stem}.png`` and ``{path_stem}.pdf``; returns the two paths."""
    figure = draw_pareto(summaries, title=title, model=model, labels=labels)
    path_stem = Path(path_stem)
    path_stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [path_stem.with_suffix(".png"), path_stem.with_suffix(".pdf")]
    for path in paths:
        figure.savefig(path, dpi=150)
    plt.close(figure)
    return paths
