"""Background statistics: N / df / b accumulation, collection over a loader, file round trip, mismatch errors."""
import pytest
import torch
from torch import nn

from smf_kernels import ProductKeyMemory
from smf_kernels.sparse import BackgroundStats, SparseMemoryController


def small_memory(**overrides):
    config = dict(d_model=32, n_keys=8, heads=2, topk=4, key_dim=16) | overrides
    return ProductKeyMemory(**config)


class TwoMemories(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 32)
        self.blocks = nn.ModuleList([nn.ModuleDict({"memory": small_memory()}) for _ in range(2)])

    def forward(self, tokens):
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = hidden + block["memory"](hidden)
        return hidden


def test_add_batch_accumulates_num_batches_doc_freq_and_reads():
    stats = BackgroundStats({"layer": small_memory(n_keys=2, topk=2).config()})  # M = 4
    for counts in ([3, 0, 1, 0], [0, 0, 2, 0], [1, 0, 5, 7]):
        stats.add_batch("layer", torch.tensor(counts))
    assert stats.num_batches["layer"] == 3
    assert stats.doc_freq["layer"].tolist() == [2, 0, 3, 1]
    assert stats.reads["layer"].tolist() == [4, 0, 8, 7]
    with pytest.raises(ValueError, match=r"counts of layer 'layer' must have shape \(M,\) = \(4,\)"):
        stats.add_batch("layer", torch.tensor([1, 2]))
    with pytest.raises(KeyError, match="unknown memory layer"):
        stats.add_batch("other", torch.tensor([1, 2, 3, 4]))


def test_collect_background_counts_each_single_example_batch():
    model = TwoMemories().train()
    batches = [torch.randint(0, 40, (1, 9)) for _ in range(6)]
    controller = SparseMemoryController(model, rule="kl")
    stats = controller.collect_background(batches)

    assert model.training and controller.background is stats
    assert sorted(stats.configs) == ["blocks.0.memory", "blocks.1.memory"]
    for name, memory in controller.memories.items():
        per_batch = []
        with torch.no_grad():
            for tokens in batches:  # replay the forward to find each batch's slots by hand
                hidden = model.embed(tokens)
                for block in model.blocks:
                    if block["memory"] is memory:
                        _, slots = memory.lookup(hidden.reshape(-1, 32))
                        per_batch.append(torch.bincount(slots.flatten(), minlength=memory.num_slots))
                    hidden = hidden + block["memory"](hidden)
        per_batch = torch.stack(per_batch)
        assert stats.num_batches[name] == 6
        assert torch.equal(stats.doc_freq[name], (per_batch > 0).sum(0))
        assert torch.equal(stats.reads[name], per_batch.sum(0))
        assert int(memory.read_counts.sum()) == 0 and not memory.count_reads


def test_round_trip_through_file(tmp_path):
    model = TwoMemories()
    controller = SparseMemoryController(model)
    stats = controller.collect_background([torch.randint(0, 40, (1, 5)) for _ in range(4)], max_batches=3)
    path = tmp_path / "background.safetensors"
    stats.save(path)
    loaded = BackgroundStats.load(path, controller.memories)
    assert loaded.configs == stats.configs
    for name in stats.configs:
        assert loaded.num_batches[name] == stats.num_batches[name] == 3
        assert torch.equal(loaded.doc_freq[name], stats.doc_freq[name])
        assert torch.equal(loaded.reads[name], stats.reads[name])


def test_loading_into_a_mismatched_memory_is_a_clear_error(tmp_path):
    path = tmp_path / "background.safetensors"
    BackgroundStats.for_memories({"memory": small_memory()}).save(path)
    with pytest.raises(ValueError, match=r"built for config .*'n_keys': 8.* has config .*'n_keys': 4"):
        BackgroundStats.load(path, {"memory": small_memory(n_keys=4)})  # different number of slots
    with pytest.raises(ValueError, match=r"built for config .*'heads': 2.* has config .*'heads': 4"):
        BackgroundStats.load(path, {"memory": small_memory(heads=4)})  # same slots, other config
    with pytest.raises(ValueError, match=r"for memory layers \['memory'\] but the model has \['mem'\]"):
        BackgroundStats.load(path, {"mem": small_memory()})
    with pytest.raises(ValueError, match="for memory layers"):
        SparseMemoryController(TwoMemories(), background=BackgroundStats.load(path))
    (tmp_path / "other.safetensors").write_bytes(path.read_bytes().replace(b"smf_background", b"smf_xxxxxxxxxx"))
    with pytest.raises(ValueError, match="not a background statistics file"):
        BackgroundStats.load(tmp_path / "other.safetensors")


def test_counts_that_counting_cannot_produce_are_refused():
    memory = small_memory(n_keys=2, topk=2)
    stats = BackgroundStats({"": memory.config()})  # the memory is the whole model: its name is ""
    with pytest.raises(ValueError, match="must be >= 0"):
        stats.add_batch("", torch.tensor([1, -1, 0, 0]))
    stats.add_batch("", torch.tensor([1, 0, 0, 2]))
    stats.doc_freq[""][1] = 3  # set by hand: more batches than were counted
    with pytest.raises(ValueError, match=r"doc_freq values up to 3 exceed num_batches 1"):
        SparseMemoryController(memory, background=stats)
