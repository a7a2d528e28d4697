"""The triton backend's top-k backward kernels (smf_kernels/triton_kernels/topk_backward.py) against float64.

Under the CPU interpreter each program instance costs tens of milliseconds: small shapes, few programs.
"""
import pytest
import torch

from helpers import rel_err
from smf_kernels.backends import unavailable_reason
from smf_kernels.reference import product_key_topk_reference

pytestmark = pytest.mark.skipif(unavailable_reason("triton", torch.get_default_device()) is not None,
                                reason="the triton backend cannot run here")

# (N, heads, key_dim, n_keys, topk): N not a multiple of the 32-token blocks, halves (12, 17, 20) and
# n_keys (20, 7, 70) not powers of two, topk < 16 and = n_keys, 1 to 3 heads, two sub-key tiles (70 > 64).
SHAPES = [(37, 3, 24, 20, 5), (19, 1, 34, 7, 7), (45, 2, 40, 70, 16)]


def _backend():
    from smf_kernels.backends import triton_impl
    return triton_impl.BACKEND


def _inputs(shape, dtype):
    n, heads, key_dim, n_keys, topk = shape
    query = torch.randn(n, heads, key_dim).to(dtype)
    keys = (torch.rand(heads, 2, n_keys, key_dim // 2) * 2 - 1).to(dtype)
    _, slots = product_key_topk_reference(query, keys, topk)  # picks that share sub-keys, as in training
    return query, keys, slots, torch.randn(n, heads, topk)


def _reference(grad, query, keys, slots):
    """float64 gradients of the picked slots' scores (the backward's definition) by autograd."""
    q = query.detach().double().requires_grad_(True)
    k = keys.detach().double().requires_grad_(True)
    n_keys, half = keys.shape[2], keys.shape[3]
    heads = torch.arange(keys.shape[0]).view(1, -1, 1).expand_as(slots)
    scores = ((q[..., :half].unsqueeze(2) * k[heads, 0, slots // n_keys]).sum(-1)
              + (q[..., half:].unsqueeze(2) * k[heads, 1, slots % n_keys]).sum(-1))
    return torch.autograd.grad(scores, (q, k), grad.double())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_gradients_match_float64(shape, dtype):
    query, keys, slots, grad = _inputs(shape, dtype)
    grad_query, grad_keys = _backend().topk_backward(grad, query, keys, slots, True, True)
    want_query, want_keys = _reference(grad, query, keys, slots)
    assert grad_query.dtype == grad_keys.dtype == torch.float32
    assert grad_query.shape == query.shape and grad_keys.shape == keys.shape
    # Sums in fp32. bf16: every product exact (the key gradient's three bf16 parts; without the last part
    # the error is ~1e-5). fp32 on a GPU: split TF32 products, ~22 significant bits.
    tol = 2e-6 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(grad_query, want_query) < tol
    assert rel_err(grad_keys, want_keys) < tol


def test_float16_matches_float64():
    query, keys, slots, grad = _inputs(SHAPES[0], torch.float16)
    got = _backend().topk_backward(grad, query, keys, slots, True, True)
    for g, w in zip(got, _reference(grad, query, keys, slots)):
        assert rel_err(g, w) < 1e-5


@pytest.mark.parametrize("need", [(True, False), (False, True), (False, False)])
def test_only_the_needed_gradients_are_computed(need):
    query, keys, slots, grad = _inputs(SHAPES[0], torch.float32)
    both = _backend().topk_backward(grad, query, keys, slots, True, True)
    got = _backend().topk_backward(grad, query, keys, slots, *need)
    for g, full, needed in zip(got, both, need):
        if needed:
            assert torch.equal(g, full)
        else:
            assert g.numel() == 0


def test_key_gradient_summed_over_several_chunks(monkeypatch):
    """Chunks of 32 tokens (the paper shape has 32 chunks of 512): the partials are added in chunk order,
    and the result is the same bits on every run."""
    from smf_kernels.triton_kernels import topk_backward as kernels

    config = kernels.key_grad_config
    monkeypatch.setattr(kernels, "key_grad_config",
                        lambda n_keys, half: dict(config(n_keys, half), min_chunk_tokens=32))
    n, heads, key_dim, n_keys, topk = 100, 1, 32, 12, 4
    query, keys, _, grad = _inputs((n, heads, key_dim, n_keys, topk), torch.float32)
    slots = torch.randint(0, n_keys * n_keys, (n, heads, topk))  # repeats included
    _, partials = kernels.plan_topk_key_grad(grad, query, slots, n_keys, kernels.new_error_flag(query.device))
    assert partials.shape[0] == 4  # 3 full chunks of 32 tokens and one of 4
    runs = [_backend().topk_backward(grad, query, keys, slots, False, True)[1] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert rel_err(runs[0], _reference(grad, query, keys, slots)[1]) < 1e-5


def test_backward_is_bit_reproducible():
    query, keys, slots, grad = _inputs(SHAPES[0], torch.bfloat16)
    first, second = (_backend().topk_backward(grad, query, keys, slots, True, True) for _ in range(2))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf * 0
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_score_gradients_follow_the_reference(dtype):
    """NaN and +-inf in grad_scores reach exactly the gradient entries they reach in float64, with the
    same sign (inf * 0 = NaN where a sub-key or query entry is zero, inf - inf = NaN where two meet)."""
    query, keys, slots, grad = _inputs(SHAPES[0], dtype)
    query[3, 1, 5] = 0.0  # an exact zero times inf: NaN in the reference too
    grad[0, 0, 1] = float("nan")
    grad[4, 1, 0] = float("inf")
    grad[9, 2, 3] = float("-inf")
    grad[3, 1, 2] = float("inf")
    got = _backend().topk_backward(grad, query, keys, slots, True, True)
    for g, w in zip(got, _reference(grad, query, keys, slots)):
        assert (g.isnan() == w.isnan()).all()
        assert (g.isinf() == w.isinf()).all() and (g[w.isinf()] == w[w.isinf()].float()).all()
        finite = w.isfinite()
        assert finite.any() and rel_err(g[finite], w[finite]) < 1e-5


@pytest.mark.parametrize("need", [(True, False), (False, True)])
@pytest.mark.parametrize("bad", [-1, 20 * 20])
def test_out_of_range_slots_raise(need, bad):
    """Called directly (no host-side check before it): each kernel guards every access through a slot."""
    query, keys, slots, grad = _inputs(SHAPES[0], torch.float32)
    slots[30, 2, 4] = bad
    with pytest.raises(RuntimeError, match=r"indices must lie in \[0, n_keys\*\*2 = 400\)"):
        _backend().topk_backward(grad, query, keys, slots, *need)


def test_no_tokens():
    query, keys, slots, grad = _inputs((0, 2, 16, 9, 3), torch.float32)
    grad_query, grad_keys = _backend().topk_backward(grad, query, keys, slots, True, True)
    assert grad_query.shape == (0, 2, 16)
    assert torch.equal(grad_keys, torch.zeros(keys.shape))


def test_backward_op_passes_opcheck():
    query, keys, slots, grad = _inputs((9, 2, 16, 6, 3), torch.float32)
    torch.library.opcheck(torch.ops.smf_kernels.product_key_topk_backward,
                          (grad, query, keys, slots, "triton", True, True))
