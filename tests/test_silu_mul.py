"""silu_mul (the memory layer's gated read) on every backend against the float64 reference, forward and backward."""
import pytest
import torch

from helpers import TOL, backends_under_test, rel_err
from smf_kernels.ops import silu_mul
from smf_kernels.reference import silu_mul_reference

NAN, INF = float("nan"), float("inf")


def _inputs(shape, dtype):
    gate = (torch.randn(shape) * 4).to(dtype).requires_grad_()  # well into both tails of the sigmoid
    read = torch.randn(shape).to(dtype).requires_grad_()
    return gate, read


@pytest.mark.parametrize("backend", backends_under_test())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(37, 130), (2, 5, 9)])  # neither a multiple of the 8-wide vectors
def test_matches_reference_forward_and_backward(backend, dtype, shape):
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the triton backend takes no float64")
    gate, read = _inputs(shape, dtype)
    out = silu_mul(gate, read, backend=backend)
    grad = torch.randn(shape).to(dtype)
    grads = torch.autograd.grad(out, (gate, read), grad)
    g64, r64 = gate.detach().double().requires_grad_(), read.detach().double().requires_grad_()
    want = silu_mul_reference(g64, r64)
    want_grads = torch.autograd.grad(want, (g64, r64), grad.double())
    tol = TOL.get(dtype, 2e-3)  # float16: 11-bit mantissa
    assert out.dtype == dtype and out.shape == gate.shape
    assert rel_err(out, want) < tol
    for got, w, t in zip(grads, want_grads, (gate, read)):
        assert got.dtype == t.dtype and got.shape == t.shape
        assert rel_err(got, w) < tol


@pytest.mark.parametrize("backend", backends_under_test())
def test_non_finite_and_extreme_gates_follow_the_plain_composition(backend):
    """±inf, NaN, 0 and gates past exp's float range: NaN where torch's silu gives NaN, values equal elsewhere
    (the sigmoid's far tail, below 1e-30, may round to zero)."""
    gate = torch.tensor([INF, -INF, NAN, 0.0, -0.0, 88.5, -88.5, 87.0, -87.5, 100.0, -100.0, 20.0, -20.0, 3.0, -3.0,
                         0.5, 1e-3, -1e-3])
    read = torch.linspace(0.5, 2.0, gate.numel())
    gate.requires_grad_()
    read.requires_grad_()
    out = silu_mul(gate, read, backend=backend)
    got = torch.autograd.grad(out, (gate, read), torch.ones_like(out))
    g, r = gate.detach().clone().requires_grad_(), read.detach().clone().requires_grad_()
    want = silu_mul_reference(g, r)
    wanted = torch.autograd.grad(want, (g, r), torch.ones_like(want))
    for a, b in zip((out, *got), (want, *wanted)):
        assert torch.equal(a.isnan(), b.isnan())
        torch.testing.assert_close(a[~b.isnan()], b[~b.isnan()], rtol=1e-6, atol=1e-30)


def test_ops_pass_opcheck():
    gate, read = torch.randn(7, 11), torch.randn(7, 11)
    for backend in backends_under_test():
        torch.library.opcheck(torch.ops.smf_kernels.silu_mul, (gate, read, backend))
        torch.library.opcheck(torch.ops.smf_kernels.silu_mul_backward, (torch.randn(7, 11), gate, read, backend))


def test_gradcheck_float64():
    gate = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    read = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    for backend in backends_under_test():
        if backend != "triton":
            assert torch.autograd.gradcheck(lambda g, r: silu_mul(g, r, backend=backend), (gate, read))


@pytest.mark.parametrize("gate, read, error, match", [
    (torch.randn(3, 4), torch.randn(4, 3), ValueError, r"read must have the shape of gate \(3, 4\), got \(4, 3\)"),
    (torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64), TypeError, "read must have gate's dtype float32"),
    (torch.ones(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64), TypeError, "gate must have a float dtype"),
    ([1.0, 2.0], torch.randn(2), TypeError, "gate must be a torch.Tensor, got list"),
])
def test_bad_inputs_raise(gate, read, error, match):
    with pytest.raises(error, match=match):
        silu_mul(gate, read)


def test_ext_binding_checks_its_inputs():
    if "ext" not in backends_under_test():
        pytest.skip("the compiled extension is not built")
    from smf_kernels.backends import ext_impl

    with torch.device("cpu"):  # the ext's silu_mul is CPU-only (also under SMF_TEST_DEVICE=cuda)
        with pytest.raises(RuntimeError, match=r"read must have the shape of gate \[3, 4\], got \[12\]"):
            ext_impl.BACKEND.silu_mul_forward(torch.randn(3, 4), torch.randn(12))
        with pytest.raises(RuntimeError, match="grad must have the shape of gate"):
            ext_impl.BACKEND.silu_mul_backward(torch.randn(2), torch.randn(3), torch.randn(3))
        assert ext_impl.BACKEND.silu_mul_forward(torch.empty(0, 5), torch.empty(0, 5)).shape == (0, 5)
