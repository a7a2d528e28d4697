"""ProductKeyMemory's low-precision CPU projections in fp32 (where the CPU has no fast bf16 GEMM)."""
import pytest
import torch

from helpers import rel_err
from smf_kernels import memory


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_projection_matches_and_trains_the_low_precision_weights(monkeypatch, dtype):
    monkeypatch.setattr(memory, "_cpu_lacks_fast_low_precision_gemm", lambda: True)
    proj = torch.nn.Linear(130, 96).to(dtype)
    x = torch.randn(37, 130).to(dtype).requires_grad_()
    out = memory._linear(proj, x)
    want = torch.nn.functional.linear(x.double(), proj.weight.double(), proj.bias.double())
    assert out.dtype == dtype and rel_err(out, want) < 1e-2
    grad = torch.randn(37, 96).to(dtype)
    out.backward(grad)
    assert proj.weight.grad.dtype == dtype and x.grad.dtype == dtype
    assert rel_err(proj.weight.grad, grad.double().t() @ x.detach().double()) < 1e-2


def test_layer_in_bf16_matches_fp32_layer(monkeypatch):
    monkeypatch.setattr(memory, "_cpu_lacks_fast_low_precision_gemm", lambda: True)
    layer = memory.ProductKeyMemory(96, n_keys=12, heads=2, topk=4, key_dim=16, backend="torch")
    low = memory.ProductKeyMemory(96, n_keys=12, heads=2, topk=4, key_dim=16, backend="torch").bfloat16()
    low.load_state_dict({k: v.bfloat16() for k, v in layer.state_dict().items()})
    layer.load_state_dict({k: v.float() for k, v in low.state_dict().items()})  # same rounded weights
    x = torch.randn(21, 96).bfloat16()
    assert rel_err(low(x), layer(x.float())) < 2e-2
