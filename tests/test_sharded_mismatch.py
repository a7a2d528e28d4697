"""Two gloo ranks whose sharded memories disagree (issue 34 item 4): sizes, dtypes, which gradients a read needs,
gather_values' dst, one rank reading while the other gathers the table. Every rank raises the same ValueError
naming what differs, before any collective whose sizes depend on it, and the group stays usable (the next case
runs on it). Named cases and a seeded sweep of random configuration pairs run in one spawn (starting processes
costs more than the cases)."""
from __future__ import annotations

import datetime
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from smf_kernels.sharded import ShardedProductKeyMemory

BASE = {"d_model": 12, "n_keys": 8, "heads": 2, "topk": 4, "key_dim": 8, "value_dim": 10}
# name -> (rank 1's changes, the fields the error must name); rank 0 keeps BASE
NAMED = {
    "n_keys": ({"n_keys": 16}, ["n_keys"]),
    "heads": ({"heads": 4}, ["heads"]),
    "topk": ({"topk": 2}, ["topk"]),
    "key_dim": ({"key_dim": 16}, ["key_dim"]),
    "value_dim": ({"value_dim": 11}, ["value_dim"]),
    "d_model": ({"d_model": 16}, ["d_model"]),
    "several": ({"n_keys": 4, "value_dim": 12}, ["n_keys", "value_dim"]),
    "bf16 values": ({"dtype": "bfloat16"}, ["values dtype"]),
    "frozen lookup": ({"frozen_lookup": True}, ["weights need grad"]),
    "no grad": ({"no_grad": True}, ["read needs grad"]),
    "same": ({}, []),
    "gather dst": ({"dst": 1}, ["dst"]),
    "gather dst out of range": ({"dst": 2, "dst0": 2}, ["dst must be a rank of the group"]),
    "gather width": ({"value_dim": 11, "dst": 0}, ["value_dim"]),
    "a read against gather_values": ({"dst": 0, "rank0_reads": True}, ["run different collectives"]),
}
SWEEP = 12  # random configuration pairs
PRECEDENCE = ("d_model", "n_keys", "heads", "topk", "key_dim", "value_dim")


def random_pairs(seed=0):
    """SWEEP pairs of configurations, each field of rank 1 changed with probability 1/4 (so some pairs agree)."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(SWEEP):
        heads, key_dim = rng.choice([1, 2, 3]), rng.choice([4, 8])
        n_keys = rng.choice([4, 5, 8])
        first = {"d_model": rng.choice([6, 12]), "n_keys": n_keys, "heads": heads,
                 "topk": rng.randint(1, n_keys), "key_dim": key_dim, "value_dim": rng.randint(2, 9)}
        second = dict(first)
        for field in PRECEDENCE:
            if rng.random() < 0.25:
                second[field] = {"n_keys": rng.choice([4, 5, 8]), "heads": rng.choice([1, 2, 3]),
                                 "key_dim": rng.choice([4, 8]), "d_model": rng.choice([6, 12]),
                                 "value_dim": rng.randint(2, 9), "topk": rng.randint(1, 4)}[field]
        second["topk"] = min(second["topk"], second["n_keys"])
        pairs.append((first, second))
    return pairs


def _case(rank, config, extra):
    """Build this rank's memory and run one forward + backward (or gather_values); '' or the ValueError's text."""
    torch.manual_seed(rank)
    memory = ShardedProductKeyMemory(**config, backend="torch")
    if extra.get("dtype") == "bfloat16":
        memory.to(torch.bfloat16)
    if extra.get("frozen_lookup"):
        memory.query_map.requires_grad_(False)
        memory.keys.requires_grad_(False)
    try:
        if "dst" in extra:
            memory.gather_values(extra["dst"])
            return ""
        x = torch.randn(3 + rank, config["d_model"], dtype=memory.values.dtype)
        with torch.set_grad_enabled(not extra.get("no_grad")):
            out = memory(x)
            if out.requires_grad:
                out.sum().backward()
        return ""
    except ValueError as err:
        return str(err)


def _job(rank, init, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))  # a mismatched collective fails, not hangs
    try:
        results = {}
        for name, (change, _) in NAMED.items():
            extra = {key: change[key] for key in ("dtype", "frozen_lookup", "no_grad") if key in change}
            config = dict(BASE)
            if rank == 1:
                config.update({k: v for k, v in change.items() if k in BASE})
                extra.update({"dst": change["dst"]} if "dst" in change else {})
            elif "dst" in change and not change.get("rank0_reads"):
                extra = {"dst": change.get("dst0", 0)}
            if rank == 0:
                extra.pop("dtype", None), extra.pop("frozen_lookup", None), extra.pop("no_grad", None)
            results[name] = _case(rank, config, extra)
        for index, pair in enumerate(random_pairs()):
            results[f"sweep-{index}"] = _case(rank, pair[rank], {})
        dist.barrier()
        torch.save(results, f"{out_dir}/rank-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    path = tmp_path_factory.mktemp("mismatch")
    mp.spawn(_job, args=(str(path / "init"), str(path)), nprocs=2, join=True)
    return [torch.load(path / f"rank-{rank}.pt") for rank in range(2)]


@pytest.mark.parametrize("name", sorted(NAMED))
def test_ranks_that_disagree_raise_the_same_error_naming_the_field(outcomes, name):
    first, second = (outcome[name] for outcome in outcomes)
    named = NAMED[name][1]
    assert first == second, "every rank raises the same error"
    assert bool(first) == bool(named), first
    assert "\n" not in first
    assert all(field in first for field in named), first


def test_a_sweep_of_random_configuration_pairs(outcomes):
    """Pairs that agree read; pairs that differ raise alike on both ranks, naming exactly the fields that differ."""
    for index, (first, second) in enumerate(random_pairs()):
        got = [outcome[f"sweep-{index}"] for outcome in outcomes]
        assert got[0] == got[1], (first, second, got)
        differing = [field for field in PRECEDENCE if first[field] != second[field]]
        assert bool(got[0]) == bool(differing), (first, second, got)
        assert all(f"{field}:" in got[0] for field in differing), (first, second, got)
        assert not any(f"{field}:" in got[0] for field in PRECEDENCE if field not in differing), got
    assert sum(bool(outcome) for outcome in (o[f"sweep-{i}"] for o in outcomes[:1] for i in range(SWEEP))) >= 3
