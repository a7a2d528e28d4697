"""Build and load the optional compiled extension: the ``ext`` backend, sources in ``csrc/``.

Nothing is compiled on a plain import. Ways to build (all against the installed torch):

* ``python -m smf_kernels.build_ext``: compiles the CPU kernels with
  ``torch.utils.cpp_extension`` (ninja, ~30 s on 2 idle cores) into a cache directory,
  ``$SMF_KERNELS_EXT_DIR`` or ``~/.cache/smf_kernels``, one subdirectory per
  hash of the sources, compiler flags and torch version.
* ``SMF_KERNELS_BUILD_EXT=1`` in the environment: the first import of the ext
  backend builds it the same way. A failed build is recorded in its directory
  and not retried on import; run the command above to retry.
* ``SMF_KERNELS_BUILD_EXT=1 pip install --no-build-isolation -e .``: setup.py
  builds ``smf_kernels._ext`` in place, with the CUDA kernels when torch has CUDA.

:func:`load_extension` returns the build that matches the current sources, or
raises ImportError saying how to get one.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import logging
import os
import platform
import shutil
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

# The sources: smf_kernels/csrc/ in an installed wheel (setup.py copies them there), csrc/ beside the package in a
# checkout or an editable install.
_PACKAGE_SOURCES = Path(__file__).resolve().parent / "csrc"
SOURCE_DIR = _PACKAGE_SOURCES if _PACKAGE_SOURCES.is_dir() else Path(__file__).resolve().parent.parent / "csrc"
# bindings.cpp (torch/extension.h, pybind11) takes most of the build; the kernels, one file per op, compile beside it.
CPU_SOURCES = ("bindings.cpp", "cpu_topk.cpp", "cpu_gather.cpp", "cpu_silu_mul.cpp", "cpu_row_adamw.cpp",
               "cpu_output_pool.cpp")
CUDA_SOURCES = ("cuda_kernels.cu",)
BUILD_ENV_VAR = "SMF_KERNELS_BUILD_EXT"
DIR_ENV_VAR = "SMF_KERNELS_EXT_DIR"
MODULE_NAME = "_ext"
# -march=native: the build runs where it was compiled (the cache key holds the CPU flags).
CXX_FLAGS = ("-O3", "-march=native", "-fopenmp")
NVCC_FLAGS = ("-O3", "--use_fast_math")
# Measured on a fresh cache (docs/library.md#the-compiled-extension).
BUILD_TIME = "about 30 s on 2 idle cores, several minutes on a loaded machine"
HOW_TO_BUILD = (
    f"run `python -m smf_kernels.build_ext` (~30 s), or set {BUILD_ENV_VAR}=1 to build on first use"
)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def source_hash() -> str | None:
    """Hash of csrc/, the compiler flags, torch's version and the CPU; None without csrc/."""
    if not SOURCE_DIR.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):
        if path.suffix in (".h", ".cpp", ".cu"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(CXX_FLAGS + NVCC_FLAGS).encode() + torch.__version__.encode() + _cpu_flags().encode())
    return digest.hexdigest()[:16]


def build_dir(digest: str) -> Path:
    """Cache directory of the JIT build for sources with hash ``digest``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = Path(os.environ.get(DIR_ENV_VAR) or os.path.join(cache, "smf_kernels"))
    return root / f"ext-{digest}"


def _compile_flags(digest: str) -> list[str]:
    return [*CXX_FLAGS, f"-DSMF_EXT_SOURCE_HASH={digest}"]


def _import_library(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _built_library(directory: Path) -> Path | None:
    matches = sorted(directory.glob(f"{MODULE_NAME}*.so"))
    return matches[0] if matches else None


def missing_build_tools() -> list[str]:
    """The tools a CPU build needs and this machine lacks: the C++ compiler ($CXX or c++) and ninja."""
    compiler = os.environ.get("CXX") or "c++"
    missing = [] if shutil.which(compiler) else [f"a C++ compiler ({compiler})"]
    try:
        from torch.utils import cpp_extension

        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        missing.append("ninja (pip install ninja)")
    return missing


class _BuildProgress(threading.Thread):
    """Logs each file the build finishes, read from what ninja appended to its log in ``directory`` once a second,
    with the seconds it took and since the build started, and every ``QUIET_SECONDS`` without one the files still
    compiling: a build on a loaded machine takes minutes, and silence looks like a hang."""

    QUIET_SECONDS = 8  # under 10 s between lines, the 1 s poll included

    def __init__(self, directory: Path, sources: list[str]) -> None:
        super().__init__(daemon=True)
        self.log = directory / ".ninja_log"
        self.outputs = {f"{Path(name).stem}.o": name for name in sources} | {f"{MODULE_NAME}.so": "the library"}
        self.offset = self.log.stat().st_size if self.log.exists() else 0  # an earlier attempt's lines: skipped
        self.partial = b""  # a line ninja has not finished writing
        self.started = self.last_line = time.perf_counter()
        self.finished: set[str] = set()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            self.report()
            now = time.perf_counter()
            if now - self.last_line >= self.QUIET_SECONDS:
                compiling = [name for output, name in self.outputs.items()
                             if output not in self.finished and output.endswith(".o")]
                logger.info("  still %s (%.0f s since the build started)",
                            f"compiling {', '.join(compiling)}" if compiling else "linking", now - self.started)
                self.last_line = now
        self.report()

    def report(self) -> None:
        """Log the files of the lines appended to ninja's log since the last call (only those bytes are read)."""
        if not self.log.exists():
            return
        with self.log.open("rb") as f:
            if f.seek(0, os.SEEK_END) < self.offset:  # ninja rewrote a long log in compact form: read it anew
                self.offset, self.partial = 0, b""
            f.seek(self.offset)
            appended = f.read()
        self.offset += len(appended)
        *lines, self.partial = (self.partial + appended).split(b"\n")
        for line in lines:
            fields = line.decode(errors="replace").split("\t")
            if line.startswith(b"#") or len(fields) < 4 or fields[3] not in self.outputs:
                continue
            seconds = (int(fields[1]) - int(fields[0])) / 1000
            self.finished.add(fields[3])
            self.last_line = time.perf_counter()
            logger.info("  compiled %s in %.0f s (%.0f s since the build started)" if fields[3].endswith(".o") else
                        "  linked %s in %.0f s (%.0f s since the build started)", self.outputs[fields[3]], seconds,
                        time.perf_counter() - self.started)

    def stop(self) -> None:
        self.done.set()
        self.join()


def build(verbose: bool = False) -> ModuleType:
    """Compile the CPU extension into its cache directory unless already built; load it.

    Raises RuntimeError (with the compiler's message) if the build fails; the
    failure is recorded so that imports with SMF_KERNELS_BUILD_EXT=1 do not retry it.
    """
    digest = source_hash()
    if digest is None:
        raise RuntimeError(f"cannot build the extension: sources not found at {SOURCE_DIR} (needs a source checkout)")
    directory = build_dir(digest)
    library = _built_library(directory)
    if library is not None:
        return _import_library(library)
    directory.mkdir(parents=True, exist_ok=True)
    failure = directory / "build_failed.txt"
    failure.unlink(missing_ok=True)
    logger.info("building the smf_kernels extension in %s: %d files, compiled in parallel (%s)", directory,
                len(CPU_SOURCES), BUILD_TIME)
    from torch.utils import cpp_extension

    progress = _BuildProgress(directory, list(CPU_SOURCES))
    progress.start()
    try:
        return cpp_extension.load(
            name=MODULE_NAME,
            sources=[str(SOURCE_DIR / name) for name in CPU_SOURCES],
            extra_cflags=_compile_flags(digest),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=verbose,
        )
    except Exception as exc:
        failure.write_text(f"{type(exc).__name__}: {exc}\n")
        raise RuntimeError(f"building the smf_kernels extension failed (recorded in {failure}): {exc}") from exc
    finally:
        progress.stop()


def load_extension() -> ModuleType:
    """The compiled extension matching the current sources; ImportError saying how to build it if none."""
    digest = source_hash()
    stale = ""
    try:
        module = importlib.import_module(f"smf_kernels.{MODULE_NAME}")  # built in place by setup.py
    except ImportError:
        module = None
    if module is not None:
        if digest is None or module.source_hash == digest:
            return module
        stale = f"the in-place build {module.__file__} is stale (csrc/ changed since); "
    if digest is None:
        raise ImportError(f"the compiled extension is not built and its sources ({SOURCE_DIR}) are missing")
    directory = build_dir(digest)
    library = _built_library(directory)
    if library is not None:
        return _import_library(library)
    if os.environ.get(BUILD_ENV_VAR, "0") not in ("", "0"):
        failure = directory / "build_failed.txt"
        if failure.exists():
            raise ImportError(
                f"{stale}an earlier build of the compiled extension failed (see {failure}); "
                "fix it, then run `python -m smf_kernels.build_ext` to retry"
            )
        try:
            return build()
        except RuntimeError as exc:
            raise ImportError(str(exc)) from exc
    raise ImportError(f"{stale}the compiled extension is not built for these sources: {HOW_TO_BUILD}")


def setup_extensions() -> list:
    """setup.py's extension modules: ``smf_kernels._ext``, with CUDA kernels when torch has CUDA and the CUDA toolkit
    it finds has its headers (torch guesses ``CUDA_HOME`` from any ``nvcc`` on the PATH, a wrapper without a toolkit
    too: the build then stays CPU-only, with a warning, instead of failing on a missing ``cuda_runtime.h``)."""
    from torch.utils import cpp_extension

    digest = source_hash()
    sources = [str(SOURCE_DIR / name) for name in CPU_SOURCES]
    cxx = _compile_flags(digest)
    home = cpp_extension.CUDA_HOME
    if torch.version.cuda is not None and home is not None and not (Path(home) / "include/cuda_runtime.h").is_file():
        logger.warning("CUDA_HOME %s holds no include/cuda_runtime.h (an nvcc without the CUDA toolkit?): building the "
                       "extension's CPU kernels only; set CUDA_HOME to the toolkit for its CUDA kernels", home)
        home = None
    if torch.version.cuda is not None and home is not None:
        return [
            cpp_extension.CUDAExtension(
                f"smf_kernels.{MODULE_NAME}",
                sources + [str(SOURCE_DIR / name) for name in CUDA_SOURCES],
                extra_compile_args={"cxx": [*cxx, "-DSMF_WITH_CUDA"], "nvcc": list(NVCC_FLAGS)},
                extra_link_args=["-fopenmp"],
            )
        ]
    return [
        cpp_extension.CppExtension(
            f"smf_kernels.{MODULE_NAME}", sources, extra_compile_args=cxx, extra_link_args=["-fopenmp"]
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the smf_kernels compiled extension (CPU kernels).")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = build(verbose=args.verbose)
    print(f"smf_kernels extension ready: {module.__file__}")


if __name__ == "__main__":
    main()
