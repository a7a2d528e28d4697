"""Test-wide environment. Must run before any module defines a @triton.jit kernel.

``SMF_TEST_DEVICE=cuda pytest tests/test_weighted_gather.py ...`` runs the kernel tests on a GPU:
tensors the tests create land there (torch's default device) and Triton compiles for it.
"""
import os

TEST_DEVICE = os.environ.get("SMF_TEST_DEVICE", "cpu")
# Triton kernels run on CPU only through the interpreter; it must be enabled
# before triton.jit decorators execute (i.e. before smf_kernels is imported).
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# No network here: make every Hugging Face hub call fail at once instead of
# hanging ~47 s per call.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch (OpenMP) thread per test process, and per process a test starts: the tests' matrices are small, and on
# a machine other jobs load, a second thread makes them 15-30x slower (README, "Tests and threads"). Override:
# OMP_NUM_THREADS=4 python -m pytest ...
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _inductor_cache_dir() -> str:
    """A torch.compile (inductor) cache directory for this version of smf_kernels' sources: inductor's on-disk cache
    keys a graph by the names of the custom ops it calls, not their signatures, so a graph cached while an op had
    other arguments (another checkout, another branch) would be replayed against this one and fail."""
    import hashlib
    import pathlib
    import tempfile

    digest = hashlib.sha256()
    package = pathlib.Path(__file__).resolve().parent.parent / "smf_kernels"
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return os.path.join(tempfile.gettempdir(), f"torchinductor_smf_{digest.hexdigest()[:16]}")


os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _inductor_cache_dir())

import contextlib  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402


class _StartupProgress(threading.Thread):
    """A line on stderr every ``EVERY_SECONDS`` from pytest's configuration to the end of collection (after the first
    ``EVERY_SECONDS``): importing torch, loading the extension, then the test files collected and the one being
    imported. This takes a minute and more on a loaded machine, and under ``-q`` pytest shows nothing until it ends.
    Written to a duplicate of the terminal's stderr, so pytest's capture of each import does not swallow it, and
    never to stdout (``--co -q | tail -1`` still reads the count)."""

    EVERY_SECONDS = 5

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stderr = os.dup(2)
        self.started = time.perf_counter()
        self.doing = "starting"
        self.files = None  # test files collected, once collection starts
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.EVERY_SECONDS):
            seconds = time.perf_counter() - self.started
            if self.files is None:
                line = f"pytest: {self.doing} ({seconds:.0f} s)"
            else:
                importing = f", importing {self.doing}" if self.doing else ""
                line = f"collecting tests: {self.files} files done{importing} ({seconds:.0f} s)"
            os.write(self.stderr, f"{line}\n".encode())

    def stop(self) -> None:
        self.done.set()
        self.join()
        os.close(self.stderr)


_startup_progress: list[_StartupProgress] = []  # the running one, if any


def pytest_configure(config):
    """Import torch (and set the test device) once pytest has started, under the startup's progress lines, shown
    unless pytest shows its own (a terminal, without ``-q``) and stopped when collection ends."""
    if config.option.verbose < 0 or not sys.stderr.isatty():
        _startup_progress.append(_StartupProgress())
        _startup_progress[0].doing = "importing torch"
        _startup_progress[0].start()
    import torch

    if TEST_DEVICE != "cpu":
        torch.set_default_device(TEST_DEVICE)


def pytest_sessionstart(session):
    """Build the optional compiled extension (cached after the first time) so that every backend-parametrised
    test covers ``ext`` too, unless one built for these sources is importable already (the cache's, or
    setup.py's in-place build). A failed build does not stop the session: the ext tests then fail on their own,
    saying why."""
    if _startup_progress:
        _startup_progress[0].doing = "importing smf_kernels, loading the compiled extension"
    from smf_kernels import backends, build_ext

    try:
        build_ext.load_extension()
    except ImportError:
        if _startup_progress:
            _startup_progress[0].doing = "building the compiled extension (a line per compiled file)"
        with _build_progress_shown(session):
            try:
                build_ext.build()
            except RuntimeError as exc:
                logging.getLogger(__name__).warning("compiled extension not built: %s", exc)
    backends.refresh()


@contextlib.contextmanager
def _build_progress_shown(session):
    """The build's log lines (one per compiled file) on the terminal: a first build takes minutes on a loaded
    machine, and pytest would otherwise show nothing until it ends."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    build_logger = logging.getLogger("smf_kernels.build_ext")
    level = build_logger.level
    build_logger.addHandler(handler)
    build_logger.setLevel(logging.INFO)
    capture = session.config.pluginmanager.getplugin("capturemanager")
    try:
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            yield
    finally:
        build_logger.removeHandler(handler)
        build_logger.setLevel(level)


def pytest_collection(session):
    if _startup_progress:
        _startup_progress[0].files, _startup_progress[0].doing = 0, ""


def pytest_collectstart(collector):
    if _startup_progress and isinstance(collector, pytest.Module):
        _startup_progress[0].doing = collector.nodeid


def pytest_collectreport(report):
    if _startup_progress and report.nodeid.endswith(".py"):
        _startup_progress[0].files += 1
        _startup_progress[0].doing = ""


def pytest_collection_finish(session):
    if _startup_progress:
        _startup_progress.pop().stop()


def pytest_unconfigure(config):
    """Stop the progress lines where collection never finished (an error, an interrupt)."""
    if _startup_progress:
        _startup_progress.pop().stop()


@pytest.fixture(autouse=True)
def _seed_and_restore_determinism():
    """Fresh, reproducible random inputs per test; restore global torch flags after."""
    import torch

    torch.manual_seed(0)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(was_deterministic)


@pytest.fixture
def one_thread():
    """One torch thread for the training tests of the tiny model even when OMP_NUM_THREADS overrides the session's
    one: the tiny model gains nothing from threads, and several processes' threads only spin-wait."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
