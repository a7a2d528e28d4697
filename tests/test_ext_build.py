"""How the optional extension is built, found and reported; the CUDA sources compile with nvcc."""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smf_kernels import backends, build_ext

ROOT = Path(__file__).resolve().parent.parent


def _nvcc() -> str | None:
    return shutil.which("nvcc") or next(
        (p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None
    )


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """No build to find: an empty cache directory and no in-place build."""
    if importlib.util.find_spec("smf_kernels._ext") is not None:
        pytest.skip("an in-place build (setup.py) exists and would be found first")
    monkeypatch.setenv(build_ext.DIR_ENV_VAR, str(tmp_path))
    monkeypatch.delenv(build_ext.BUILD_ENV_VAR, raising=False)
    return tmp_path


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
def test_cuda_sources_compile_with_nvcc():
    result = subprocess.run(
        [str(ROOT / "benchmarks" / "compile_cuda_sources.sh")],
        env={**os.environ, "NVCC": _nvcc()}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr


def test_unbuilt_extension_says_how_to_build(empty_cache, monkeypatch):
    with pytest.raises(ImportError, match="python -m smf_kernels.build_ext"):
        build_ext.load_extension()
    # ... and the backend registry reports that reason for "ext".
    monkeypatch.delitem(sys.modules, "smf_kernels.backends.ext_impl", raising=False)
    backends.refresh()
    try:
        reason = backends.unavailable_reason("ext", torch.device("cpu"))
        assert reason is not None and "python -m smf_kernels.build_ext" in reason
        assert backends.available_backends("cpu")[0] != "ext"
    finally:
        backends.refresh()


def test_env_var_builds_on_first_use(empty_cache, monkeypatch):
    built = object()
    monkeypatch.setenv(build_ext.BUILD_ENV_VAR, "1")
    monkeypatch.setattr(build_ext, "build", lambda verbose=False: built)
    assert build_ext.load_extension() is built


def test_failed_build_is_not_retried_on_import(empty_cache, monkeypatch):
    failure = build_ext.build_dir(build_ext.source_hash()) / "build_failed.txt"
    failure.parent.mkdir(parents=True)
    failure.write_text("RuntimeError: compiler exploded\n")
    monkeypatch.setenv(build_ext.BUILD_ENV_VAR, "1")

    def no_build(verbose=False):
        raise AssertionError("a recorded failure must not be rebuilt on import")

    monkeypatch.setattr(build_ext, "build", no_build)
    with pytest.raises(ImportError, match="earlier build .* failed"):
        build_ext.load_extension()


def test_source_hash_follows_the_sources(tmp_path, monkeypatch):
    digest = build_ext.source_hash()
    assert digest is not None and build_ext.build_dir(digest).name == f"ext-{digest}"
    copy = tmp_path / "csrc"
    shutil.copytree(build_ext.SOURCE_DIR, copy)
    monkeypatch.setattr(build_ext, "SOURCE_DIR", copy)
    assert build_ext.source_hash() == digest
    (copy / "cpu_gather.cpp").write_text((copy / "cpu_gather.cpp").read_text() + "\n// edited\n")
    assert build_ext.source_hash() != digest


def test_the_build_logs_each_file_as_ninja_finishes_it(tmp_path, caplog):
    """One line per compiled file and for the link, from ninja's log; lines an earlier attempt left are skipped."""
    log = tmp_path / ".ninja_log"
    log.write_text("# ninja log v5\n0\t9000\t1\tcpu_topk.o\tx\n")  # an earlier, failed attempt
    progress = build_ext._BuildProgress(tmp_path, list(build_ext.CPU_SOURCES))
    with log.open("a") as f:
        f.write("10\t31010\t2\tbindings.o\ty\n0\t12500\t3\tcpu_gather.o\tz\n")
    with caplog.at_level("INFO", logger="smf_kernels.build_ext"):
        progress.report()
        with log.open("a") as f:
            f.write("31010\t31500\t4\t_ext.so\tw\n")
        progress.report()
    lines = [record.getMessage().split(" (")[0] for record in caplog.records]
    assert lines == ["  compiled bindings.cpp in 31 s", "  compiled cpu_gather.cpp in 12 s", "  linked the library in 0 s"]


def test_the_build_reads_only_what_ninja_appended(tmp_path, caplog):
    """A line ninja is still writing waits for its end; the bytes already read are not read again."""
    log = tmp_path / ".ninja_log"
    log.write_text("# ninja log v5\n")
    progress = build_ext._BuildProgress(tmp_path, list(build_ext.CPU_SOURCES))
    with caplog.at_level("INFO", logger="smf_kernels.build_ext"):
        with log.open("a") as f:
            f.write("0\t7000\t1\tcpu_to")
        progress.report()
        assert not caplog.records and progress.offset == log.stat().st_size
        with log.open("a") as f:
            f.write("pk.o\tx\n")
        progress.report()
        progress.report()
    assert [record.getMessage().split(" (")[0] for record in caplog.records] == ["  compiled cpu_topk.cpp in 7 s"]


def test_a_quiet_build_says_what_it_is_still_compiling(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(build_ext._BuildProgress, "QUIET_SECONDS", 0)
    (tmp_path / ".ninja_log").write_text("# ninja log v5\n0\t5000\t1\tcpu_topk.o\tx\n")
    progress = build_ext._BuildProgress(tmp_path, ["bindings.cpp", "cpu_topk.cpp"])
    progress.offset = 0  # this attempt's log
    with caplog.at_level("INFO", logger="smf_kernels.build_ext"):
        progress.start()
        progress.done.wait(1.5)
        progress.stop()
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0].startswith("  compiled cpu_topk.cpp in 5 s")
    assert any(message.startswith("  still compiling bindings.cpp (") for message in messages[1:])


def test_the_kernels_are_one_file_per_op_and_all_of_them_are_built():
    kernels = {path.name for path in build_ext.SOURCE_DIR.glob("cpu_*.cpp")}
    assert kernels == {"cpu_topk.cpp", "cpu_gather.cpp", "cpu_silu_mul.cpp", "cpu_row_adamw.cpp",
                       "cpu_output_pool.cpp"}
    assert set(build_ext.CPU_SOURCES) == kernels | {"bindings.cpp"}
