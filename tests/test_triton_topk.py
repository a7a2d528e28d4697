"""Triton top-k selects exactly what the reference selects, ties and non-finite scores included.

Inputs are small integers, so every score is exact in fp32 (and bf16 products are
exact too): the kernel and the float64 reference must agree bit for bit, ties
resolved to the lower sub-key / candidate id. Runs under the interpreter on CPU.
"""
import pytest
import torch

from smf_kernels.triton_kernels import topk as triton_topk
from smf_kernels.reference import product_key_topk_reference

INF, NAN = float("inf"), float("nan")


def _integer_inputs(n, heads, key_dim, n_keys, dtype):
    query = torch.randint(-2, 3, (n, heads, key_dim)).to(dtype)
    keys = torch.randint(-2, 3, (heads, 2, n_keys, key_dim // 2)).to(dtype)
    return query, keys


def _assert_same_selection(query, keys, topk):
    scores, slots = (t.cpu() for t in triton_topk.product_key_topk(query, keys, topk))
    # the reference in the kernels' own fp32 (exact for these inputs; fp32 overflow included), on CPU
    ref_scores, ref_slots = product_key_topk_reference(query.float().cpu(), keys.float().cpu(), topk)
    assert slots.min() >= 0 and slots.max() < keys.shape[2] ** 2, "slot ids must stay in range"
    assert torch.equal(slots, ref_slots), (slots != ref_slots).nonzero()[:5]
    torch.testing.assert_close(scores, ref_scores, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 2, 16, 12, 5), (5, 1, 34, 7, 7), (18, 1, 32, 20, 16), (17, 1, 8, 5, 1)])
def test_ties_resolve_as_the_reference(dtype, shape):
    n, heads, key_dim, n_keys, topk = shape
    query, keys = _integer_inputs(n, heads, key_dim, n_keys, dtype)
    _assert_same_selection(query, keys, topk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_and_inf_rank_as_the_reference(dtype):
    """NaN > +inf > finite > -inf, ties to the lower id; +inf meeting -inf (NaN sums at a
    non-monotone pair) in some rows takes the exact all-pairs path for their block."""
    query, keys = _integer_inputs(40, 2, 16, 12, torch.float32)
    keys[:, :, :, 0] = 2.0  # dim 0 of each half: > 0 (and -3e38 * 2 overflows to -inf)
    keys[:, :, 3, 0] = 0  # ... except sub-key 3: inf * 0 = NaN there
    half = 8
    query[0, :, 0] = NAN                                   # a NaN half: every pair NaN
    query[1, :, half] = INF                                # +inf in the second half (NaN at sub-key 3)
    query[2, :, 0] = -INF                                  # -inf first half
    query[3, :, 0], query[3, :, half] = -INF, INF          # -inf meets +inf
    query[4, :, 0], query[4, :, half] = INF, -INF          # +inf meets -inf
    query[5] = 0.0                                         # all scores zero: ties everywhere
    query[6, :, 1], query[6, :, half] = NAN, -INF
    query[7, :, :], query[7, :, 0], query[7, :, half] = 0.0, -3e38, INF  # overflow: a = [0, -inf, ...],
    # b = [NaN, +inf, ...]: the reference's top-5 holds pairs (1, 2) and (1, 3), outside (ia+1)(ib+1) <= 5
    query[20, :, 0], query[20, :, half] = -INF, INF        # a mixed row in the second block too
    query[21, 0, 3] = -0.0
    query, keys = query.to(dtype), keys.to(dtype)
    _assert_same_selection(query, keys, 5)


def test_blocks_without_infinities_use_the_pruned_candidates():
    """(ia+1)(ib+1) <= k: 50 pairs for k = 16 (padded to 64), every pair dominated by fewer than k."""
    pairs = triton_topk._candidate_pairs(16, 16, torch.device("cpu"))
    live = pairs[pairs >= 0]
    assert pairs.numel() == 64 and live.numel() == 50
    ia, ib = live // 16, live % 16
    assert torch.all((ia + 1) * (ib + 1) <= 16)
