"""ProductKeyMemory's projections: nn.Linear's map, initialisation and random draws, and low-precision ones on CPU
in fp32 (where the CPU has no fast bf16 GEMM)."""
import pytest
import torch

from helpers import rel_err
from smf_kernels import memory, projection
from smf_kernels.projection import MemoryProjection


def test_a_projection_is_nn_linear_but_for_its_type():
    torch.manual_seed(4)
    linear = torch.nn.Linear(13, 7)
    after_linear = torch.rand(2)
    torch.manual_seed(4)
    proj = MemoryProjection(13, 7)
    assert torch.equal(torch.rand(2), after_linear)  # the same random draws: seeded models are unchanged
    assert not isinstance(proj, torch.nn.Linear) and "Linear" not in type(proj).__name__
    assert torch.equal(proj.weight, linear.weight) and torch.equal(proj.bias, linear.bias)
    x = torch.randn(3, 5, 13)
    assert torch.equal(proj(x), linear(x))
    assert proj(x.double()).dtype == torch.float32  # computes in the weight's dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_projection_matches_and_trains_the_low_precision_weights(monkeypatch, dtype):
    monkeypatch.setattr(projection, "_cpu_lacks_fast_low_precision_gemm", lambda: True)
    proj = MemoryProjection(130, 96).to(dtype)
    x = torch.randn(37, 130).to(dtype).requires_grad_()
    out = proj(x)
    want = torch.nn.functional.linear(x.double(), proj.weight.double(), proj.bias.double())
    assert out.dtype == dtype and rel_err(out, want) < 1e-2
    grad = torch.randn(37, 96).to(dtype)
    out.backward(grad)
    assert proj.weight.grad.dtype == dtype and x.grad.dtype == dtype
    assert rel_err(proj.weight.grad, grad.double().t() @ x.detach().double()) < 1e-2


def test_layer_in_bf16_matches_fp32_layer(monkeypatch):
    monkeypatch.setattr(projection, "_cpu_lacks_fast_low_precision_gemm", lambda: True)
    layer = memory.ProductKeyMemory(96, n_keys=12, heads=2, topk=4, key_dim=16, backend="torch")
    low = memory.ProductKeyMemory(96, n_keys=12, heads=2, topk=4, key_dim=16, backend="torch").bfloat16()
    low.load_state_dict({k: v.bfloat16() for k, v in layer.state_dict().items()})
    layer.load_state_dict({k: v.float() for k, v in low.state_dict().items()})  # same rounded weights
    x = torch.randn(21, 96).bfloat16()
    assert rel_err(low(x), layer(x.float())) < 2e-2
