"""Pretraining a small Qwen-2 from scratch on a synthetic world's old knowledge (the science preset's model).

:func:`pretrain_world` trains ``Qwen2ForCausalLM`` (sizes of :class:`PretrainOptions`) with the world tokenizer
(:mod:`smf.data.world_tokenizer`) on the world's ``pretrain`` texts, one text per sequence followed by a blank line
(as the held-out perplexity joins its texts), loss on every token, shuffled per epoch by (seed, epoch); AdamW,
linear warm-up then cosine decay. (Packing the texts into 128-token sequences was tried: at the same number of tokens
it took a quarter of the optimizer steps and reached 0.21 old-QA accuracy instead of 0.94.) The texts are short (about
30 tokens), so the held-out perplexity's windows must be too (the science preset's 32). The run directory::

    pretrain_checkpoint.pt    model, optimizer and step (every ``save_every`` steps; tensors only)
    final/                    save_pretrained model + tokenizer (``--model DIR`` takes it)
    pretrain_stage.json       written last: fingerprint (world + pretrain options), seconds, old-QA accuracy

A directory whose marker matches the fingerprint is reused; one with a checkpoint of the same fingerprint resumes
from it (the data order is a function of the step, so a resumed run ends where an uninterrupted one does); one of
another fingerprint is refused. CPU-sized: about a minute of CPU per 10 epochs of the default world.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from pydantic import NonNegativeInt, PositiveFloat, PositiveInt
from tqdm.auto import tqdm

from smf.errors import ConfigError
from smf.files import read_json_object, write_json_atomic
from smf.options import OPTIONS_CONFIG, checked

logger = logging.getLogger(__name__)

CHECKPOINT = "pretrain_checkpoint.pt"
MARKER = "pretrain_stage.json"
FINAL = "final"


@dataclass(frozen=True)
class PretrainOptions:
    """Model sizes and optimisation of the pretraining stage (``pretrain:`` of a suite config)."""

    __pydantic_config__ = OPTIONS_CONFIG

    hidden_size: PositiveInt = 64
    intermediate_size: PositiveInt = 256
    num_layers: PositiveInt = 4
    num_heads: PositiveInt = 4
    num_kv_heads: PositiveInt = 2
    epochs: PositiveInt = 40
    lr: PositiveFloat = 3e-3
    batch_size: PositiveInt = 32  # texts per step
    warmup_steps: NonNegativeInt = 50
    weight_decay: float = 0.0
    seed: NonNegativeInt = 0
    save_every: PositiveInt = 500  # optimizer steps between checkpoints (not part of the fingerprint)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads}), "
                             f"and num_heads of num_kv_heads ({self.num_kv_heads})")

    @classmethod
    def from_dict(cls, raw: dict | None) -> "PretrainOptions":
        return checked(cls, dict(raw or {}), lambda name: f"pretrain: option {name!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def pretrain_fingerprint(world_options, options: PretrainOptions) -> str:
    """16 hex digits of everything that decides the pretrained model (not ``save_every``)."""
    settings = {"world": world_options.to_dict(),
                "pretrain": {k: v for k, v in options.to_dict().items() if k != "save_every"}}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def world_model(options: PretrainOptions, tokenizer):
    """A randomly initialised Qwen2ForCausalLM of ``options``' sizes for ``tokenizer`` (seeded by options.seed)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=options.hidden_size, intermediate_size=options.intermediate_size,
        num_hidden_layers=options.num_layers, num_attention_heads=options.num_heads,
        num_key_value_heads=options.num_kv_heads, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(options.seed)
        return Qwen2ForCausalLM(config)


def epoch_batches(features: list[list[int]], batch_size: int, seed: int, epoch: int) -> list[list[list[int]]]:
    """The batches of epoch ``epoch``: ``features`` in an order fixed by (seed, epoch), cut into whole batches."""
    order = list(range(len(features)))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return [[features[i] for i in order[start:start + batch_size]]
            for start in range(0, len(order) - batch_size + 1, batch_size)]


def collate(batch: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask, labels (batch, longest), right padded; labels -100 on padding."""
    longest = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), longest), -100, dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        labels[row, :len(ids)] = torch.tensor(ids)
    return {"input_ids": input_ids, "attention_mask": (labels != -100).long(), "labels": labels}


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))


def pretrain_world(world_options, options: PretrainOptions, output_dir: str | Path) -> dict:
    """Pretrain (or reuse, or resume) the model of ``world_options`` + ``options`` in ``output_dir`` (see the module
    docstring). Returns the marker: {"fingerprint", "seconds", "old_qa_accuracy", "chance", "skipped"}."""
    from smf.data.world import build_world, chance_accuracy
    from smf.data.world_tokenizer import world_tokenizer

    output_dir = Path(output_dir)
    fingerprint = pretrain_fingerprint(world_options, options)
    marker_path = output_dir / MARKER
    if marker_path.is_file():
        marker = read_json_object(marker_path, "pretraining marker", ("fingerprint",))
        if marker["fingerprint"] != fingerprint:
            raise ConfigError(f"{output_dir} holds a model pretrained with other world or pretrain options; delete "
                              "it or use another directory")
        return {**marker, "skipped": True}
    output_dir.mkdir(parents=True, exist_ok=True)
    world = build_world(world_options)
    tokenizer = world_tokenizer()
    features = [tokenizer(row["text"] + "\n\n")["input_ids"] for row in world.datasets["pretrain"]]
    model = world_model(options, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=options.weight_decay)
    steps_per_epoch = len(features) // options.batch_size
    if steps_per_epoch == 0:
        raise ConfigError(f"pretrain: batch_size {options.batch_size} exceeds the {len(features)} pretraining texts")
    total = steps_per_epoch * options.epochs
    step, checkpoint_path = 0, output_dir / CHECKPOINT
    if checkpoint_path.is_file():
        state = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
        if state["fingerprint"] != fingerprint:
            raise ConfigError(f"{checkpoint_path} is from a run with other world or pretrain options; delete it")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        logger.info("pretraining resumes at step %d of %d", step, total)
    started, batches_epoch = time.perf_counter(), None
    model.train()
    with tqdm(total=total, initial=step, desc="pretrain", unit="step") as progress:
        while step < total:
            epoch, position = divmod(step, steps_per_epoch)
            if epoch != batches_epoch:
                batches, batches_epoch = epoch_batches(features, options.batch_size, options.seed, epoch), epoch
            batch = collate(batches[position], tokenizer.pad_token_id)
            for group in optimizer.param_groups:
                group["lr"] = options.lr * _lr_factor(step, options.warmup_steps, total)
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            progress.update(1)
            progress.set_postfix(loss=f"{loss.item():.3f}")
            if step % options.save_every == 0 or step == total:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                            "fingerprint": fingerprint}, checkpoint_path)
    model.eval()
    model.save_pretrained(output_dir / FINAL)
    tokenizer.save_pretrained(output_dir / FINAL)
    accuracy = old_qa_accuracy(model, tokenizer, world.datasets["eval_retain"])
    marker = {"fingerprint": fingerprint, "seconds": round(time.perf_counter() - started, 3),
              "old_qa_accuracy": accuracy, "chance": chance_accuracy(), "final_loss": round(loss.item(), 4),
              "parameters": sum(p.numel() for p in model.parameters()), "steps": total}
    write_json_atomic(marker_path, marker)
    checkpoint_path.unlink()
    logger.info("pretrained: old-QA accuracy %.3f (chance %.3f)", accuracy, marker["chance"])
    return {**marker, "skipped": False}


@torch.no_grad()
def old_qa_accuracy(model, tokenizer, rows) -> float:
    """Share of ``rows`` (own-data qa) whose greedy first answer token is the first answer word (the world's answers
    are one token each)."""
    prompts = [tokenizer(f"Question: {row['question']}\nAnswer:")["input_ids"] for row in rows]
    targets = [tokenizer(f"Question: {row['question']}\nAnswer: {row['answers'][0]}")["input_ids"][len(prompt)]
               for row, prompt in zip(rows, prompts)]
    correct = 0
    for start in range(0, len(prompts), 64):
        chunk = prompts[start:start + 64]
        longest = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), longest), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(chunk):  # left padding: the next token is predicted at the last position
            ids[row, longest - len(prompt):] = torch.tensor(prompt)
            mask[row, longest - len(prompt):] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -1]
        correct += sum(int(p == t) for p, t in zip(logits.argmax(-1).tolist(), targets[start:start + 64]))
    return correct / len(prompts)
