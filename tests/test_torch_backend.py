"""The torch backend's fast paths against the reference: torch.topk made to follow the ranking rule,
and the gather's gradients taken from embedding_bag's backward."""
import pytest
import torch

from helpers import rel_err
from smf_kernels.backends import torch_impl
from smf_kernels.reference import product_key_topk_reference, ranked_topk


@pytest.mark.parametrize("k", [1, 5, 16])
def test_ranked_topk_follows_the_reference_with_ties_nan_and_inf(k):
    scores = torch.randint(-3, 4, (300, 37)).float()  # many ties, also across the k-th place
    scores[torch.rand(scores.shape) < 0.05] = float("nan")
    scores[torch.rand(scores.shape) < 0.05] = float("inf")
    scores[torch.rand(scores.shape) < 0.05] = -float("inf")
    scores[torch.rand(scores.shape) < 0.05] = -0.0
    scores[:100] = torch.randn(100, 37)  # rows without ties: the fast path only
    got_values, got_columns = torch_impl.ranked_topk(scores, k)
    want_values, want_columns = ranked_topk(scores, k)
    assert torch.equal(got_columns, want_columns)
    assert torch.equal(got_values.nan_to_num(), want_values.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_topk_with_tied_sub_keys_equals_reference(dtype):
    query = torch.randint(-2, 3, (23, 3, 10)).to(dtype)
    keys = torch.randint(-2, 3, (3, 2, 9, 5)).to(dtype)  # integer scores: ties everywhere
    scores, slots = torch_impl.BACKEND.topk_forward(query, keys, 6)
    want_scores, want_slots = product_key_topk_reference(query, keys, 6)
    assert torch.equal(slots, want_slots) and torch.equal(scores, want_scores)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)])
def test_backward_equals_autograd_through_embedding_bag(dtype, need):
    if dtype == torch.bfloat16 and torch.get_default_device().type != "cpu":
        pytest.skip("ATen has no CUDA bf16 per-sample-weights backward to compare with")
    values = torch.randn(40, 130).to(dtype)
    indices = torch.randint(0, 40, (17, 12))
    indices[0, :3] = 5  # one token reading the same row three times
    weights = torch.softmax(torch.randn(17, 12), -1)
    grad_out = torch.randn(17, 130).to(dtype)
    got_values, got_weights = torch_impl.BACKEND.gather_backward(grad_out, values, indices, weights, None, False, *need)
    table = values.clone().requires_grad_()
    per_sample = weights.to(dtype).requires_grad_()
    out = torch.nn.functional.embedding_bag(indices, table, per_sample_weights=per_sample, mode="sum")
    want_values, want_weights = torch.autograd.grad(out, (table, per_sample), grad_out)
    assert got_values.shape[0] == (40 if need[0] else 0) and got_weights.shape[0] == (17 if need[1] else 0)
    if need[0]:
        assert got_values.dtype == torch.float32 and torch.equal(got_values, want_values.float())
    if need[1]:
        assert got_weights.dtype == torch.float32 and torch.equal(got_weights, want_weights.float())
    reference = torch.zeros(40, 130, dtype=torch.float64).index_add_(
        0, indices.flatten(), (weights.double().unsqueeze(-1) * grad_out.double().unsqueeze(1)).flatten(0, 1))
    if need[0]:
        assert rel_err(got_values, reference) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_topk_with_infinite_scores_equals_reference():
    query = torch.randn(29, 2, 12)
    keys = torch.rand(2, 2, 11, 6) * 2 - 1
    keys[0, 0, 3, 0] = float("inf")  # +inf and NaN (inf - inf) sub-key scores, -inf sums
    keys[1, 1, 5, 2] = -float("inf")
    scores, slots = torch_impl.BACKEND.topk_forward(query, keys, 7)
    want_scores, want_slots = product_key_topk_reference(query, keys, 7)
    assert torch.equal(slots, want_slots)
    assert torch.equal(scores.nan_to_num(), want_scores.nan_to_num())


def test_topk_of_finite_scores_uses_only_undominated_pairs():
    first, second = torch_impl._undominated_pairs(16, "cpu")
    assert first.numel() == sum(16 // r for r in range(1, 17))  # 50 of the 256 pairs
    assert torch.all(first[1:] * 16 + second[1:] > first[:-1] * 16 + second[:-1])  # candidate-id order
    query, keys = torch.randn(300, 4, 32), torch.rand(4, 2, 40, 16) * 2 - 1
    want = product_key_topk_reference(query, keys, 16)[1]
    assert torch.equal(torch_impl.BACKEND.topk_forward(query, keys, 16)[1], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_bag_backward_restricted_to_update_rows(dtype):
    """The path off-CPU sparse value gradients take: embedding_bag's backward over reads remapped to
    their slot in update_rows (unselected reads into a dropped scratch row)."""
    values = torch.randn(40, 130).to(dtype)
    indices = torch.randint(0, 40, (17, 12))
    weights = torch.softmax(torch.randn(17, 12), -1)
    grad_out = torch.randn(17, 130).to(dtype)
    rows = torch.randperm(40)[:9].sort().values
    got, _ = torch_impl._embedding_bag_backward(grad_out, values, indices, weights, True, False, rows)
    dense = torch.zeros(40, 130, dtype=torch.float64).index_add_(
        0, indices.flatten(), (weights.double().unsqueeze(-1) * grad_out.double().unsqueeze(1)).flatten(0, 1))
    assert got.shape == (9, 130)
    assert rel_err(got, dense[rows]) < (1e-6 if dtype == torch.float32 else 1e-2)
