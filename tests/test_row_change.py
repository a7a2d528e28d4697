"""The per-touch row change a sparse step logs (smf.train.steps.MemoryUpdateStep.row_change): the median over the
updated rows of ||v_after - v_before|| relative to the row's norm before the step and at the first step, against a
direct computation on random tables; nothing on several processes."""
from types import SimpleNamespace

import torch

from smf.train.steps import MemoryUpdateStep


def test_row_change_is_the_median_relative_change_of_the_updated_rows():
    generator = torch.Generator().manual_seed(0)
    tables = {name: torch.randn(37, 5, generator=generator) for name in ("layers.1", "layers.3")}
    memories = {name: SimpleNamespace(values=table.clone()) for name, table in tables.items()}
    step = MemoryUpdateStep.__new__(MemoryUpdateStep)  # its hooks around one step, without a controller
    step.update, step.world = SimpleNamespace(memories=memories), 1
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
