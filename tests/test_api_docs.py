"""docs/api.md is what tools/gen_api_docs.py writes from the current docstrings, and it covers the public names."""
import importlib.util
import re
from pathlib import Path

import smf.model
import smf_kernels
import smf_kernels.sparse

REPO = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_api_docs", REPO / "tools" / "gen_api_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_docs_are_current():
    generator = _generator()
    written = (REPO / "docs" / "api.md").read_text()
    assert written == generator.render(), f"docs/api.md is stale: run `{generator.COMMAND}` and commit the result"


def test_api_docs_name_every_public_export():
    text = (REPO / "docs" / "api.md").read_text()
    headings = set(re.findall(r"^### `([\w.]+)`$", text, re.M))
    for module in (smf_kernels, smf_kernels.sparse, smf.model):
        missing = {f"{module.__name__}.{name}" for name in module.__all__} - headings
        assert not missing, missing
    assert "smf_kernels.hf.SparseMemoryTrainer" in headings
    assert "#### `RowSparseAdamW.step`" in text  # a class's own methods are written out too


def test_api_docs_generator_finds_names_without_all():
    generator = _generator()
    import smf_kernels.backends

    names = generator.public_names(smf_kernels.backends)
    assert {"resolve_backend", "available_backends", "BackendUnavailableError", "Backend", "ENV_VAR"} <= set(names)
    assert not [name for name in names if name.startswith("_")]
    assert "importlib" not in names and "functools" not in names  # imported modules are not the API
