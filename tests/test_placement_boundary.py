"""No module of smf_kernels/sparse asks how a table is laid out (issue 60): the step, clipping and the row
optimizers call the table's placement (smf_kernels.sharded.placement), and only smf_kernels/sharded and the
trainer's parallelisms name shards and DTensors. And the trainer's loop and recipes hold no parallelism of their
own: one ordered ``parallelize`` (smf/train/parallel.py) applies them."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what a module that asks how a tensor is laid out names
LAYOUT_NAMES = {"shard_of", "is_split", "DTensor", "ColumnShard", "SHARD_ATTRIBUTE", "device_mesh", "to_local"}
PARALLELISM_NAMES = {"parallelize_memories", "parallelize_fsdp", "parallelize_ddp", "shard_base_model",
                     "shard_memories", "fully_shard", "DistributedDataParallel"}


def named(source: str) -> set[str]:
    """Every name and attribute a module's code (``source``) uses or imports (docstrings and comments aside)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.name.rsplit(".", 1)[-1])
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "smf_kernels" / "sparse").glob("*.py")), ids=lambda p: p.name)
def test_no_sparse_module_asks_how_a_table_is_laid_out(path):
    assert not named(path.read_text()) & LAYOUT_NAMES


@pytest.mark.parametrize("name", ["loop.py", "recipes.py", "steps.py"])
def test_the_trainers_loop_and_recipes_apply_no_parallelism_themselves(name):
    assert not named((ROOT / "smf" / "train" / name).read_text()) & PARALLELISM_NAMES


def test_a_layout_question_is_seen_in_code_not_in_prose():
    """What the controller asked before issue 60 is seen, however it is imported; a docstring naming a DTensor
    is not a question."""
    asked = ('"""A DTensor table keeps the dense form."""\n'
             "from smf_kernels.sharded import layout\n"
             "if layout.is_split(values):\n"
             "    grad.div_(layout.shard_of(values).size)\n")
    assert named(asked) & LAYOUT_NAMES == {"is_split", "shard_of"}
    assert named("from torch.distributed.tensor import DTensor\n") & LAYOUT_NAMES == {"DTensor"}
