"""Where each dataset of the experiments is read from: a local copy in the hub schema, or the hub."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataPaths:
    """Local dataset files (absolute), or None for the public hub dataset."""

    oasst: str | None = None
    medmcqa_train: str | None = None
    medmcqa_validation: str | None = None
    wikitext: str | None = None
    triviaqa: str | None = None
