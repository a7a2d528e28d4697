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

import logging  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

if TEST_DEVICE != "cpu":
    torch.set_default_device(TEST_DEVICE)


def pytest_sessionstart(session):
    """Build the optional compiled extension (cached after the first time, ~1 min) so that every
    backend-parametrised test covers ``ext`` too. A failed build does not stop the session: the
    ext tests then fail on their own, saying why."""
    from smf_kernels import backends, build_ext

    try:
        build_ext.build()
    except RuntimeError as exc:
        logging.getLogger(__name__).warning("compiled extension not built: %s", exc)
    backends.refresh()


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
