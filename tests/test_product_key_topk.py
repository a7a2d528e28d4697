"""product_key_topk: every backend against the reference; the reference against brute force."""
import pytest
import torch

from helpers import TOL, backends_under_test, rel_err
from smf_kernels.ops import product_key_topk
from smf_kernels.reference import product_key_topk_reference

BACKENDS = backends_under_test()
# (N, heads, key_dim, n_keys, topk): awkward sizes (N not a multiple of any block,
# halves and n_keys not powers of two) and the paper's per-head shape.
SHAPES = [(37, 2, 96, 20, 5), (19, 4, 256, 128, 16), (3, 1, 34, 7, 7)]


def _inputs(shape, dtype):
    n, heads, key_dim, n_keys, _ = shape
    query = torch.randn(n, heads, key_dim).to(dtype)
    keys = (torch.rand(heads, 2, n_keys, key_dim // 2) * 2 - 1).to(dtype)
    return query, keys


def test_reference_equals_brute_force_over_all_slots():
    query, keys = _inputs((11, 3, 24, 9, 6), torch.float64)
    scores, slots = product_key_topk_reference(query, keys, 6)
    n_keys, half = 9, 12
    full = (torch.einsum("nhd,hkd->nhk", query[..., :half], keys[:, 0]).unsqueeze(-1)
            + torch.einsum("nhd,hkd->nhk", query[..., half:], keys[:, 1]).unsqueeze(-2))
    brute_scores, brute_slots = full.flatten(-2).topk(6, dim=-1)  # slot = i * n_keys + j
    torch.testing.assert_close(scores, brute_scores)
    assert torch.equal(slots, brute_slots)
    assert slots.max() < n_keys * n_keys


def _assert_topk_matches(scores, slots, query, keys, topk):
    """Robust comparison: tie-free random inputs can still differ in the last bit of
    a sum, so require matching scores, consistent slots, and >=99% identical slots."""
    ref_scores, ref_slots = product_key_topk_reference(query.double(), keys.double(), topk)
    tol = TOL[query.dtype]
    assert scores.dtype == torch.float32 and slots.dtype == torch.int64
    assert scores.shape == slots.shape == ref_slots.shape
    assert rel_err(scores, ref_scores) < tol
    assert torch.all(scores[..., :-1] >= scores[..., 1:]), "scores must be sorted descending"
    n_keys, half = keys.shape[2], keys.shape[3]
    i, j = slots // n_keys, slots % n_keys
    heads = torch.arange(keys.shape[0]).view(1, -1, 1).expand_as(i)
    q, k = query.double(), keys.double()
    recomputed = ((q[..., :half].unsqueeze(2) * k[heads, 0, i]).sum(-1)
                  + (q[..., half:].unsqueeze(2) * k[heads, 1, j]).sum(-1))
    assert rel_err(scores, recomputed) < tol, "scores must be those of the returned slots"
    assert (slots == ref_slots).float().mean() >= 0.99
    assert torch.all(slots.sort(-1).values[..., 1:] != slots.sort(-1).values[..., :-1]), "slots must be distinct"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_reference(backend, shape, dtype):
    query, keys = _inputs(shape, dtype)
    scores, slots = product_key_topk(query, keys, shape[4], backend=backend)
    _assert_topk_matches(scores, slots, query, keys, shape[4])


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_matches_reference(backend):
    query, keys = _inputs(SHAPES[0], torch.float32)
    query.requires_grad_(True)
    keys.requires_grad_(True)
    scores, slots = product_key_topk(query, keys, 5, backend=backend)
    ref_scores, ref_slots = product_key_topk_reference(query, keys, 5)
    assert torch.equal(slots, ref_slots)
    grad = torch.randn_like(scores)
    got = torch.autograd.grad(scores, (query, keys), grad)
    want = torch.autograd.grad(ref_scores, (query, keys), grad)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5


def test_reference_gradcheck_float64():
    query, keys = _inputs((5, 2, 8, 6, 3), torch.float64)
    query.requires_grad_(True)
    keys.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda q, k: product_key_topk_reference(q, k, 3)[0], (query, keys))


def test_custom_op_gradcheck_float64_and_opcheck():
    query, keys = _inputs((5, 2, 8, 6, 3), torch.float64)
    query.requires_grad_(True)
    keys.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda q, k: product_key_topk(q, k, 3, backend="torch")[0], (query, keys))
    torch.library.opcheck(torch.ops.smf_kernels.product_key_topk.default, (query, keys, 3, "torch"))


@pytest.mark.parametrize("backend", [name for name in BACKENDS if name != "triton"])  # triton: no float64
def test_gradcheck_float64_through_each_backend(backend):
    """Each backend's own top-k backward (ext: the fused CPU kernel) in float64."""
    query, keys = _inputs((7, 3, 10, 6, 4), torch.float64)
    query.requires_grad_(True)
    keys.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda q, k: product_key_topk(q, k, 4, backend=backend)[0], (query, keys))


def test_deterministic_backward_is_bit_reproducible():
    torch.use_deterministic_algorithms(True)
    query, keys = _inputs(SHAPES[1], torch.float32)
    query.requires_grad_(True)
    keys.requires_grad_(True)
    grad = torch.randn(19, 4, 16)
    runs = [torch.autograd.grad(product_key_topk(query, keys, 16)[0], (query, keys), grad) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize(
    "query_shape, keys_shape, topk, error, match",
    [
        ((4, 2, 8), (2, 2, 6, 4), 0, ValueError, "topk must lie in"),
        ((4, 2, 8), (2, 2, 6, 4), 7, ValueError, "topk must lie in"),
        ((4, 8), (2, 2, 6, 4), 3, ValueError, "query must have shape"),
        ((4, 2, 8), (2, 2, 6, 5), 3, ValueError, "keys must have shape"),
        ((4, 3, 8), (2, 2, 6, 4), 3, ValueError, "keys must have shape"),
        ((4, 2, 7), (2, 2, 6, 4), 3, ValueError, "must be even"),
    ],
)
def test_bad_shapes_raise(query_shape, keys_shape, topk, error, match):
    with pytest.raises(error, match=match):
        product_key_topk(torch.randn(query_shape), torch.randn(keys_shape), topk)


def test_bad_dtypes_and_devices_raise():
    query, keys = torch.randn(4, 2, 8), torch.randn(2, 2, 6, 4)
    with pytest.raises(TypeError, match="share a dtype"):
        product_key_topk(query, keys.double(), 3)
    with pytest.raises(TypeError, match="query must have dtype"):
        product_key_topk(query.long(), keys, 3)
    with pytest.raises(TypeError, match="topk must be an int"):
        product_key_topk(query, keys, 3.0)
    with pytest.raises(ValueError, match="same device"):
        product_key_topk(query, keys.to("meta"), 3)
