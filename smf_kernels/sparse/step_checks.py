"""What every sparse step path refuses, refused the same way, and what it does with a non-finite gradient
(docs/method.md#non-finite-gradients-and-misuse-of-a-step).

Misuse (:class:`StepMisuseError`, a RuntimeError), checked before anything changes: a step begun twice, a step
ended or finished without a begin, and a value gradient made outside the step (a forward run before
``begin_step()`` whose backward ran inside it). Non-finite gradients: before the optimizer moves anything, every
gradient of the step is checked (one host sync); with ``nonfinite="raise"`` (the default) a
:class:`NonFiniteGradientError` names the parameters holding inf or NaN, with ``"skip"`` the step is dropped and
counted. Either way no row whose own gradient was finite becomes NaN (a NaN elsewhere would otherwise reach every
row through the clipping coefficient).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

NONFINITE = ("raise", "skip")


class StepMisuseError(RuntimeError):
    """A sparse step's methods called out of order, or a gradient from outside the step; nothing was changed."""


class NonFiniteGradientError(RuntimeError):
    """A gradient of the step holds inf or NaN; the optimizer did not step. ``names`` lists the parameters."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(f"non-finite gradient (inf or NaN) in {', '.join(names)}: the step was not applied "
                         "(nonfinite='skip' drops such steps instead; lower the learning rate or check the data)")
        self.names = names


def check_nonfinite_option(nonfinite: str) -> str:
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
    return nonfinite


def begun_twice() -> StepMisuseError:
    return StepMisuseError("begin_step() called twice without finish_step(); if a forward or backward of the step "
                           "raised, call abort_step() to discard it first")


def not_begun(method: str) -> StepMisuseError:
    return StepMisuseError(f"{method}() called without begin_step()")


def gradient_from_outside(name: str) -> StepMisuseError:
    return StepMisuseError(
        f"{name} has a gradient, made by a backward of a forward run outside a step (before begin_step() or after "
        "the step's end): every forward whose backward reaches the values must run inside the step. Nothing was "
        "changed: drop it (optimizer.zero_grad(set_to_none=True)) and call abort_step() or begin_step() afresh")


def nonfinite_names(named_grads: Sequence[tuple[str, torch.Tensor]], group=None, world: int = 1) -> list[str]:
    """The names whose gradient holds inf or NaN, on any rank (``world`` > 1: one all_reduce over ``group``, so
    that every rank takes the same decision); one host sync."""
    if not named_grads:
        return []
    flags = torch.stack([~torch.isfinite(grad).all() for _, grad in named_grads]).to(torch.int32)
    if world > 1:
        flags = flags.to(named_grads[0][1].device)
        dist.all_reduce(flags, group=group)
    bad = flags.cpu()
    return [name for (name, _), flag in zip(named_grads, bad.tolist()) if flag]


def handle_nonfinite(names: list[str], nonfinite: str) -> None:
    """Raise :class:`NonFiniteGradientError` for ``names`` (policy "raise"), or log that the step is skipped."""
    if nonfinite == "raise":
        raise NonFiniteGradientError(names)
    logger.warning("non-finite gradient in %s: step skipped", ", ".join(names))
