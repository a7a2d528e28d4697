"""The ext CPU top-k's bf16 pre-screen (csrc/cpu_topk.cpp, AVX512_BF16 builds, n_keys >= 512 and at least 192
tokens a call): it must give the fp32 tiles' results bit for bit, never dropping a true top-k member.

The oracle is the same kernel without the pre-screen: each token's result does not depend on the others, and calls
of fewer than 192 tokens score every sub-key exactly. So a call of N >= 192 tokens must equal, bit for bit, the same
tokens looked up in chunks of 191. On CPUs without AVX512_BF16 both are the exact path.
"""
import pytest
import torch

from helpers import rel_err
from smf_kernels import backends, build_ext
from smf_kernels.ops import product_key_topk
from smf_kernels.reference import product_key_topk_reference

EXACT_CHUNK = 191  # tokens per call below the pre-screen's kPrescreenTokens (192)


@pytest.fixture(scope="module", autouse=True)
def ext():
    module = build_ext.build()
    backends.refresh()
    return module


def chunked(query, keys, topk):
    parts = [product_key_topk(query[n:n + EXACT_CHUNK], keys, topk, backend="ext")
             for n in range(0, query.shape[0], EXACT_CHUNK)]
    return torch.cat([s for s, _ in parts]), torch.cat([i for _, i in parts])


def assert_same_bits(got, want):
    (scores, indices), (want_scores, want_indices) = got, want
    assert torch.equal(indices, want_indices)
    assert torch.equal(scores.view(torch.int32), want_scores.view(torch.int32))


def near_ties(keys, kind, gen):
    """keys (H, 2, n_keys, half) with forced ties: exact duplicates, copies within the bf16 error bound, or
    small integers with signed zeros."""
    keys = keys.clone()
    if kind == "duplicates":  # sub-key 2j + 1 = sub-key 2j: equal scores, the lower index must come first
        keys[:, :, 1::2] = keys[:, :, 0:keys.shape[2] - 1:2]
    elif kind == "within_bound":  # copies off by 2^-9 relative: bf16 cannot order them, fp32 can
        copies = keys[:, :, 0::3][:, :, :keys[:, :, 2::3].shape[2]]
        keys[:, :, 2::3] = copies * (1 + 2.0 ** -9 * torch.randn(copies.shape, generator=gen).sign())
    elif kind == "integers":
        keys = torch.randint(-2, 3, keys.shape, generator=gen).float()
        keys[0, 0, ::5] = -0.0
    return keys


# (N, H, key_dim, n_keys, topk): half 37 (odd: a bf16 pair padded, d tails), 130 and 32; n_keys not a multiple
# of 16; topk 1, 5, 16 (vector selection) and 17, 32 (general path).
SHAPES = [(203, 2, 74, 531, 16), (197, 1, 260, 1024, 5), (229, 3, 64, 600, 17), (193, 2, 256, 512, 1),
          (211, 1, 130, 777, 32)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["random", "duplicates", "within_bound", "integers"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prescreened_topk_is_the_exact_topk_bit_for_bit(shape, kind, dtype):
    num_tokens, heads, key_dim, n_keys, topk = shape
    gen = torch.Generator().manual_seed(num_tokens * n_keys + topk)
    keys = near_ties(torch.randn(heads, 2, n_keys, key_dim // 2, generator=gen), kind, gen).to(dtype)
    query = torch.randn(num_tokens, heads, key_dim, generator=gen).to(dtype)
    if kind == "integers":
        query = torch.randint(-2, 3, query.shape, generator=gen).to(dtype)
    got = product_key_topk(query, keys, topk, backend="ext")
    assert_same_bits(got, chunked(query, keys, topk))
    want_scores, _ = product_key_topk_reference(query.double(), keys.double(), topk)
    assert rel_err(got[0], want_scores) < 1e-5


def test_prescreen_keeps_rows_it_cannot_bound_exact():
    """Non-finite or huge entries (no bound: the row scores every sub-key exactly) and tiny ones (subnormal
    products, flushed by the bf16 dot products) beside ordinary rows."""
    gen = torch.Generator().manual_seed(7)
    query = torch.randn(201, 2, 96, generator=gen)
    keys = torch.randn(2, 2, 640, 48, generator=gen)
    query[3, 0, 5] = float("inf")
    query[4, 1, 50] = float("nan")
    query[5] *= 1e31
    query[6:9] *= 1e-20
    keys[1, 0, 17, 3] = float("nan")
    keys[0, 1] *= 1e-19
    got = product_key_topk(query, keys, 16, backend="ext")
    assert_same_bits(got, chunked(query, keys, 16))


def test_prescreen_is_the_same_on_any_number_of_threads():
    """The pre-screened forward runs half by half over (head, token block) tasks and merges the halves after: 2 and
    3 threads (tasks split unevenly, a half's tops written by one thread and merged by another) give one thread's
    result bit for bit."""
    gen = torch.Generator().manual_seed(11)
    query = torch.randn(221, 3, 100, generator=gen)
    keys = torch.randn(3, 2, 545, 50, generator=gen)
    query[7, 1, 3] = float("inf")  # one half kept exact
    threads = torch.get_num_threads()
    try:
        results = []
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            results.append(product_key_topk(query, keys, 16, backend="ext"))
    finally:
        torch.set_num_threads(threads)
    for got in results[1:]:
        assert_same_bits(got, results[0])
    assert_same_bits(results[0], chunked(query, keys, 16))
