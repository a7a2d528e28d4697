"""Where each dataset of the experiments is read from: the paper's datasets (a local copy in the hub schema, or the
hub), or a user's own files (docs/own-data.md), never a mix."""
from __future__ import annotations

from dataclasses import dataclass, fields

from smf.errors import ConfigError

PAPER_KEYS = ("oasst", "medmcqa_train", "medmcqa_validation", "wikitext", "triviaqa")
# Own-data keys: the files of each role (docs/own-data.md); an eval_* key's role is the part after "eval_".
OWN_KEYS = ("retrofit", "background", "train", "eval_learn", "eval_heldout", "eval_retain", "eval_retain_heldout")
OWN_SCHEMAS = {"retrofit": ("text",), "background": ("text",), "train": ("text", "qa", "mc"),
               "eval_learn": ("qa", "mc"), "eval_heldout": ("text",), "eval_retain": ("qa", "mc"),
               "eval_retain_heldout": ("qa", "mc")}


@dataclass(frozen=True)
class DataPaths:
    """Local dataset files (absolute). Paper keys: None for the public hub dataset. Own-data keys: None for a role
    not given. Setting any own-data key makes the whole set own data (:attr:`own`)."""

    oasst: str | None = None
    medmcqa_train: str | None = None
    medmcqa_validation: str | None = None
    wikitext: str | None = None
    triviaqa: str | None = None
    retrofit: str | None = None
    background: str | None = None
    train: str | None = None
    eval_learn: str | None = None
    eval_heldout: str | None = None
    eval_retain: str | None = None
    eval_retain_heldout: str | None = None  # retained knowledge asked in a form no training text holds (issue 48)

    def __post_init__(self) -> None:
        given = {f.name for f in fields(self) if getattr(self, f.name) is not None}
        paper, own = sorted(given & set(PAPER_KEYS)), sorted(given & set(OWN_KEYS))
        if paper and own:
            raise ConfigError(f"the paper's keys ({', '.join(paper)}) and own-data keys ({', '.join(own)}) "
                              "cannot be mixed; give one set (docs/own-data.md)")

    @property
    def own(self) -> bool:
        """Whether these are a user's own files (any own-data key given)."""
        return any(getattr(self, key) is not None for key in OWN_KEYS)

    @property
    def eval_roles(self) -> tuple[str, ...]:
        """The evaluation roles (learn, heldout, retain) with a file, in that order."""
        return tuple(key.removeprefix("eval_") for key in OWN_KEYS
                     if key.startswith("eval_") and getattr(self, key) is not None)
