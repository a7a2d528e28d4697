"""What a suite run cost, recorded beside what it kept (docs/science.md, "Cost"): optimizer steps, training tokens,
CPU seconds (process time, per stage) and an estimate of the training stage's floating-point operations.

The estimate counts, per training token (the tokens of the step's examples, padding left out):

- forward: 2 x N, where N (``parameters``) is every parameter a token's forward multiplies through: all of the
  trained model's parameters (the embedding counted once, as the tied output head) except the memory value tables,
  of which a token reads heads x top-k rows per memory layer (those rows counted);
- backward: 2 x N for the activations' gradients, plus 2 x N_trained (``trained``) for the weights' gradients:
  every parameter for full finetuning, the LoRA weights for LoRA, the value rows a token reads (and alpha, where it
  trains) for sparse finetuning.

So full finetuning costs 6 N per token, LoRA and sparse finetuning about 4 N. The retrofit and background stages a
sparse run starts from are shared by every sparse run of a seed (and variant) and are not in its estimate; their CPU
seconds are recorded beside it. The sparse update's counting forward, where a step of several micro-batches needs
one, is not counted.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from torch import nn

from smf_kernels.memory import ProductKeyMemory


def parameter_counts(model: nn.Module, recipe: str) -> dict[str, int]:
    """``{"parameters": N, "trained": N_trained}`` per token of ``model`` (as loaded for evaluation) trained by
    ``recipe`` (sparse, lora or full; see the module docstring)."""
    memories = [module for module in model.modules() if isinstance(module, ProductKeyMemory)]
    read = sum(memory.heads * memory.topk * memory.value_dim for memory in memories)
    total = sum(p.numel() for p in model.parameters()) - sum(memory.values.numel() for memory in memories) + read
    if recipe == "full":
        trained = total
    elif recipe == "lora":
        trained = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
    elif recipe == "sparse":
        alphas = sum(p.numel() for name, p in model.named_parameters() if name.rsplit(".", 1)[-1] == "alpha")
        trained = read + alphas  # alpha trains in additive+s only; a few scalars either way
    else:
        raise ValueError(f"recipe must be sparse, lora or full, got {recipe!r}")
    return {"parameters": int(total), "trained": int(trained)}


def log_records(log_path: Path) -> list[dict]:
    """The rows of a training stage's ``train_log.jsonl``."""
    return [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]


def training_cost(records: list[dict], counts: dict[str, int]) -> dict:
    """``steps``, ``tokens`` and estimated ``flops`` of a training stage from its log ``records`` and the model's
    :func:`parameter_counts` (kept in the result)."""
    tokens = sum(int(record["tokens"]) for record in records)
    return {"steps": len(records), "tokens": tokens, **counts,
            "flops": float(tokens * (4 * counts["parameters"] + 2 * counts["trained"]))}


def median_row_change(records: list[dict], field: str = "row_change") -> float | None:
    """The median over a sparse run's steps of each step's median relative row change (``field`` of its log:
    ``row_change``, to the row's norm before the step, or ``row_change_vs_start``, to its norm when training started;
    :class:`smf.train.steps.MemoryUpdateStep`); None when the log does not record it at every step."""
    changes = [record[field] for record in records if field in record]
    return statistics.median(changes) if changes and len(changes) == len(records) else None


def sparse_step_stats(records: list[dict]) -> dict:
    """Mean per optimizer step of a sparse run's train_log.jsonl ``records``: rows selected (all layers) and value
    rows that moved without being selected (all layers); and, where the log records them, ``row_change`` and
    ``row_change_vs_start``: the median over steps of the median per-touch row change relative to the row's norm
    before the step, and when training started (:mod:`smf.suite.cost`)."""
    changes = {field: median_row_change(records, field) for field in ("row_change", "row_change_vs_start")}
    return {"steps": len(records),
            "selected_rows": sum(r["selected_rows"] for r in records) / max(len(records), 1),
            "rows_moved_outside": sum(r["rows_moved_outside"] for r in records) / max(len(records), 1),
            **{field: change for field, change in changes.items() if change is not None}}
