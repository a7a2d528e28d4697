"""TF-IDF / KL scores against hand-computed values, top-T selection, padding never counted."""
import pytest
import torch

from smf_kernels import ProductKeyMemory
from smf_kernels.sparse import (BackgroundStats, RowSparseAdamW, SparseMemoryController, kl_scores, select_top_rows,
                                tfidf_scores)

INF = float("-inf")


def test_tfidf_matches_hand_computed_values():
    counts = torch.tensor([3, 0, 1, 0, 2, 4])
    doc_freq = torch.tensor([0, 5, 2, 1, 9, 3])
    # N = 9, C = 10: s = c/10 * ln(10 / (df + 1))
    expected = torch.tensor([0.3 * 2.302585093, INF, 0.1 * 1.203972804, INF, 0.0, 0.4 * 0.916290732],
                            dtype=torch.float64)
    scores = tfidf_scores(counts, doc_freq, 9)
    assert scores.dtype == torch.float64
    assert torch.allclose(scores, expected, rtol=1e-8, atol=0)


def test_kl_matches_hand_computed_values():
    counts = torch.tensor([2, 0, 1, 1, 4])
    reads = torch.tensor([5, 3, 0, 0, 23])
    # C = 8: p = [1/4, 0, 1/8, 1/8, 1/2]; b + 1 = [6, 4, 1, 1, 24], sum 36: q = [1/6, 1/9, 1/36, 1/36, 2/3]
    expected = torch.tensor([0.25 * 0.405465108, INF, 0.125 * 1.504077397, 0.125 * 1.504077397, 0.5 * -0.287682072],
                            dtype=torch.float64)
    assert torch.allclose(kl_scores(counts, reads), expected, rtol=1e-6, atol=0)  # eps = 1e-8 shifts ~3e-7


def test_select_top_rows_picks_min_T_read_rows_best_first_ties_by_slot_id():
    counts = torch.tensor([1, 0, 5, 1, 0, 2, 1])
    scores = torch.tensor([0.5, INF, 0.9, 0.5, INF, -0.1, 0.5], dtype=torch.float64)
    assert select_top_rows(scores, counts, 2).tolist() == [0, 2]  # 0.9, then the lower of the tied 0.5s
    assert select_top_rows(scores, counts, 4).tolist() == [0, 2, 3, 6]
    # T larger than the number of read slots: every read slot, never an unread one (even a negative score wins)
    assert select_top_rows(scores, counts, 100).tolist() == [0, 2, 3, 5, 6]
    assert select_top_rows(scores, torch.zeros_like(counts), 3).numel() == 0


def test_selection_is_the_top_T_of_random_scores():
    counts = torch.randint(0, 3, (500,))
    scores = tfidf_scores(counts, torch.randint(0, 50, (500,)), 50)
    rows = select_top_rows(scores, counts, 40)
    worst_selected = scores[rows].min()
    unselected = torch.ones(500, dtype=torch.bool)
    unselected[rows] = False
    assert rows.numel() == 40 and bool((counts[rows] > 0).all())
    assert bool((scores[unselected] <= worst_selected).all())


def test_bad_inputs_raise_clear_errors():
    counts = torch.tensor([1, 2, 3])
    with pytest.raises(TypeError, match="counts"):
        tfidf_scores(counts.float(), counts, 3)
    with pytest.raises(ValueError, match="doc_freq"):
        tfidf_scores(counts, torch.tensor([1, 2]), 3)
    with pytest.raises(ValueError, match="num_batches"):
        tfidf_scores(counts, counts, -1)
    with pytest.raises(ValueError, match="num_rows"):
        select_top_rows(counts.double(), counts, -2)


def test_padding_never_steers_selection(caplog):
    """Slots read only by padding tokens are never selected, even with T = M."""
    memory = ProductKeyMemory(32, n_keys=8, heads=2, topk=4, key_dim=16)
    for param in memory.parameters():
        param.requires_grad_(False)
    memory.values.requires_grad_(True)
    controller = SparseMemoryController(memory, rule="tfidf", rows_per_step=memory.num_slots,
                                        background=BackgroundStats.for_memories({"": memory}))
    assert caplog.text.count("not sparse") == 1  # T = M: nothing sparse, said once (a log line)
    x = torch.randn(2, 6, 32)
    valid = torch.tensor([[True] * 6, [True, True, False, False, False, False]])
    controller.begin_step()
    memory(x, valid_mask=valid).square().sum().backward()
    rows = controller.finish_step(RowSparseAdamW([memory.values], lr=0.0))[""]
    _, slots = memory.lookup(x[valid])
    assert rows.tolist() == torch.unique(slots).tolist()
    _, padding_slots = memory.lookup(x[~valid])
    assert set(padding_slots.unique().tolist()) - set(rows.tolist())  # padding did read other slots
