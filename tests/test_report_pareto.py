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
