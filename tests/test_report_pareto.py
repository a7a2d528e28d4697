"""Pareto figure: frontier computation on hand-built points; PNG and PDF written."""
import pytest

from smf.report.pareto import pareto_front, plot_pareto
from smf.report.table import Summary, paper_summaries


def test_pareto_front_on_hand_built_points():
    # (ppl, acc): lower ppl and higher acc are better; point 2 is dominated by point 1, point 4 by 3.
    ppl = [13.0, 12.7, 13.5, 15.5, 16.5, 18.9]
    acc = [0.344, 0.369, 0.350, 0.390, 0.355, 0.398]
    assert pareto_front(ppl, acc, maximize_x=False, maximize_y=True) == [1, 3, 5]
    # Both maximised (TriviaQA vs MedMCQA); ties with a strictly better point are dominated.
    trivia = [0.256, 0.252, 0.252, 0.193, 0.163]
    med = [0.344, 0.369, 0.360, 0.390, 0.398]
    assert pareto_front(trivia, med, maximize_x=True, maximize_y=True) == [4, 3, 1, 0]
    with pytest.raises(ValueError, match="same length"):
        pareto_front([1.0], [1.0, 2.0], maximize_x=True, maximize_y=True)


def test_paper_frontiers_match_the_papers_reading():
    """The paper: LoRA and full finetuning on both frontiers, replacement on neither."""
    summaries = paper_summaries()
    names = [s.condition for s in summaries]
    med = [s.stats["medmcqa_acc"][0] for s in summaries]
    for metric, maximize in (("wikitext_ppl", False), ("triviaqa_acc", True)):
        front = {names[i] for i in pareto_front([s.stats[metric][0] for s in summaries], med,
                                                maximize_x=maximize, maximize_y=True)}
        assert {"lora", "full"} <= front and not front & {"replacement-kl", "replacement-tfidf"}


def test_figure_files_written(tmp_path):
    summaries = paper_summaries()[:3] + [Summary("lora", 1, {"medmcqa_acc": (0.39, 0.0), "wikitext_ppl": (15.0, 0.0),
                                                               "triviaqa_acc": None})]
    paths = plot_pareto(summaries, tmp_path / "figs" / "pareto", title="test")
    assert [p.name for p in paths] == ["pareto.png", "pareto.pdf"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[1].read_bytes()[:5] == b"%PDF-"
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_accuracy_axes_stay_non_negative_labels_clear_error_bars_baselines_in_legend():
    import matplotlib.pyplot as plt
    from matplotlib.transforms import Bbox

    from smf.report.pareto import draw_pareto

    # Near-zero accuracies with wide spreads: error bars and margins would reach below 0.
    summaries = [Summary("base", 2, {"medmcqa_acc": (0.02, 0.03), "wikitext_ppl": (40.0, 5.0),
                                     "triviaqa_acc": (0.0, 0.0)}),
                 Summary("lora", 2, {"medmcqa_acc": (0.05, 0.04), "wikitext_ppl": (38.0, 6.0),
                                     "triviaqa_acc": (0.01, 0.02)}),
                 Summary("additive-kl", 2, {"medmcqa_acc": (0.03, 0.01), "wikitext_ppl": (39.0, 1.0),
                                            "triviaqa_acc": (0.005, 0.01)})]
    figure = draw_pareto(summaries, model="tiny")
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    left, right = figure.axes
    assert left.get_ylim()[0] >= 0 and right.get_ylim()[0] >= 0 and right.get_xlim()[0] >= 0
    for axis in (left, right):
        labels = [text for text in axis.texts if text.get_text()]
        assert {text.get_text() for text in labels} == {"Base (tiny)", "LoRA"}
        bars = [Bbox(axis.transData.transform(segment)).padded(1) for collection in axis.collections
                for segment in collection.get_segments()]  # every error bar, in pixels
        assert len(bars) == 2 * len(summaries)
        for text in labels:
            box = text.get_window_extent(renderer)
            assert not any(box.overlaps(bar) for bar in bars), text.get_text()
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert "Base (tiny)" in legend and "LoRA" in legend
    plt.close(figure)
