"""load_shards on shard files with one entry wrong (issue 34 item 5): a ValueError naming the file, the table and
the entry, and neither the model nor the optimizer changed. One process (no process group: a sharded memory
holds every column) loading a checkpoint of two hand-split shards."""
from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from smf_kernels import ProductKeyMemory
from smf_kernels.sharded import shard_memories
from smf_kernels.sharded.checkpoint import load_shards, replicated_optimizer_state, shard_payload
from smf_kernels.sparse import RowSparseAdamW

SLOTS, WIDTH, SPLIT = 16, 10, 6  # rank 0 holds columns [0, 6), rank 1 [6, 10)
TABLE = "memory.values"


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.memory = ProductKeyMemory(12, n_keys=4, heads=2, topk=2, key_dim=8, value_dim=WIDTH, backend="torch")


def trained():
    """A sharded one-rank model and its RowSparseAdamW after two row steps (state left behind)."""
    model = Holder()
    shard_memories(model)
    optimizer = RowSparseAdamW([model.memory.values], lr=1e-2)
    for rows in ([1, 5, 9], [0, 5, 15]):
        optimizer.step_rows(model.memory.values, torch.tensor(rows), torch.randn(3, WIDTH))
    return model, optimizer


def two_shards(model, optimizer) -> list[dict]:
    """The one-rank payload split by columns into the payloads two ranks would have written."""
    whole = shard_payload(model, optimizer)
    shards = []
    for rank, (start, stop) in enumerate(((0, SPLIT), (SPLIT, WIDTH))):
        table = whole["tables"][TABLE]
        shards.append({"format": whole["format"], "rank": rank, "size": 2, "tables": {TABLE: {
            "shape": [SLOTS, WIDTH], "columns": [start, stop], "values": table["values"][:, start:stop].clone(),
            "state": {key: value[:, start:stop].clone() for key, value in table["state"].items()}}}})
    return shards


def _rows(tensor, more):
    """The tensor with one row more (a copy of the last) or one fewer."""
    return torch.cat([tensor, tensor[-1:]]) if more else tensor[:-1]


# name -> (where it acts: "file" or the entry it breaks, how it changes one shard payload)
MUTATIONS = {
    "size missing": ("file", lambda p: p.pop("size")),
    "size a string": ("file", lambda p: p.update(size="2")),
    "size zero": ("file", lambda p: p.update(size=0)),
    "size a bool": ("file", lambda p: p.update(size=True)),
    "rank missing": ("file", lambda p: p.pop("rank")),
    "rank out of range": ("file", lambda p: p.update(rank=2)),
    "rank negative": ("file", lambda p: p.update(rank=-1)),
    "rank a float": ("file", lambda p: p.update(rank=float(p["rank"]))),
    "no tables": ("file", lambda p: p.update(tables={})),
    "table not a dict": ("table", lambda p: p["tables"].update({TABLE: [1, 2]})),
    "shape missing": ("shape", lambda p: p["tables"][TABLE].pop("shape")),
    "shape of one int": ("shape", lambda p: p["tables"][TABLE].update(shape=[SLOTS])),
    "shape a string": ("shape", lambda p: p["tables"][TABLE].update(shape="16x10")),
    "shape one row more": ("table", lambda p: p["tables"][TABLE].update(shape=[SLOTS + 1, WIDTH])),
    "columns missing": ("columns", lambda p: p["tables"][TABLE].pop("columns")),
    "columns reversed": ("columns", lambda p: p["tables"][TABLE].update(
        columns=p["tables"][TABLE]["columns"][::-1])),
    "columns past the table": ("columns", lambda p: p["tables"][TABLE].update(columns=[0, WIDTH + 1])),
    "columns negative": ("columns", lambda p: p["tables"][TABLE].update(columns=[-1, 3])),
    "values missing": ("values", lambda p: p["tables"][TABLE].pop("values")),
    "values a list": ("values", lambda p: p["tables"][TABLE].update(values=[[0.0]])),
    "values int64": ("values", lambda p: p["tables"][TABLE].update(values=p["tables"][TABLE]["values"].long())),
    "values one row more": ("values", lambda p: p["tables"][TABLE].update(
        values=_rows(p["tables"][TABLE]["values"], True))),
    "values one column fewer": ("values", lambda p: p["tables"][TABLE].update(
        values=p["tables"][TABLE]["values"][:, 1:])),
    "values float64": ("values", lambda p: p["tables"][TABLE].update(values=p["tables"][TABLE]["values"].double())),
    "state missing": ("state", lambda p: p["tables"][TABLE].pop("state")),
    "state a list": ("state", lambda p: p["tables"][TABLE].update(state=[])),
    "exp_avg_sq missing": ("exp_avg_sq", lambda p: p["tables"][TABLE]["state"].pop("exp_avg_sq")),
    "exp_avg one row fewer": ("exp_avg", lambda p: p["tables"][TABLE]["state"].update(
        exp_avg=_rows(p["tables"][TABLE]["state"]["exp_avg"], False))),
    "exp_avg_sq one row more": ("exp_avg_sq", lambda p: p["tables"][TABLE]["state"].update(
        exp_avg_sq=_rows(p["tables"][TABLE]["state"]["exp_avg_sq"], True))),
    "exp_avg transposed": ("exp_avg", lambda p: p["tables"][TABLE]["state"].update(
        exp_avg=p["tables"][TABLE]["state"]["exp_avg"].t().contiguous())),
    "exp_avg int64": ("exp_avg", lambda p: p["tables"][TABLE]["state"].update(
        exp_avg=p["tables"][TABLE]["state"]["exp_avg"].long())),
    "exp_avg float64": ("exp_avg", lambda p: p["tables"][TABLE]["state"].update(
        exp_avg=p["tables"][TABLE]["state"]["exp_avg"].double())),
    "exp_avg a number": ("exp_avg", lambda p: p["tables"][TABLE]["state"].update(exp_avg=0.0)),
    "an extra state entry": ("extra", lambda p: p["tables"][TABLE]["state"].update(
        extra=p["tables"][TABLE]["state"]["exp_avg"].clone())),
}


def _load_refused(directory, shards, replicated) -> tuple[list, str]:
    """Write ``shards`` into ``directory``, load them into a fresh model whose optimizer has state; return the
    paths and the ValueError's message after checking that neither the model nor the optimizer changed."""
    directory.mkdir()
    paths = [directory / f"rank-{r}.pt" for r in range(len(shards))]
    for path, payload in zip(paths, shards):
        torch.save(payload, path)
    fresh = Holder()
    shard_memories(fresh)
    fresh_optimizer = RowSparseAdamW([fresh.memory.values], lr=1e-2)
    fresh_optimizer.step_rows(fresh.memory.values, torch.tensor([3]), torch.randn(1, WIDTH))
    values = fresh.memory.values.detach().clone()
    state = copy.deepcopy(fresh_optimizer.state_dict())
    with pytest.raises(ValueError) as caught:
        load_shards(paths, fresh, fresh_optimizer, replicated)
    assert torch.equal(fresh.memory.values, values)
    after = fresh_optimizer.state_dict()
    assert after["state"].keys() == state["state"].keys()
    assert all(torch.equal(after["state"][0][k], v) for k, v in state["state"][0].items())
    message = str(caught.value)
    assert "\n" not in message
    return paths, message


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_a_wrong_entry_is_named_with_its_file_and_table_and_nothing_changes(tmp_path, rank, name):
    model, optimizer = trained()
    shards = two_shards(model, optimizer)
    entry, mutate = MUTATIONS[name]
    mutate(shards[rank])
    paths, message = _load_refused(tmp_path / "shards", shards, replicated_optimizer_state(model, optimizer))
    named = [str(paths[rank])] + ([] if entry == "file" else [repr(TABLE)]) + (
        [] if entry in ("file", "table") else [entry])
    assert all(part in message for part in named), (name, message)


_INTS = st.one_of(st.integers(-3, WIDTH + SLOTS + 2), st.integers(-2**63, 2**63 - 1))


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(rank=st.sampled_from([0, 1]), field=st.sampled_from(["shape", "columns", "rank", "size"]),
       numbers=st.lists(_INTS, min_size=1, max_size=3))
def test_integer_entries_out_of_their_range_are_refused_naming_the_file(tmp_path_factory, rank, field, numbers):
    """shape, columns, rank and size set to ints from anywhere in int64 (any count of them): refused, naming the
    file, unless the change happens to leave the checkpoint as it was."""
    model, optimizer = trained()
    shards = two_shards(model, optimizer)
    target = shards[rank] if field in ("rank", "size") else shards[rank]["tables"][TABLE]
    value = numbers[0] if field in ("rank", "size") else numbers
    if value == target[field]:
        return
    target[field] = value
    paths, message = _load_refused(tmp_path_factory.mktemp("case") / "shards", shards,
                                   replicated_optimizer_state(model, optimizer))
    assert str(paths[rank]) in message or (field in ("rank", "size") and str(paths[1 - rank]) in message), message


def test_the_two_shards_load_whole_when_nothing_is_wrong(tmp_path):
    """The hand-split checkpoint the test above breaks is a good one."""
    model, optimizer = trained()
    paths = [tmp_path / f"rank-{r}.pt" for r in range(2)]
    for path, payload in zip(paths, two_shards(model, optimizer)):
        torch.save(payload, path)
    fresh = Holder()
    shard_memories(fresh)
    fresh_optimizer = RowSparseAdamW([fresh.memory.values], lr=1e-2)
    load_shards(paths, fresh, fresh_optimizer, replicated_optimizer_state(model, optimizer))
    assert torch.equal(fresh.memory.values, model.memory.values)
    for key, value in optimizer.state[model.memory.values].items():
        assert torch.equal(fresh_optimizer.state[fresh.memory.values][key], value), key


def test_a_single_path_and_a_malformed_optimizer_state_are_refused_by_name(tmp_path):
    model, optimizer = trained()
    paths = [tmp_path / f"rank-{r}.pt" for r in range(2)]
    for path, payload in zip(paths, two_shards(model, optimizer)):
        torch.save(payload, path)
    with pytest.raises(ValueError, match="paths must be a sequence"):
        load_shards(str(paths[0]), model)
    with pytest.raises(ValueError, match="optimizer_state must be a dict"):
        load_shards(paths, model, optimizer, {"param_groups": []})


def test_a_pipe_a_directory_a_generator_and_a_table_keyed_by_an_int(tmp_path):
    """A named pipe where a shard file belongs is refused without reading it (reading would wait forever); a
    generator of paths is read once; a table keyed by something else than its name is named."""
    model, optimizer = trained()
    paths = [tmp_path / f"rank-{r}.pt" for r in range(2)]
    shards = two_shards(model, optimizer)
    for path, payload in zip(paths, shards):
        torch.save(payload, path)
    fresh = Holder()
    shard_memories(fresh)
    load_shards((path for path in paths), fresh)
    assert torch.equal(fresh.memory.values, model.memory.values)
    with pytest.raises(TypeError, match="paths must be a sequence"):
        load_shards(None, fresh)
    pipe, folder = tmp_path / "pipe.pt", tmp_path / "folder.pt"
    os.mkfifo(pipe)
    folder.mkdir()
    for odd in (pipe, folder):
        with pytest.raises(ValueError, match=f"{odd} is not a shard file: not a regular file"):
            load_shards([paths[0], odd], fresh)
    shards[1]["tables"][3] = shards[1]["tables"][TABLE]
    torch.save(shards[1], paths[1])
    with pytest.raises(ValueError, match=f"{paths[1]}: table 3: a table's key must be its parameter's name"):
        load_shards(paths, fresh)
