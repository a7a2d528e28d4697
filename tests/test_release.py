"""The release's single sources and its CI check: the version is written once (smf_kernels.__version__, which
pyproject.toml reads), the license file is the one pyproject declares, the sdist carries the extension's sources,
and CI runs .ci/wheel_check.sh (the built wheel installed outside the tree) after the README's test command."""
import ast
import re
from pathlib import Path

from smf_kernels import build_ext

REPO = Path(__file__).resolve().parents[1]


def test_the_version_is_written_once_and_pyproject_reads_it():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.M) and not re.search(r'^version = "', pyproject, re.M)
    assert re.search(r'^version = \{ attr = "smf_kernels.__version__" \}', pyproject, re.M)
    module = ast.parse((REPO / "smf_kernels" / "__init__.py").read_text())
    versions = [node.value.value for node in module.body if isinstance(node, ast.Assign)
                and [target.id for target in node.targets] == ["__version__"]]
    assert len(versions) == 1 and re.fullmatch(r"\d+\.\d+\.\d+", versions[0]), versions  # a literal setuptools reads
    assert f"## {versions[0]}" in (REPO / "CHANGELOG.md").read_text()


def test_the_license_file_is_the_declared_one():
    assert 'license = { text = "Apache-2.0" }' in (REPO / "pyproject.toml").read_text()
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_the_sdist_carries_the_sources_and_a_checkout_builds_from_its_own():
    manifest = (REPO / "MANIFEST.in").read_text().splitlines()
    assert "graft csrc" in manifest and any(line.startswith("include LICENSE CHANGELOG.md") for line in manifest)
    assert build_ext.SOURCE_DIR == REPO / "csrc"  # no smf_kernels/csrc/ in a checkout: only a built wheel has one
    assert {*build_ext.CPU_SOURCES, *build_ext.CUDA_SOURCES} <= {path.name for path in build_ext.SOURCE_DIR.iterdir()}


def test_ci_checks_the_wheel_after_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    tests = ci.index('-e ".[dev]" && python -m pytest -q tests\n')
    assert ci.index("bash .ci/wheel_check.sh\n") > tests
