"""The tokenizer saved beside a model with memories, twice: in the model's directory (as transformers saves it) and
in its ``tokenizer/`` subfolder, which holds no ``config.json``.

Why the copy: transformers 5 reads a directory's ``config.json`` before it loads the tokenizer
(``AutoConfig.from_pretrained``, then the tokenizer class), and a model with memories has a model type of its own
(``qwen2_smf_memories``) whose config class is the saved code: in a process without smf a plain
``AutoTokenizer.from_pretrained(d)`` asks whether to run that code (or, refused, logs a model-type warning). No
``config.json`` layout can avoid it without letting a plain ``AutoModelForCausalLM.from_pretrained(d)`` load the
base model silently (docs/hf.md). A folder of tokenizer files alone needs no config:
``AutoTokenizer.from_pretrained(d, subfolder="tokenizer")`` loads the same tokenizer with no prompt and no warning on
transformers 4.57 and 5.x (tests/test_hf_save_load.py; .ci/lower_bound_check.py on the oldest accepted version).
"""
from __future__ import annotations

from pathlib import Path

from smf.model.hf_auto import REMOTE_CODE_FILE

TOKENIZER_SUBFOLDER = "tokenizer"


def save_tokenizer(tokenizer, directory: str | Path) -> Path:
    """``tokenizer.save_pretrained(directory)``; where ``directory`` holds a model with memories saved by
    ``save_pretrained`` (its loader file, :data:`smf.model.hf_auto.REMOTE_CODE_FILE`), also into
    ``directory/tokenizer/``. Save the model first. Returns ``directory``; NotADirectoryError where either folder
    is a file, OSError where the tokenizer saved nothing (transformers logs that and returns)."""
    directory = Path(directory)
    _save_into(tokenizer, directory)
    if (directory / REMOTE_CODE_FILE).is_file():
        _save_into(tokenizer, directory / TOKENIZER_SUBFOLDER)
    return directory


def _save_into(tokenizer, directory: Path) -> None:
    """``tokenizer.save_pretrained(directory)``, or an error where it wrote nothing (``directory`` a file: transformers
    only logs that)."""
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"cannot save the tokenizer into {str(directory)!r}: it is a file, not a folder")
    if not tokenizer.save_pretrained(directory):
        raise OSError(f"the tokenizer saved no files into {str(directory)!r}")
