"""The oracle of the exact sparse update: dense float64 gradients, then AdamW (or SGD) restricted to the selected
rows.

:func:`dense_reference` replays optimizer steps on a float64 copy of a model with plain autograd (dense value
gradients, the torch backend), selects each step's rows from its own read counts with the rule and background,
clips the selected rows' gradients together with every other trainable gradient, and applies AdamW (or plain SGD,
``optimizer="sgd"``) written out here row by row (no smf_kernels optimizer code). An exact sparse step must equal
it: the same rows, the selected rows' values and moments within rounding, every other row and its state untouched.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from torch import nn

from smf_kernels import ProductKeyMemory
from smf_kernels.sparse import BackgroundStats
from smf_kernels.sparse.selection import score_slots


def _top_read_rows(scores: torch.Tensor, counts: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The selection, written plainly: the ``num_rows`` best-scoring read slots (ties: lower id), ascending."""
    read = [slot for slot in range(counts.numel()) if counts[slot] > 0]
    best = sorted(read, key=lambda slot: (-float(scores[slot]), slot))[:num_rows]
    return torch.tensor(sorted(best), dtype=torch.int64, device=counts.device)


def _adamw_(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    """torch.optim.AdamW's update of one tensor (float64), ``step`` already incremented (a float or a column)."""
    beta1, beta2 = betas
    param.mul_(1 - lr * weight_decay)
    exp_avg.mul_(beta1).add_((1 - beta1) * grad)
    exp_avg_sq.mul_(beta2).add_((1 - beta2) * grad * grad)
    correction1 = 1 - beta1 ** step
    correction2 = 1 - beta2 ** step
    denom = (exp_avg_sq / correction2).sqrt() + eps
    param.sub_(lr * (exp_avg / correction1) / denom)


def _sgd_(param, grad, lr, weight_decay):
    """torch.optim.SGD's update of one tensor (float64, no momentum): weight decay added to the gradient."""
    param.sub_(lr * (grad + weight_decay * param))


def dense_reference(model: nn.Module, steps: list[list], loss_fn: Callable, background: BackgroundStats, *,
                    rule: str, rows_per_step: int, lr: float, weight_decay: float,
                    max_grad_norm: float | None, betas=(0.9, 0.999), eps=1e-8, optimizer: str = "adamw") -> dict:
    """Replays ``steps`` (each a list of micro-batches; ``loss_fn(model, micro_batch)`` a scalar loss to
    backward) from ``model``'s current state, which is left untouched; ``optimizer`` "adamw" or "sgd".

    Returns {"rows": per step {layer: (T',) rows}, "params": {name: float64 tensor} of the trainable
    parameters, "state": {layer: (exp_avg, exp_avg_sq, row_step)} of every memory's values (AdamW; SGD: {})}.
    """
    ref = copy.deepcopy(model).double()
    memories = {name: m for name, m in ref.named_modules() if isinstance(m, ProductKeyMemory)}
    for memory in memories.values():
        memory.backend, memory.update_rows = "torch", None
    trainable = {name: p for name, p in ref.named_parameters() if p.requires_grad}
    tables = {f"{name}.values" if name else "values": name for name in memories}
    state = {name: (torch.zeros_like(m.values), torch.zeros_like(m.values),
                    torch.zeros(m.num_slots, dtype=torch.int64)) for name, m in memories.items()}
    dense_state = {name: [torch.zeros_like(p), torch.zeros_like(p), 0] for name, p in trainable.items()
                   if name not in tables}
    all_rows = []
    for micro_batches in steps:
        for param in trainable.values():
            param.grad = None
        for memory in memories.values():
            memory.reset_read_counts()
            memory.set_read_counting(True)
        for micro_batch in micro_batches:
            loss_fn(ref, micro_batch).backward()
        rows = {}
        for name, memory in memories.items():
            memory.set_read_counting(False)
            counts = memory.read_counts.clone()
            scores = score_slots(rule, counts, background.doc_freq[name], background.reads[name],
                                 background.num_batches[name])
            rows[name] = _top_read_rows(scores, counts, rows_per_step)
        all_rows.append(rows)
        grads = {}
        for pname, param in trainable.items():
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            grads[pname] = grad[rows[tables[pname]]] if pname in tables else grad
        if max_grad_norm is not None:
            total = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
            coef = min(1.0, max_grad_norm / (total + 1e-6))
            grads = {pname: g * coef for pname, g in grads.items()}
        with torch.no_grad():
            for pname, param in trainable.items():
                if optimizer == "sgd":
                    if pname in tables:
                        selected = rows[tables[pname]]
                        p = param[selected]
                        _sgd_(p, grads[pname], lr, weight_decay)
                        param[selected] = p
                    elif param.grad is not None:
                        _sgd_(param, grads[pname], lr, weight_decay)
                elif pname in tables:
                    layer = tables[pname]
                    exp_avg, exp_avg_sq, row_step = state[layer]
                    selected = rows[layer]
                    row_step[selected] += 1
                    p, m, v = param[selected], exp_avg[selected], exp_avg_sq[selected]
                    _adamw_(p, grads[pname], m, v, row_step[selected].double().unsqueeze(1), lr, betas, eps,
                            weight_decay)
                    param[selected], exp_avg[selected], exp_avg_sq[selected] = p, m, v
                elif param.grad is not None:
                    entry = dense_state[pname]
                    entry[2] += 1
                    _adamw_(param, grads[pname], entry[0], entry[1], float(entry[2]), lr, betas, eps, weight_decay)
    return {"rows": all_rows, "params": {name: p.detach().clone() for name, p in trainable.items()},
            "state": state if optimizer == "adamw" else {}}


def assert_matches_reference(reference: dict, rows: list[dict], params: dict, optimizer_state: dict,
                             start: dict, tol: float) -> None:
    """``rows`` (per step), ``params`` (name -> trained tensor), ``optimizer_state`` (layer -> the values'
    RowSparseAdamW state; RowSparseSGD keeps none) and ``start`` (name -> tensor before training) against
    ``reference``: the same rows, the trained tensors within ``tol`` (relative, float64), and every row never
    selected bit-identical to its start (with zero moments and step count under AdamW)."""
    assert len(rows) == len(reference["rows"])
    for got, want in zip(rows, reference["rows"]):
        assert set(got) == set(want)
        for layer in want:
            assert torch.equal(got[layer].cpu(), want[layer]), (layer, got[layer], want[layer])
    for name, want in reference["params"].items():
        got = params[name].detach().double().cpu()
        err = float((got - want).norm() / want.norm().clamp_min(1e-30))
        assert err < tol, (name, err)
    for layer in reference["rows"][0]:
        key = f"{layer}.values" if layer else "values"
        never = torch.ones(start[key].shape[0], dtype=torch.bool)
        never[torch.cat([step_rows[layer] for step_rows in reference["rows"]])] = False
        assert torch.equal(params[key].detach().cpu()[never], start[key].cpu()[never])
        if layer not in reference["state"]:
            assert not optimizer_state[layer]  # RowSparseSGD keeps no state
            continue
        exp_avg, exp_avg_sq, row_step = reference["state"][layer]
        state = optimizer_state[layer]
        assert torch.equal(state["row_step"].cpu(), row_step)
        assert not state["exp_avg"].cpu()[never].any() and not state["exp_avg_sq"].cpu()[never].any()
        for got, want in ((state["exp_avg"], exp_avg), (state["exp_avg_sq"], exp_avg_sq)):
            err = float((got.double().cpu() - want).norm() / want.norm().clamp_min(1e-30))
            assert err < tol * 10, (layer, err)
