"""Parameter accounting at the paper's Qwen-2.5-0.5B config equals docs/method.md#public-datasets-and-the-fixtures
/ the paper's appendix."""
import pytest
from torch import nn

from smf.report.accounting import accounting_markdown, lora_parameters, parameter_accounting
from smf.tiny import TINY_MEMORY_KWARGS, tiny_config


@pytest.fixture(scope="module")
def paper_rows():
    return {row.method: row for row in parameter_accounting()}


def test_paper_config_matches_spec(paper_rows):
    full, lora = paper_rows["Full finetune"], paper_rows["LoRA"]
    assert full.updated_per_step == 494_032_768  # ~494M
    assert lora.stored == lora.updated_per_step == 366_592 * 24 == 8_798_208  # ~8.8M
    per_layer_memory = 14_680_064 + 918_528 + 131_072 + 803_712 + 803_712
    removed_mlps = 3 * 3 * 896 * 4864  # ~39.2M
    for method in ("Replacement memory", "Additive memory", "Additive memory +S"):
        row = paper_rows[method]
        assert row.values == 3 * 16_384 * 896 == 44_040_192  # ~44M
        assert row.stored - (3 if "Additive" in method else 0) == 3 * per_layer_memory == 52_011_264  # ~52M
        assert row.updated_per_step == 3 * 512 * 896 + (3 if method.endswith("+S") else 0)  # 1.376M
    assert paper_rows["Replacement memory"].net_inference_change == 52_011_264 - removed_mlps  # ~+13M, +2.6%
    assert paper_rows["Additive memory"].net_inference_change == 52_011_264 + 3  # ~+52M, +10.5%
    assert paper_rows["Additive memory +S"].trained_over_run == 44_040_192 + 3


def test_markdown_table(paper_rows):
    text = accounting_markdown(list(paper_rows.values()), base_parameters=494_032_768)
    assert "| Replacement memory | 52,011,264 (52.01M) | 44,040,192 (44.04M) | +12,787,968 (12.79M), +2.6% |" in text
    assert "+52,011,267 (52.01M), +10.5%" in text and "| LoRA | 8,798,208 (8.80M) |" in text


def test_lora_counts_from_module_shapes():
    model = nn.ModuleDict({"q_proj": nn.Linear(10, 6), "other": nn.Linear(10, 10), "down_proj": nn.Linear(7, 3)})
    assert lora_parameters(model, rank=4) == 4 * (10 + 6) + 4 * (7 + 3)
    with pytest.raises(ValueError, match="rank"):
        lora_parameters(model, rank=0)


def test_tiny_config_counts_follow_memory_sizes():
    config = tiny_config()
    rows = {row.method: row for row in parameter_accounting(config, layers=(2, 4), rows_per_step=100,
                                                            lora_rank=2, **TINY_MEMORY_KWARGS)}
    slots, d = TINY_MEMORY_KWARGS["n_keys"] ** 2, config.hidden_size
    assert rows["Additive memory"].values == 2 * slots * d
    assert rows["Replacement memory"].updated_per_step == 2 * min(100, slots) * d
