"""What the controller says to a user: a model without smf's memories is named with what to do when it holds a saved
model's plain memories, and the background-statistics bar can be hidden (a Trainer's disable_tqdm)."""
import pytest
import torch
from torch import nn

from smf.model import attach_memories
from smf.tiny import tiny_model
from smf.vocabulary import TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS
from smf_kernels.sparse import SparseMemoryController
from smf_kernels.sparse.background_collection import collect_background_batched


class PlainProductKeyMemory(nn.Module):
    """Stands for the memory class of the code saved beside a model's weights (smf/model/remote_code.py)."""

    def __init__(self):
        super().__init__()
        self.values = nn.Parameter(torch.randn(4, 3))


def test_a_model_without_memories_is_refused_plainly():
    with pytest.raises(ValueError, match=r"^model holds no ProductKeyMemory module \(smf_kernels'\)$"):
        SparseMemoryController(nn.Sequential(nn.Linear(3, 3)))


def test_a_model_with_the_saved_codes_plain_memories_is_told_what_to_do():
    model = nn.Sequential(nn.Linear(3, 3), PlainProductKeyMemory())
    with pytest.raises(ValueError, match=r"holds PlainProductKeyMemory from the code saved beside its weights.*"
                                         r"install smf-kernels\[experiments\]"):
        SparseMemoryController(model)
    with pytest.raises(ValueError, match="PlainProductKeyMemory"):
        collect_background_batched(model, [[1, 2]], batch_size=1, pad_id=0)


@pytest.mark.parametrize("batched", [False, True])
def test_the_background_bar_shows_unless_progress_is_off(batched, capsys):
    torch.manual_seed(0)
    model = tiny_model()
    attach_memories(model, TINY_MEMORY_LAYERS, **TINY_MEMORY_KWARGS)
    documents = [[5, 6, 7, 8], [9, 10, 11]]
    for progress in (True, False):
        if batched:
            collect_background_batched(model, documents, batch_size=2, pad_id=0, progress=progress)
        else:
            SparseMemoryController(model, rows_per_step=1).collect_background(
                [{"input_ids": torch.tensor([d])} for d in documents], progress=progress)
        shown = "background statistics" in capsys.readouterr().err
        assert shown is progress
