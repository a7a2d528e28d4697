"""Issue 35: the evaluations say which rows they skip, and WikiText's whole-text tokenisation does not warn."""
import logging

from smf.eval.medmcqa import count_rows, evaluate_medmcqa
from smf.eval.wikitext import evaluate_wikitext
from smf.tiny import tiny_model, tiny_tokenizer


def _question(index, choice_type="single"):
    return {"id": str(index), "question": f"Question {index}?", "opa": "A", "opb": "B", "opc": "C", "opd": "D",
            "cop": index % 4, "choice_type": choice_type, "exp": "", "subject_name": "", "topic_name": ""}


def test_medmcqa_counts_and_logs_the_multi_answer_rows_it_skips(caplog):
    rows = [_question(0), _question(1, "multi"), _question(2), _question(3, "multi"), _question(4)]
    assert count_rows(rows, 1000) == {"rows": 5, "scored": 3, "skipped": 2}
    assert count_rows(rows, 2) == {"rows": 5, "scored": 2, "skipped": 1}  # passed over before the limit only
    with caplog.at_level(logging.INFO, logger="smf.eval.medmcqa"):
        evaluate_medmcqa(tiny_model().eval(), tiny_tokenizer(), rows, questions_per_batch=4)
    assert "scoring 3 of 5 rows; 2 multi-answer rows" in caplog.text


def test_wikitext_tokenises_its_text_without_the_length_warning():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    transformers_logger = logging.getLogger("transformers")  # the library's root: its warnings reach it
    transformers_logger.addHandler(handler)
    try:
        tokenizer = tiny_tokenizer()
        tokenizer.model_max_length = 64
        tokenizer("x" * 100)  # the warning, as a plain call gives it
        assert any("longer than the specified maximum" in r.getMessage() for r in records)
        records.clear()
        tokenizer = tiny_tokenizer()
        tokenizer.model_max_length = 64
        rows = [{"text": "The quick brown fox jumps over the lazy dog. " * 4} for _ in range(3)]
        evaluate_wikitext(tiny_model().eval(), tokenizer, rows, window=32, stride=16)
        assert not any("longer than the specified maximum" in r.getMessage() for r in records)
    finally:
        transformers_logger.removeHandler(handler)
