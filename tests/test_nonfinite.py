"""Non-finite scores rank the same on every backend: the reference's rule (README, "Non-finite scores").

torch.topk's order made total: NaN above +inf above every finite value above -inf, equal scores
(NaNs included) to the lower sub-key / candidate id. Each backend's product_key_topk must return
exactly the reference's slot ids, and NaN / inf scores exactly where the reference has them.
"""
from __future__ import annotations

import pytest
import torch

from smf_kernels.backends import unavailable_reason
from smf_kernels.ops import product_key_topk
from smf_kernels.reference import product_key_topk_reference, ranked_topk

BACKENDS = ["torch", "ext", "triton"]

NAN, INF = float("nan"), float("inf")


def _available(backend: str) -> None:
    reason = unavailable_reason(backend, torch.get_default_device())
    if reason is not None:
        pytest.skip(reason)


def _assert_same_as_reference(query, keys, topk, backend):
    scores, indices = (t.cpu() for t in product_key_topk(query, keys, topk, backend=backend))
    # The oracle runs on CPU wherever the backend runs: a GPU matmul need not give inf - inf = NaN.
    ref_scores, ref_indices = product_key_topk_reference(query.cpu(), keys.cpu(), topk)
    assert torch.equal(indices, ref_indices)
    assert torch.equal(scores.isnan(), ref_scores.isnan())
    assert torch.equal(scores.isinf() & (scores > 0), ref_scores.isinf() & (ref_scores > 0))
    assert torch.equal(scores.isinf() & (scores < 0), ref_scores.isinf() & (ref_scores < 0))
    finite = ref_scores.isfinite()
    torch.testing.assert_close(scores[finite], ref_scores[finite], rtol=1e-5, atol=1e-5)


def test_ranked_topk_orders_nan_then_inf_then_finite_then_minus_inf_with_ties_to_the_lower_id():
    scores = torch.tensor([[1.0, -INF, NAN, INF, 1.0, NAN, -2.0]])
    values, ids = ranked_topk(scores, 7)
    assert ids.tolist() == [[2, 5, 3, 0, 4, 6, 1]]
    assert values[0, 2:].tolist() == [INF, 1.0, 1.0, -2.0, -INF]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("where", ["query_nan", "key_nan", "key_inf", "key_minus_inf", "query_inf", "mixed"])
@pytest.mark.parametrize("n_keys", [21, 24])  # 24: the ext's vector selection (n_keys a multiple of 8)
def test_topk_with_non_finite_inputs_matches_the_reference(backend, dtype, where, n_keys):
    _available(backend)
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the triton backend takes no float64")
    if backend == "torch" and dtype == torch.float64 and torch.get_default_device().type == "cuda":
        pytest.skip("the torch backend's float64 matmul on CUDA is cuBLAS's, which does not always give "
                    "inf - inf = NaN (README, 'Non-finite scores')")
    n, heads, key_dim, topk = 37, 3, 18, 5
    query = torch.randn(n, heads, key_dim, dtype=dtype)
    keys = torch.randn(heads, 2, n_keys, key_dim // 2, dtype=dtype)
    if where == "query_nan":
        query[::3, 0, 1] = NAN
        query[5, :, key_dim // 2 + 2] = NAN
    elif where == "key_nan":
        keys[0, 0, 4, :] = NAN
        keys[2, 1, 7, 0] = NAN
    elif where == "key_inf":
        keys[1, 0, 3, 2] = INF  # +inf or -inf sub-scores, by the sign of the query entry
        keys[0, 1, 11, :] = INF  # mixed-sign query: inf - inf = NaN
    elif where == "key_minus_inf":
        keys[:, 0, :n_keys - 2, :] = -INF  # most first-half sub-scores are +-inf or NaN
    elif where == "query_inf":
        query[::4, 1, 0] = INF
        query[1::4, 2, key_dim // 2] = -INF
    else:
        keys[0, 0, 2, 1] = NAN
        keys[1, 1, 5, 0] = INF
        keys[2, 0, 9, 3] = -INF
        query[7, :, 3] = INF
    _assert_same_as_reference(query, keys, topk, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_all_nan_and_all_tied_scores_pick_the_lowest_ids(backend):
    _available(backend)
    heads, key_dim, n_keys, topk = 2, 8, 20, 16  # topk 16: the vector path's largest k
    query = torch.randn(4, heads, key_dim)
    keys = torch.randn(heads, 2, n_keys, key_dim // 2)
    query[0] = NAN  # every score NaN
    query[1] = 0.0  # every score 0: all tied
    keys[1, 1] = INF
    _assert_same_as_reference(query, keys, topk, backend)
    scores, indices = product_key_topk(query, keys, topk, backend=backend)
    assert indices[0, 0].tolist() == list(range(topk))  # candidates ia = 0, ib = 0..k-1: sub-keys (0, j)


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_with_infinite_sub_scores_of_opposite_sign_ranks_their_nan_sum_first(backend):
    _available(backend)
    n_keys, topk = 6, 3
    query = torch.ones(1, 1, 2)
    keys = torch.randn(1, 2, n_keys, 1)
    keys[0, 0, 4, 0] = INF  # first half: +inf best
    keys[0, 1, :, 0] = torch.tensor([0.5, -INF, 0.3, -INF, -INF, -INF])  # second half: two finite, then -inf
    _assert_same_as_reference(query, keys, topk, backend)
    scores, _ = product_key_topk(query, keys, topk, backend=backend)
    assert scores[0, 0, 0].isnan() and bool(scores[0, 0, 1:].isinf().all())
