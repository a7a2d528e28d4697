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
    ``directory/tokenizer/``. Save the model first. Returns ``directory``."""
    directory = Path(directory)
    tokenizer.save_pretrained(directory)
    if (directory / REMOTE_CODE_FILE).is_file():
        tokenizer.save_pretrained(directory / TOKENIZER_SUBFOLDER)
    return directory
