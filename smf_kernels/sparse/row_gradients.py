"""One step's gradients after the step's backwards, and the finishing sequence that applies them
(docs/method.md#what-sparse-means).

**The finishing sequence**, :meth:`RowGradients.finish`, the one every caller goes through (``finish_step``, the
step's :meth:`~smf_kernels.sparse.MemoryStep.finish` that ``smf train`` and the Trainer call, and a caller's own
:meth:`RowGradients.apply`): its arguments are checked once, before anything moves (:func:`check_finish`); then
every gradient of the step is checked for inf / NaN (:mod:`~smf_kernels.sparse.step_checks`: raise, or skip the
step), all of them are clipped with the rows' gradients in the norm (a sharded table's shard counting as the whole
table), the optimizer's parameters step, the selected rows are updated (``optimizer.step_rows``, the clipping
coefficient applied as they step; ``before_rows(values, rows)`` is called first, a caller's hook), and the
gradients are zeroed.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from smf_kernels.sharded.placement import NormPart, placement_of
from smf_kernels.sparse import step_checks
from smf_kernels.sparse.clipping import check_max_norm, clip_coefficient

# Called with (values (M, D) parameter, rows (T,) int64) right before a table's rows step.
BeforeRows = Callable[[nn.Parameter, torch.Tensor], None]


class StepResult(NamedTuple):
    """What :meth:`RowGradients.finish` did: ``selected``, layer name -> (T',) int64 rows that moved (ascending;
    empty when skipped); ``grad_norm``, the norm of every gradient of the step before clipping (a 0-d tensor;
    None without clipping or when skipped); ``skipped``, True when a non-finite gradient dropped the step."""

    selected: dict[str, torch.Tensor]
    grad_norm: torch.Tensor | None
    skipped: bool


@dataclass(frozen=True)
class Finish:
    """A finishing sequence's arguments, as :func:`check_finish` checked them: ``params``, the optimizer's
    parameters; ``max_grad_norm``, a float > 0 or None (no clipping); ``nonfinite``, "raise" or "skip"."""

    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]
    max_grad_norm: float | None
    nonfinite: str


def check_finish(optimizer: torch.optim.Optimizer, values: dict[str, nn.Parameter], *, rows: bool,
                 max_grad_norm: float | None, nonfinite: str) -> Finish:
    """Everything a finishing sequence needs, checked once before anything moves: ``max_grad_norm`` (None or
    :func:`~smf_kernels.sparse.clipping.check_max_norm`), ``optimizer`` with a ``step_rows`` when the step updates
    ``rows`` (TypeError), every table of ``values`` (layer name -> values) among its parameters, and its groups'
    hyper-parameters in range (its ``check_groups()``, where it has one) (ValueError). ``nonfinite`` is the
    caller's, already checked (:func:`~smf_kernels.sparse.step_checks.check_nonfinite_option`)."""
    max_grad_norm = None if max_grad_norm is None else check_max_norm(max_grad_norm)
    if rows and not hasattr(optimizer, "step_rows"):
        raise TypeError("the sparse update needs an optimizer with step_rows (RowSparseAdamW or RowSparseSGD), "
                        f"got {type(optimizer).__name__}; nothing was changed: finish the step with one")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    held = {id(p) for p in params}
    missing = [f"{name}.values" if name else "values" for name, table in values.items() if id(table) not in held]
    if missing:
        raise ValueError(f"the optimizer does not hold {', '.join(missing)}; nothing was changed: finish the step "
                         "with an optimizer over the value tables")
    check = getattr(optimizer, "check_groups", None)  # RowSparseAdamW, RowSparseSGD: a group out of range
    if callable(check):
        check()
    return Finish(optimizer, params, max_grad_norm, nonfinite)


def _local_grad(param: torch.Tensor) -> tuple[torch.Tensor, NormPart | None]:
    """(this rank's part of ``param.grad``, what its squared norm is summed over: a :class:`NormPart` for a
    sharded memory's column shard or an FSDP shard, None for a whole gradient), as ``param``'s placement says."""
    placement = placement_of(param)
    return placement.local(param.grad), placement.norm_part


@dataclass
class RowGradients:
    """One step's gradients after :meth:`MemoryStep.end_step <smf_kernels.sparse.MemoryStep.end_step>`, ready for
    the finishing sequence (:meth:`apply`).

    ``tables``: layer name -> (values (M, D) parameter, rows (T,) int64 ascending, grad (T, D) float32 averaged
    over ranks, valid (T,) bool: rows marked False pad the selection, were not read and do not move); empty for
    the ablations, whose masked dense value gradients are the values' ``.grad``, and for a dense step
    (``smf train``'s retrofit, lora and full recipes: every gradient is a ``.grad``).
    ``names``: parameter -> its name in the model (for errors). ``selected``: layer name -> (T',) int64 rows the
    step updates (ascending).
    """

    tables: dict[str, tuple[nn.Parameter, torch.Tensor, torch.Tensor, torch.Tensor]]
    names: dict[int, str]
    selected: dict[str, torch.Tensor]
    process_group: Any = None
    world: int = 1
    applied: bool = field(default=False, init=False)  # set once the step is finished: it is finished once
    discarded: bool = field(default=False, init=False)  # set by discard (abort_step): apply is refused

    def nonfinite(self, parameters: Iterable[torch.Tensor]) -> list[str]:
        """Names of the parameters whose gradient (a value table's: its rows') holds inf or NaN on any rank."""
        named = [(self.names.get(id(p), "a parameter"), _local_grad(p)[0]) for p in parameters if p.grad is not None]
        named += [(f"{name}.values" if name else "values", grad) for name, (_, _, grad, _) in self.tables.items()]
        return step_checks.nonfinite_names(named, self.process_group, self.world)

    def clip_(self, parameters: Iterable[torch.Tensor], max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(total norm, clipping coefficient) of the gradients of ``parameters`` together with the rows' (a
        sharded table's column shard and an FSDP shard counting as the whole parameter); the parameters' gradients
        are scaled in place, the rows' are not: the coefficient scales them as they step. ``max_norm``: a number
        > 0 (inf: no clipping); NaN, a negative or a non-number is refused before anything is scaled."""
        return self._clip(list(parameters), check_max_norm(max_norm))

    def _clip(self, parameters: list[torch.Tensor], max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
        with_grad = [p for p in parameters if p.grad is not None]
        if any(p.grad.is_sparse for p in with_grad):
            raise RuntimeError("a sparse .grad in a sparse step: the exact update keeps the rows' gradient compact")
        parts = [_local_grad(p) for p in with_grad]
        parts += [(grad, placement_of(values).norm_part) for values, _, grad, _ in self.tables.values()]
        total, coef = clip_coefficient([grad for grad, _ in parts], max_norm, shards=[shard for _, shard in parts])
        for grad, _ in parts[:len(with_grad)]:
            grad.mul_(coef.to(grad.dtype))
        return total, coef

    def apply(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None,
              nonfinite: str = "raise") -> StepResult:
        """The finishing sequence (see the module docstring): check every gradient of the step for inf / NaN,
        clip all of them to ``max_grad_norm`` (None: no clipping) with the rows' in the norm, step ``optimizer``
        (the parameters with a ``.grad``, then each layer's selected rows: a :class:`RowSparseAdamW` or
        :class:`RowSparseSGD` when there are rows) and zero its gradients.

        A non-finite gradient drops every gradient of ``optimizer``'s parameters (nothing moves), then raises
        :class:`~smf_kernels.sparse.step_checks.NonFiniteGradientError` (``nonfinite="raise"``) or returns a
        skipped :class:`StepResult` (``"skip"``); either way the step is over. Refused before anything changes (the
        step can then be finished by a call that is right): a bad ``max_grad_norm``, an optimizer without
        ``step_rows`` when there are rows, one that does not hold a value table, a group's hyper-parameter out of
        range (the optimizer's ``check_groups()``), a second call (the rows would step twice), and gradients
        :meth:`discard`-ed.
        """
        nonfinite = step_checks.check_nonfinite_option(nonfinite)
        return self.finish(check_finish(optimizer, {name: values for name, (values, _, _, _) in self.tables.items()},
                                        rows=bool(self.tables), max_grad_norm=max_grad_norm, nonfinite=nonfinite))

    def finish(self, checked: Finish, before_rows: BeforeRows | None = None) -> StepResult:
        """The finishing sequence of :meth:`apply` with arguments :func:`check_finish` checked; ``before_rows``
        (optional) is called with each table and its rows right before they step."""
        self._check_unfinished()
        optimizer, params = checked.optimizer, checked.params
        bad = self.nonfinite(params)
        if bad:  # the step is over either way: its gradients are dropped
            self.applied = True
            for param in params:
                param.grad = None
            step_checks.handle_nonfinite(bad, checked.nonfinite)
            return StepResult({name: rows[:0] for name, rows in self.selected.items()}, None, True)
        total, coef = (None, None) if checked.max_grad_norm is None else self._clip(params, checked.max_grad_norm)
        optimizer.step()  # the parameters with a .grad (e.g. alpha; an ablation's values); the rows have none
        for values, rows, grad, valid in self.tables.values():
            if before_rows is not None:
                before_rows(values, rows)
            optimizer.step_rows(values, rows, grad, grad_scale=coef, valid=valid)
        optimizer.zero_grad(set_to_none=True)
        self.applied = True
        return StepResult(self.selected, total, False)

    def _check_unfinished(self) -> None:
        if self.discarded:
            raise step_checks.StepMisuseError("these RowGradients were discarded by abort_step(): their step is "
                                              "over; begin_step() starts the next one")
        if self.applied:
            raise step_checks.StepMisuseError("these RowGradients were applied already: each step's gradients "
                                              "finish it once (end_step() returns a step's)")

    def discard(self) -> None:
        """Drop these gradients unapplied (what :meth:`MemoryStep.abort_step` does with an ended step's): a later
        :meth:`apply` is refused. The gradients of parameters outside the value tables (``.grad``) are the
        caller's: ``optimizer.zero_grad()``."""
        if not self.applied:
            self.discarded = True
