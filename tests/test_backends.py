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


README_OPS = {"`product_key_topk` forward": "topk_forward", "`product_key_topk` backward": "topk_backward",
              "`weighted_gather` forward": "gather_forward", "`weighted_gather` backward": "gather_backward",
              "`silu_mul`": "silu_mul_forward", "`row_adamw_`": "row_adamw"}


def _readme_op_table() -> dict[tuple[str, str], str]:
    """{(method, backend): cell} from docs/library.md's table of each op on each backend."""
    from pathlib import Path

    lines = (Path(__file__).parents[1] / "docs" / "library.md").read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| op | `triton` | `ext` | `torch` |"))
    cells = {}
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        op, *per_backend = (cell.strip() for cell in line.strip("|").split("|"))
        method = next(m for prefix, m in README_OPS.items() if op.startswith(prefix))
        cells.update({(method, name): cell for name, cell in zip(("triton", "ext", "torch"), per_backend)})
    return cells


@pytest.mark.parametrize("name", ["triton", "ext"])
def test_the_readme_says_which_op_of_a_backend_runs_as_torch(name):
    """Each backend is a Backend whose ops without a kernel of its own are the torch backend's methods; the
    docs/library.md's table says "kernel" exactly for the ops the backend's class overrides, "**torch**" for the others."""
    from smf_kernels.backends import Backend, construction_error, implementation

    if construction_error(name) is not None:
        pytest.skip(construction_error(name))
    backend = implementation(name)
    assert isinstance(backend, Backend) and backend.name == name
    cells = _readme_op_table()
    assert {method for method, _ in cells} == set(README_OPS.values())
    for method in README_OPS.values():
        overridden = getattr(type(backend), method) is not getattr(Backend, method)
        assert cells[method, name].startswith("kernel" if overridden else "**torch**"), (method, cells[method, name])


def test_a_memory_forward_chooses_its_backend_once(monkeypatch):
    """The automatic choice (environment, then each backend's availability) runs once per ProductKeyMemory
    forward, for both of its ops; the ops check only that the chosen backend runs."""
    from smf_kernels import ProductKeyMemory, backends

    monkeypatch.delenv(ENV_VAR, raising=False)
    choices = []
    choose = backends.available_backends
    monkeypatch.setattr(backends, "available_backends", lambda *args: choices.append(args) or choose(*args))
    memory = ProductKeyMemory(16, n_keys=6, heads=2, topk=3, key_dim=8)
    memory(torch.randn(2, 3, 16)).square().sum().backward()
    assert len(choices) == 1
