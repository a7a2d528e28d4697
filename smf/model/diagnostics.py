"""How much a model's memories matter (docs/own-data.md#memory-diagnostics): per memory layer its alpha, the memory
branch's share of the block output, how much switching the branch off changes the next-token distribution, and how
its reads spread over the slots; and a warning when a branch is inert.

A memory branch is **inert** when switching it off (its output set to zero) changes the model's next-token
distribution by less than :data:`INERT_KL` nats per token on average (mean KL(on || off) over the batches' real
tokens): such a memory barely takes part in the model's predictions, and sparse finetuning of its rows can hardly
change them either (issue 32: a retrofit on text the model already fits left alpha near 0.01 and the memories
learned nothing; the +S mode, where alpha trains, can still learn).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from smf.model.attach import memory_blocks
from smf.model.block import MemoryBlock

logger = logging.getLogger(__name__)

INERT_KL = 1e-3  # nats per token: a branch whose removal moves the predictions less than this is inert


@dataclasses.dataclass(frozen=True)
class LayerDiagnostics:
    """One memory layer. ``branch_share``: RMS of the memory branch (``alpha * memory(h)``; the whole output for
    replacement) over RMS of the block's output, on real tokens. ``kl_off`` / ``top1_agreement``: mean KL(on || off)
    in nats per token and the fraction of tokens whose argmax stays, with this layer's branch switched off.
    ``read_entropy``: entropy (nats) of the distribution of reads over the slots, and ``read_entropy_fraction`` the
    same over log(slots) (1 = every slot read equally often); ``slots_read``: the fraction of slots read at least
    once."""

    layer: int
    mode: str
    alpha: float | None
    branch_share: float
    kl_off: float
    top1_agreement: float
    read_entropy: float
    read_entropy_fraction: float
    slots_read: float
    inert: bool


@dataclasses.dataclass(frozen=True)
class MemoryDiagnostics:
    """Every memory layer (:class:`LayerDiagnostics`, by layer index), the same two numbers with every branch
    switched off at once, and the number of real tokens measured."""

    layers: list[LayerDiagnostics]
    kl_all_off: float
    top1_agreement_all_off: float
    tokens: int

    @property
    def inert_layers(self) -> list[int]:
        return [layer.layer for layer in self.layers if layer.inert]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@contextlib.contextmanager
def _switched_off(blocks: list[MemoryBlock]) -> Iterator[None]:
    """The memory output of ``blocks`` replaced by zeros (the branch removed) while active."""
    handles = [block.memory.register_forward_hook(lambda module, args, output: torch.zeros_like(output))
               for block in blocks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _log_probs(model: nn.Module, batch: dict) -> torch.Tensor:
    """(tokens, vocab) float32 log-probabilities at the batch's real positions."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.log_softmax(logits[batch["attention_mask"].bool()].float(), dim=-1)


def _kl_and_agreement(on: torch.Tensor, off: torch.Tensor) -> tuple[float, float]:
    """(summed KL(on || off) over tokens, number of tokens whose argmax agrees)."""
    kl = (on.exp() * (on - off)).sum(dim=-1).clamp_min(0).sum()
    return float(kl), float((on.argmax(-1) == off.argmax(-1)).sum())


def _entropy(counts: torch.Tensor) -> float:
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0].double() / total
    return float(-(p * p.log()).sum())


@torch.no_grad()
def memory_diagnostics(model: nn.Module, batches: Iterable[dict], *, warn: bool = True) -> MemoryDiagnostics:
    """Measure every memory of ``model`` on ``batches`` (dicts with ``input_ids`` (batch, seq) and optionally
    ``attention_mask`` (batch, seq) of 0/1; on the model's device), in eval mode; the model's training flag, read
    counting state and counts are restored afterwards. Costs, per batch, one forward plus one per memory layer and
    one with every branch off. With ``warn``, logs a warning for each inert layer (see the module docstring)."""
    blocks = memory_blocks(model)
    if not blocks:
        raise ValueError("model holds no memories; call smf.model.attach_memories first")
    saved = [(block.memory.count_reads, block.memory.read_counts.clone()) for block in blocks]
    was_training = model.training
    model.eval()
    branch_sq = {block.layer_index: 0.0 for block in blocks}
    output_sq = dict(branch_sq)
    kl = {**{block.layer_index: 0.0 for block in blocks}, "all": 0.0}
    agree = dict(kl)
    tokens = 0
    state = {"measuring": False, "valid": None, "reads": {}}  # measuring: the forward with every branch on

    def keep_read(block):
        def hook(module, args, output):
            if state["measuring"]:
                state["reads"][block.layer_index] = output.detach()
        return hook

    def measure_share(block):
        def hook(module, args, output):  # the block's output, and its memory branch kept by keep_read
            if state["measuring"]:
                valid = state["valid"]
                branch = state["reads"][block.layer_index][valid].double()
                if block.alpha is not None:
                    branch = branch * float(block.alpha)
                branch_sq[block.layer_index] += float(branch.pow(2).sum())
                output_sq[block.layer_index] += float(output[valid].double().pow(2).sum())
        return hook

    handles = []
    try:
        for block in blocks:
            block.memory.reset_read_counts()
            handles += [block.memory.register_forward_hook(keep_read(block)),
                        block.register_forward_hook(measure_share(block))]
        for batch in batches:
            mask = batch.get("attention_mask")
            batch = {"input_ids": batch["input_ids"],
                     "attention_mask": torch.ones_like(batch["input_ids"]) if mask is None else mask}
            state.update(measuring=True, valid=batch["attention_mask"].bool())
            for block in blocks:
                block.memory.set_read_counting(True)
            on = _log_probs(model, batch)
            state.update(measuring=False, reads={})
            for block in blocks:
                block.memory.set_read_counting(False)
            tokens += on.shape[0]
            for key, switched in [*((block.layer_index, [block]) for block in blocks), ("all", blocks)]:
                with _switched_off(switched):
                    kl_sum, agreeing = _kl_and_agreement(on, _log_probs(model, batch))
                kl[key] += kl_sum
                agree[key] += agreeing
        if tokens == 0:
            raise ValueError("batches held no token to measure")
        layers = []
        for block in blocks:
            index, counts = block.layer_index, block.memory.read_counts
            entropy = _entropy(counts)
            layers.append(LayerDiagnostics(
                layer=index, mode=block.mode, alpha=None if block.alpha is None else float(block.alpha),
                branch_share=math.sqrt(branch_sq[index] / max(output_sq[index], 1e-300)),
                kl_off=kl[index] / tokens, top1_agreement=agree[index] / tokens, read_entropy=entropy,
                read_entropy_fraction=entropy / math.log(block.memory.num_slots),
                slots_read=float((counts > 0).double().mean()), inert=kl[index] / tokens < INERT_KL))
    finally:
        for handle in handles:
            handle.remove()
        for block, (counting, counts) in zip(blocks, saved):
            block.memory.set_read_counting(counting)
            block.memory.read_counts.copy_(counts)
        model.train(was_training)
    result = MemoryDiagnostics(layers, kl["all"] / tokens, agree["all"] / tokens, tokens)
    if warn:
        warn_if_inert(result)
    return result


def warn_if_inert(diagnostics: MemoryDiagnostics) -> list[int]:
    """Log a warning naming each inert memory layer of ``diagnostics``; returns their indices."""
    for layer in diagnostics.layers:
        if layer.inert:
            alpha = "" if layer.alpha is None else f", alpha {layer.alpha:.3g}"
            logger.warning(
                "the memory at layer %d is inert: switching it off changes the next-token distribution by %.2g nats "
                "per token (< %g; branch share %.3g%s), so finetuning its rows can hardly change the model. Retrofit "
                "on text the model does not already fit, longer or with a larger learning rate, or finetune with "
                "alpha training (mode additive+s); docs/own-data.md#memory-diagnostics",
                layer.layer, layer.kl_off, INERT_KL, layer.branch_share, alpha)
    return diagnostics.inert_layers
