"""How the three evaluations run: the sizes and batch sizes of :func:`smf.eval.tasks.evaluate_model`."""
from __future__ import annotations

from dataclasses import dataclass

from smf.options import option
from smf.vocabulary import TASKS

POS = "positive"


@dataclass(frozen=True)
class EvalSettings:
    """How each evaluation runs (docs/method.md#evaluation); the defaults are the paper's."""

    tasks: tuple[str, ...] = option(TASKS, "tasks to evaluate", choices=TASKS)
    medmcqa_examples: int = option(1000, "first N single-answer validation questions", bound=POS)
    triviaqa_examples: int = option(1000, "first N validation questions", bound=POS)
    wikitext_window: int = option(1024, "tokens per perplexity window", bound=POS)
    wikitext_stride: int = option(512, "tokens between window starts", bound=POS)
    triviaqa_max_new_tokens: int = option(32, "greedy answer length", bound=POS)
    medmcqa_questions_per_batch: int = option(8, "questions scored per forward", bound=POS)
    wikitext_windows_per_batch: int = option(8, "windows scored per forward", bound=POS)
    triviaqa_batch_size: int = option(32, "questions decoded per generate call (1: the authors' exact decoding)",
                                      bound=POS)
