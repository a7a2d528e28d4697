"""The top-T selection by a partial selection (topk of the T-th score, then the lowest-id ties) and the scoring of
only the read slots return exactly what the earlier full stable sort of every slot returned: the oracle below is
that implementation, kept verbatim, on fresh random scores with forced ties at awkward sizes."""
import pytest
import torch
from test_triton_no_host_sync import _RecordOps, _syncing

from smf_kernels import ProductKeyMemory
from smf_kernels.sparse import BackgroundStats, SparseMemoryController
from smf_kernels.sparse.selection import (background_weights, select_read_rows_padded, select_rows_padded,
                                          select_top_rows, weighted_scores)

NEG_INF, NAN = float("-inf"), float("nan")


def sorted_selection(scores, counts, num_rows):
    """The earlier select_rows_padded: a stable descending sort of every masked score, its first T ascending."""
    order = torch.sort(scores.masked_fill(counts == 0, NEG_INF), descending=True, stable=True).indices
    rows, _ = order[: min(num_rows, counts.numel())].sort()
    return rows, (counts[rows] > 0)


def earlier_scores(rule, counts, doc_freq, reads, num_batches, eps=1e-8):
    """The earlier tfidf_scores / kl_scores, computed from the statistics at every call."""
    counts64 = counts.to(torch.float64)
    batch_dist = counts64 / counts64.sum().clamp_min(1.0)
    if rule == "tfidf":
        scores = batch_dist * torch.log((num_batches + 1.0) / (doc_freq.to(torch.float64) + 1.0))
    else:
        smoothed = reads.to(torch.float64) + 1.0
        scores = batch_dist * torch.log((batch_dist + eps) / (smoothed / smoothed.sum() + eps))
    return scores.masked_fill(counts == 0, NEG_INF)


def assert_same(got, expected):
    assert torch.equal(got[0], expected[0]) and got[0].dtype == torch.int64, (got[0], expected[0])
    assert torch.equal(got[1], expected[1])


def tied_inputs(num_slots, dtype, generator):
    """Counts with about a third of the slots unread, scores from five values (ties across any boundary)."""
    counts = torch.randint(1, 4, (num_slots,), generator=generator)
    counts[torch.rand(num_slots, generator=generator) < 0.35] = 0
    levels = torch.randn(5, generator=generator, dtype=torch.float64).to(dtype)
    scores = levels[torch.randint(0, 5, (num_slots,), generator=generator)]
    spread = torch.rand(num_slots, generator=generator) < 0.3
    scores[spread] = torch.randn(int(spread.sum()), generator=generator, dtype=torch.float64).to(dtype)
    return scores, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_slots", [1000, 16_383])
def test_the_partial_selection_is_the_full_sorts_bit_for_bit(num_slots, dtype):
    generator = torch.Generator().manual_seed(num_slots)
    for _ in range(4):
        scores, counts = tied_inputs(num_slots, dtype, generator)
        read = int((counts > 0).sum())
        for num_rows in (1, 7, 511, read - 1, read, read + 13, num_slots - 1, num_slots, num_slots + 5):
            assert_same(select_rows_padded(scores, counts, num_rows), sorted_selection(scores, counts, num_rows))


def test_edge_cases_match_the_full_sort():
    generator = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 3, (37,), generator=generator)
    counts[:3] = 1
    cases = {"all equal": torch.full((37,), 0.25, dtype=torch.float64),
             "-inf at read slots": torch.randn(37, generator=generator).masked_fill(torch.arange(37) % 4 == 0,
                                                                                   NEG_INF),
             "nan and inf": torch.randn(37, generator=generator, dtype=torch.float64).index_fill(
                 0, torch.tensor([0, 5, 9]), NAN).index_fill(0, torch.tensor([2, 11]), float("inf")),
             "-0.0 and 0.0": torch.tensor([0.0, -0.0] * 18 + [0.0], dtype=torch.float64),
             "all nan": torch.full((37,), NAN)}
    for name, scores in cases.items():
        for num_rows in (0, 1, 2, 3, 4, 10, 20, 36, 37, 60):
            for case_counts in (counts, torch.zeros_like(counts), torch.ones_like(counts)):
                got = select_rows_padded(scores, case_counts, num_rows)
                assert_same(got, sorted_selection(scores, case_counts, num_rows)), (name, num_rows)
    assert select_rows_padded(torch.zeros(0), torch.zeros(0, dtype=torch.int64), 4)[0].shape == (0,)


def test_fewer_read_slots_than_T_fill_with_the_lowest_unread_ids():
    counts = torch.tensor([0, 2, 0, 0, 1, 0, 0, 3])
    scores = torch.tensor([9.0, 0.1, 9.0, 9.0, 0.2, 9.0, 9.0, 0.3], dtype=torch.float64)
    rows, valid = select_rows_padded(scores, counts, 5)
    assert rows.tolist() == [0, 1, 2, 4, 7] and valid.tolist() == [False, True, False, True, True]
    assert select_top_rows(scores, counts, 5).tolist() == [1, 4, 7]


@pytest.mark.parametrize("rule", ["tfidf", "kl"])
@pytest.mark.parametrize("num_slots", [441, 1000, 16_383])
def test_scoring_only_the_read_slots_selects_what_scoring_every_slot_did(rule, num_slots):
    """Small counts against a small background: many slots with equal statistics, so equal scores."""
    generator = torch.Generator().manual_seed(num_slots + len(rule))
    doc_freq = torch.randint(0, 4, (num_slots,), generator=generator)
    reads = doc_freq * torch.randint(1, 3, (num_slots,), generator=generator)
    weights = background_weights(rule, doc_freq, reads, 5)
    assert weights.dtype == torch.float64 and weights.shape == (num_slots,)
    for share in (0.0, 0.02, 0.3, 0.9):  # 0: nothing read, every row fills the size
        counts = torch.randint(1, 3, (num_slots,), generator=generator)
        counts[torch.rand(num_slots, generator=generator) > share] = 0
        scores = earlier_scores(rule, counts, doc_freq, reads, 5)
        assert torch.equal(weighted_scores(rule, counts, weights), scores)
        read = int((counts > 0).sum())
        for num_rows in {0, 1, 13, max(read - 1, 0), read, read + 40, num_slots, num_slots + 1}:
            expected = sorted_selection(scores, counts, num_rows)
            assert_same(select_read_rows_padded(rule, counts, weights, num_rows), expected)
            assert_same(select_rows_padded(weighted_scores(rule, counts, weights), counts, num_rows), expected)


def test_bad_weights_and_rules_raise_clear_errors():
    counts = torch.tensor([1, 0, 2])
    with pytest.raises(TypeError, match="weights"):
        select_read_rows_padded("kl", counts, torch.ones(3), 2)
    with pytest.raises(ValueError, match="weights must be"):
        select_read_rows_padded("kl", counts, torch.ones(4, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="rule must be one of"):
        select_read_rows_padded("bm25", counts, torch.ones(3, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="rule must be one of"):
        background_weights("bm25", counts, counts, 2)
    with pytest.raises(ValueError, match="num_batches"):
        background_weights("tfidf", counts, counts, -1)


def test_the_padded_selection_makes_no_host_sync():
    scores, counts = tied_inputs(1000, torch.float64, torch.Generator().manual_seed(5))
    with _RecordOps() as rec:
        select_rows_padded(scores, counts, 100)
    syncing = [name for name in _syncing(rec.names) if not name.startswith("masked_fill")]  # a fill, no index
    assert "topk.default" in rec.names and not syncing, syncing


def test_the_controller_remakes_the_background_weights_when_the_statistics_change():
    memory = ProductKeyMemory(16, n_keys=9, heads=2, topk=4, key_dim=8)
    background = BackgroundStats.for_memories({"": memory})
    controller = SparseMemoryController(memory, rule="tfidf", rows_per_step=5, background=background)
    controller.begin_step()
    made = controller._weights[""][1]
    assert torch.equal(made, torch.full((81,), 0.0, dtype=torch.float64))  # N = 0: every IDF log(1 / 1)
    controller.abort_step()
    controller.begin_step()
    assert controller._weights[""][1] is made  # the same background: not made again
    controller.abort_step()
    background.add_batch("", torch.arange(81) % 3)
    controller.begin_step()
    assert torch.equal(controller._weights[""][1],
                       torch.log(2.0 / ((torch.arange(81) % 3 > 0).to(torch.float64) + 1.0)))
    controller.abort_step()
