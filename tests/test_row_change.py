"""The per-touch row change a sparse step logs (smf.train.steps.RowChangeLog.row_change): the median over the
updated rows of ||v_after - v_before|| relative to the row's norm before the step and at the first step, against a
direct computation on random tables; nothing on several processes."""
from types import SimpleNamespace

import torch

from smf.train.steps import RowChangeLog


def test_row_change_is_the_median_relative_change_of_the_updated_rows():
    generator = torch.Generator().manual_seed(0)
    tables = {name: torch.randn(37, 5, generator=generator) for name in ("layers.1", "layers.3")}
    memories = {name: SimpleNamespace(values=table.clone()) for name, table in tables.items()}
    step = RowChangeLog(SimpleNamespace(memories=memories))  # watching one step, without a controller
    step._start_norms = {name: (table * 1.7).norm(dim=1) for name, table in tables.items()}  # an earlier step's
    step._before = {name: table.clone() for name, table in tables.items()}
    step.rows = {"layers.1": torch.tensor([2, 9, 30]), "layers.3": torch.tensor([0, 11])}
    for name, rows in step.rows.items():
        memories[name].values[rows] += 0.3 * torch.randn(len(rows), 5, generator=generator)
    expected, expected_start = [], []
    for name, rows in step.rows.items():
        for row in rows.tolist():
            change = (memories[name].values[row] - tables[name][row]).norm()
            expected.append(float(change / tables[name][row].norm()))
            expected_start.append(float(change / (1.7 * tables[name][row]).norm()))
    logged = step.row_change()
    assert abs(logged["row_change"] - sorted(expected)[2]) < 1e-6 * sorted(expected)[2]  # 5 rows: the third
    assert abs(logged["row_change_vs_start"] - sorted(expected_start)[2]) < 1e-6 * sorted(expected_start)[2]
    step.world = 2
    assert step.row_change() == {}  # sharded tables: not measured


def test_the_exact_update_measures_from_the_rows_the_optimizer_steps():
    """The exact update copies no table: row_change reads the T rows the optimizer's step_rows was about to step
    (kept by RowChangeLog.before_rows, the step's hook), the rows it updated being a subset of
    them."""
    generator = torch.Generator().manual_seed(1)
    memories = {name: SimpleNamespace(values=torch.nn.Parameter(torch.randn(23, 4, generator=generator)))
                for name in ("layers.0", "layers.2")}
    start = {name: memory.values.detach().clone() for name, memory in memories.items()}

    class RowOptimizer:
        def step_rows(self, param, rows, grad, **kwargs):
            with torch.no_grad():
                param[rows] += grad

    step = RowChangeLog(SimpleNamespace(memories=memories))
    step._start_norms = {name: table.norm(dim=1) for name, table in start.items()}
    stepped = {"layers.0": torch.tensor([1, 4, 8, 20]), "layers.2": torch.tensor([0, 3, 22])}
    optimizer = RowOptimizer()
    for name, rows in stepped.items():  # as RowGradients.finish calls the hook, then steps the rows
        step.before_rows(memories[name].values, rows)
        optimizer.step_rows(memories[name].values, rows, 0.2 * torch.randn(len(rows), 4, generator=generator))
    step.rows = {"layers.0": torch.tensor([4, 20]), "layers.2": torch.tensor([0, 3, 22])}  # 5 updated
    expected = sorted(float((memories[name].values[row] - start[name][row]).norm() / start[name][row].norm())
                      for name, rows in step.rows.items() for row in rows.tolist())
    logged = step.row_change()
    assert abs(logged["row_change"] - expected[2]) < 1e-6 * expected[2] and logged["row_change"] > 0
    assert abs(logged["row_change_vs_start"] - expected[2]) < 1e-6 * expected[2]


def test_start_norms_are_taken_a_chunk_of_rows_at_a_time_with_the_whole_tables_bits(monkeypatch):
    from smf.train import steps

    generator = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        table = torch.randn(101, 13, generator=generator).to(dtype)
        whole = torch.linalg.vector_norm(table, dim=1, dtype=torch.float32)
        monkeypatch.setattr(steps, "NORM_CHUNK_ROWS", 7)  # 15 chunks, the last one short
        assert torch.equal(steps.row_norms(table), whole)
        monkeypatch.setattr(steps, "NORM_CHUNK_ROWS", 1 << 16)
        assert torch.equal(steps.row_norms(table), whole)
