"""Parameter accounting of the paper's appendix (Table "overhead"), counted on real modules.

Every number comes from modules instantiated on the ``meta`` device (shapes, no storage): the
base causal LM from its config, the same LM with memories attached by
:func:`smf.model.attach_memories` in each mode, and the LoRA targets' ``nn.Linear`` shapes.

- stored: parameters the adaptation adds and keeps (memory modules, plus ``alpha`` scalars);
- values: of those, memory value rows;
- net inference change: parameters of the adapted model minus those of the base model
  (replacement drops the MLPs at the memory layers, so it is stored minus the removed MLPs);
- updated per step: parameters that receive gradient on one stage-2 step (layers x T x value_dim,
  plus the ``alpha`` scalars in +S; all LoRA weights; every base weight for full finetuning);
- trained over the run: parameters that may change at some step (all values, +S alphas).
LoRA adds ``r * (in_features + out_features)`` per targeted projection (A and B, no bias).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from smf.model import LORA_TARGETS, PAPER_LAYERS, attach_memories, count_parameters
from smf.model.sizes import paper_qwen_config
from smf.vocabulary import DEFAULT_MODEL
from smf_kernels.sparse.selection import check_rows_per_step, default_rows_per_step

MODE_NAMES = {"replacement": "Replacement memory", "additive": "Additive memory", "additive+s": "Additive memory +S"}


@dataclass(frozen=True)
class AccountingRow:
    """Parameter counts of one method (see the module docstring for each field)."""

    method: str
    stored: int
    values: int
    net_inference_change: int
    updated_per_step: int
    trained_over_run: int
    note: str = ""


def _meta_model(config: PretrainedConfig) -> nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def lora_parameters(model: nn.Module, rank: int = 16, targets: Sequence[str] = LORA_TARGETS) -> int:
    """Parameters LoRA of rank ``rank`` adds to every ``nn.Linear`` whose name ends in one of ``targets``."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            total += rank * (module.in_features + module.out_features)
    if total == 0:
        raise ValueError(f"no nn.Linear named one of {tuple(targets)} in {type(model).__name__}")
    return total


def memory_row(config: PretrainedConfig, mode: str, layers: Sequence[int], rows_per_step: int | None,
               memory_kwargs: dict) -> AccountingRow:
    """Counts for memories of ``mode`` at ``layers`` of the model built from ``config``; ``rows_per_step`` None:
    each memory's default T (:func:`smf_kernels.sparse.selection.default_rows_per_step`: the paper's 3.1% of its
    slots, at least 1 and at most 512)."""
    base_total = count_parameters(_meta_model(config))["total"]
    model = _meta_model(config)
    blocks = attach_memories(model, layers=layers, mode=mode, **memory_kwargs)
    memory = sum(p.numel() for block in blocks for p in block.memory.parameters())
    scalars = sum(block.alpha.numel() for block in blocks if block.alpha is not None)
    values = sum(block.memory.values.numel() for block in blocks)
    trained_scalars = scalars if mode == "additive+s" else 0
    per_step = sum(min(rows_per_step or default_rows_per_step(b.memory.num_slots), b.memory.num_slots)
                   * b.memory.value_dim for b in blocks) + trained_scalars
    return AccountingRow(
        method=MODE_NAMES[mode], stored=memory + scalars, values=values,
        net_inference_change=count_parameters(model)["total"] - base_total, updated_per_step=per_step,
        trained_over_run=values + trained_scalars,
        note=f"{len(blocks)} memories of {memory // len(blocks):,} + {scalars} alpha scalars" if scalars
        else f"{len(blocks)} memories of {memory // len(blocks):,}; replaces those layers' MLPs",
    )


def parameter_accounting(config: PretrainedConfig | None = None, *, layers: Sequence[int] = PAPER_LAYERS,
                         rows_per_step: int | None = 512, lora_rank: int = 16,
                         **memory_kwargs) -> list[AccountingRow]:
    """Full finetune, LoRA, and the three memory modes, for ``config`` (default: the paper's Qwen).

    ``memory_kwargs`` are ProductKeyMemory sizes (n_keys, heads, topk, key_dim, value_dim);
    unset ones keep the paper's. ``rows_per_step`` None: each memory's default T (the paper's share of its slots).
    """
    config = paper_qwen_config() if config is None else config
    check_rows_per_step(rows_per_step)
    base = _meta_model(config)
    full = count_parameters(base)["total"]
    lora = lora_parameters(base, lora_rank)
    rows = [
        AccountingRow("Full finetune", 0, 0, 0, full, full, "every base parameter"),
        AccountingRow("LoRA", lora, 0, 0, lora, lora, f"r={lora_rank} on {', '.join(LORA_TARGETS)}; "
                      f"net change 0 if merged, +{lora:,} unmerged"),
    ]
    rows += [memory_row(config, mode, layers, rows_per_step, memory_kwargs) for mode in MODE_NAMES]
    return rows


def _count(value: int) -> str:
    return f"{value:,} ({value / 1e6:.2f}M)" if value else "0"


def accounting_markdown(rows: Sequence[AccountingRow], base_parameters: int) -> str:
    """Markdown table; the net inference change is also shown relative to ``base_parameters``."""
    lines = ["| Method | Adaptation params stored | of which values | Net inference-size change | "
             "Updated per stage-2 step | Trained over the run | Note |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        change = (f"{'+' if row.net_inference_change > 0 else ''}{_count(row.net_inference_change)}, "
                  f"{100 * row.net_inference_change / base_parameters:+.1f}%") if row.net_inference_change else "0"
        lines.append(f"| {row.method} | {_count(row.stored)} | {_count(row.values)} | {change} | "
                     f"{_count(row.updated_per_step)} | {_count(row.trained_over_run)} | {row.note} |")
    return "\n".join(lines) + "\n"
