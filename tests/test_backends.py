"""Backend selection: defaults, environment override, clear errors."""
import pytest
import torch

from smf_kernels import BackendUnavailableError, available_backends, resolve_backend
from smf_kernels.backends import ENV_VAR, unavailable_reason


def test_default_cpu_backend_is_the_fastest_available(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    cpu = torch.device("cpu")
    assert resolve_backend(None, cpu) == available_backends(cpu)[0]
    assert available_backends(cpu)[-1] == "torch"
    assert "triton" not in available_backends(cpu), "the interpreter is never picked by default"


def test_environment_variable_overrides(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    assert resolve_backend(None, torch.device("cpu")) == "triton"
    assert resolve_backend("torch", torch.device("cpu")) == "torch", "an explicit argument wins"
    monkeypatch.setenv(ENV_VAR, "nope")
    with pytest.raises(BackendUnavailableError, match=f"environment variable {ENV_VAR}"):
        resolve_backend(None, torch.device("cpu"))


def test_unrunnable_backends_say_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = unavailable_reason("triton", torch.device("cpu"))
    assert reason is not None and "TRITON_INTERPRET=1" in reason
    with pytest.raises(BackendUnavailableError, match="cannot run on cpu"):
        resolve_backend("triton", torch.device("cpu"))
    assert "unknown backend" in unavailable_reason("cuda", torch.device("cpu"))


def test_automatic_choice_skips_backends_without_the_dtype():
    # Availability for a CUDA device is decided without touching one: Triton is first for
    # fp32 and bf16, and skipped for float64, which it does not take.
    cuda = torch.device("cuda")
    assert available_backends(cuda, torch.float32)[0] == "triton"
    assert available_backends(cuda, torch.bfloat16)[0] == "triton"
    assert "triton" not in available_backends(cuda, torch.float64)
    assert available_backends(cuda, torch.float64)[-1] == "torch"
