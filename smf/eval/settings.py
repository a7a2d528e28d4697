"""How the three evaluations run: the sizes and batch sizes of :func:`smf.eval.tasks.evaluate_model`."""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import PositiveInt

from smf.options import OPTIONS_CONFIG, choice_tuple, option
from smf.vocabulary import EVAL_ROLES, TASKS


@dataclass(frozen=True)
class EvalSettings:
    """How each evaluation runs (docs/method.md#evaluation); the defaults are the paper's."""

    __pydantic_config__ = OPTIONS_CONFIG

    tasks: choice_tuple(TASKS + EVAL_ROLES) = option(TASKS, "tasks to evaluate: the paper's, or the roles of own data "
                                                     "(learn, heldout, retain; docs/own-data.md)")
    medmcqa_examples: PositiveInt = option(1000, "first N single-answer validation questions (own data: every row)")
    triviaqa_examples: PositiveInt = option(1000, "first N validation questions (own data: every row)")
    wikitext_window: PositiveInt = option(1024, "tokens per perplexity window")
    wikitext_stride: PositiveInt = option(512, "tokens between window starts")
    triviaqa_max_new_tokens: PositiveInt = option(32, "greedy answer length")
    medmcqa_questions_per_batch: PositiveInt = option(8, "questions scored per forward")
    wikitext_windows_per_batch: PositiveInt = option(8, "windows scored per forward")
    triviaqa_batch_size: PositiveInt = option(32, "questions decoded per generate call (1: the authors' exact "
                                              "decoding)")

    def __post_init__(self) -> None:
        if set(self.tasks) & set(TASKS) and set(self.tasks) & set(EVAL_ROLES):
            raise ValueError(f"tasks {list(self.tasks)} mix the paper's tasks ({', '.join(TASKS)}) with own-data roles "
                             f"({', '.join(EVAL_ROLES)})")
        if not self.wikitext_stride < self.wikitext_window:
            raise ValueError(f"wikitext_stride ({self.wikitext_stride}) must be smaller than wikitext_window "
                             f"({self.wikitext_window})")
