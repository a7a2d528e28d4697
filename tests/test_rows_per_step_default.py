"""The default T (``rows_per_step``) is the paper's share of each memory's slots (512 of 16,384), at least 1, so
small memories train sparse without being told; an explicit T at or above a memory's slot count still warns."""
import logging

import pytest
import torch
from torch import nn

from smf.report.accounting import parameter_accounting
from smf.train.config import RunConfig
from smf_kernels import ProductKeyMemory
from smf_kernels.sparse import BackgroundStats, RowSparseAdamW, SparseMemoryController
from smf_kernels.sparse.selection import default_rows_per_step


def test_the_default_is_the_papers_share_of_the_slots_and_at_least_one():
    assert default_rows_per_step(128 ** 2) == 512
    assert [default_rows_per_step(n * n) for n in (16, 21, 32, 5, 1)] == [8, 13, 32, 1, 1]


def test_the_default_never_exceeds_the_papers_T_however_many_slots():
    """T does not grow with the memory: 512 at 16,384 slots and at every larger memory (1M slots: 512, not 32,768);
    an explicit rows_per_step above it is the user's and kept."""
    assert [default_rows_per_step(n * n) for n in (127, 128, 129, 512, 1024)] == [504, 512, 512, 512, 512]
    memory = ProductKeyMemory(16, n_keys=192, heads=2, topk=4, key_dim=8)
    assert SparseMemoryController(memory).layer_rows == {"": 512}
    assert SparseMemoryController(memory, rows_per_step=1152).layer_rows == {"": 1152}


def _two_memories() -> nn.Module:
    """Memories of 64 and 441 slots (T 2 and 13 by default) whose values alone train."""
    model = nn.ModuleDict({"small": ProductKeyMemory(32, n_keys=8, heads=2, topk=4, key_dim=16),
                           "large": ProductKeyMemory(32, n_keys=21, heads=2, topk=8, key_dim=16)})
    for param in model.parameters():
        param.requires_grad_(param.dim() == 2 and param.shape[0] in (64, 441) and param.shape[1] == 32)
    return model


def test_the_controller_selects_each_memorys_share_without_a_warning(caplog):
    model = _two_memories()
    memories = dict(model.items())
    with caplog.at_level(logging.WARNING):
        controller = SparseMemoryController(model, background=BackgroundStats.for_memories(memories))
    assert "not sparse" not in caplog.text
    assert controller.rows_per_step is None and controller.layer_rows == {"small": 2, "large": 13}
    controller.begin_step()
    x = torch.randn(3, 9, 32)
    sum(memory(x).square().sum() for memory in memories.values()).backward()
    rows = controller.finish_step(RowSparseAdamW([m.values for m in memories.values()], lr=1e-2))
    assert {name: len(selected) for name, selected in rows.items()} == {"small": 2, "large": 13}


def test_an_explicit_rows_per_step_is_kept_and_warned_about_at_the_slot_count(caplog):
    model = _two_memories()
    with caplog.at_level(logging.WARNING):
        controller = SparseMemoryController(model, rows_per_step=64)
    assert controller.layer_rows == {"small": 64, "large": 64}
    assert caplog.text.count("not sparse") == 1 and "'small': 64" in caplog.text and "large" not in caplog.text
    with pytest.raises(ValueError, match="rows_per_step must be a positive int or None, got 0"):
        SparseMemoryController(model, rows_per_step=0)


def test_smf_train_and_the_accounting_default_to_the_share():
    assert RunConfig.__dataclass_fields__["rows_per_step"].default is None
    rows = {row.method: row for row in parameter_accounting(layers=(6,), rows_per_step=None)}
    explicit = {row.method: row for row in parameter_accounting(layers=(6,), rows_per_step=512)}
    assert rows["Additive memory"].updated_per_step == explicit["Additive memory"].updated_per_step == 512 * 896
