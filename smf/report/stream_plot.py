"""A stream's forgetting curves as a figure (``stream_forgetting.png``, beside ``stream.md``): one panel per method,
accuracy after each stage (x: before the stream, after task A, after task B, ...) of the old facts (black squares)
and of every task (a colour each), mean ± 95% interval over seeds (fainter for a long stream). A task's line is
dotted before the stage that trains it and solid from that stage on, so its fall after it is the forgetting of that
task; the first point of every line is the base model's (when the suite ran the base condition). Each line is moved a
little along x so that intervals do not hide one another."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OLD_FACTS = "old facts"
LONG = 4  # more tasks than this: letters as ticks, fainter intervals (eleven series share a panel)


def plot_forgetting(panels: list[dict], tasks: list[str], out_path: Path, *, old_title: str) -> Path:
    """``panels``: per method ``{"label": str, "points": {stage: {series: (mean, half-width or None)}}}`` with stage
    0 the base model (may be missing) and series :data:`OLD_FACTS` and each task name of ``tasks`` (trained at stage
    ``tasks.index(name) + 1``); ``old_title`` names the old-fact metric. Returns the PNG path."""
    columns = min(3, max(len(panels), 1))
    rows = max(1, math.ceil(len(panels) / columns))
    figure, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.6 * rows), squeeze=False, sharey=True)
    colours = {task: plt.get_cmap("tab10")(index % 10) for index, task in enumerate(tasks)}
    stages = range(len(tasks) + 1)
    every = (OLD_FACTS, *tasks)
    for axis, panel in zip(axes.flat, panels):
        for index, series in enumerate(every):
            offset = (index - (len(every) - 1) / 2) * 0.04  # apart a little, so that intervals do not hide each other
            points = [(stage + offset, panel["points"][stage][series]) for stage in stages
                      if stage in panel["points"] and series in panel["points"][stage]]
            if not points:
                continue
            trained = 0 if series == OLD_FACTS else tasks.index(series) + 1
            colour = "black" if series == OLD_FACTS else colours[series]
            marker = "s" if series == OLD_FACTS else "o"
            before = [(x, value) for x, value in points if x <= trained + offset]
            after = [(x, value) for x, value in points if x >= trained + offset]
            if series != OLD_FACTS and len(before) > 1:
                axis.plot([x for x, _ in before], [v[0] for _, v in before], color=colour, linestyle=":",
                          linewidth=1.0)
            axis.plot([x for x, _ in after], [v[0] for _, v in after], color=colour, linewidth=1.5, marker=marker,
                      markersize=5, label=old_title if series == OLD_FACTS else f"task {series}")
            spread = [(x, value) for x, value in points if value[1] is not None]  # one seed: no interval
            axis.errorbar([x for x, _ in spread], [v[0] for _, v in spread], yerr=[v[1] for _, v in spread],
                          color=colour, linestyle="", capsize=3, alpha=0.8 if len(tasks) <= LONG else 0.3)
        axis.set_title(panel["label"], fontsize=9)
        if len(tasks) > LONG:  # a long stream: the task letters only, "after task" once under the axis
            axis.set_xticks(list(stages), ["base"] + list(tasks), fontsize=8)
            axis.set_xlabel("after task", fontsize=8)
        else:
            axis.set_xticks(list(stages), ["base"] + [f"after {task}" for task in tasks], fontsize=8)
        axis.set_ylim(-0.05, 1.05)
        axis.grid(alpha=0.3)
    for axis in axes.flat[len(panels):]:
        axis.set_visible(False)
    for axis in axes[:, 0]:
        axis.set_ylabel("accuracy")
    axes.flat[0].legend(fontsize=7, loc="lower left")
    figure.suptitle("Forgetting along the stream (each method at its chosen rate; mean ± 95% interval over seeds; "
                    "dotted: before the task is trained)", fontsize=10)
    figure.tight_layout()
    out_path = Path(out_path)
    figure.savefig(out_path, dpi=130)
    plt.close(figure)
    return out_path
