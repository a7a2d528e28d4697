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

import contextlib  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

if TEST_DEVICE != "cpu":
    torch.set_default_device(TEST_DEVICE)


def pytest_sessionstart(session):
    """Build the optional compiled extension (cached after the first time) so that every backend-parametrised
    test covers ``ext`` too, unless one built for these sources is importable already (the cache's, or
    setup.py's in-place build). A failed build does not stop the session: the ext tests then fail on their own,
    saying why."""
    from smf_kernels import backends, build_ext

    try:
        build_ext.load_extension()
    except ImportError:
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


@pytest.fixture(autouse=True)
def _seed_and_restore_determinism():
    """Fresh, reproducible random inputs per test; restore global torch flags after."""
    torch.manual_seed(0)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(was_deterministic)


@pytest.fixture
def one_thread():
    """One torch thread for the training tests of the tiny model even when OMP_NUM_THREADS overrides the session's
    one: the tiny model gains nothing from threads, and several processes' threads only spin-wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
