"""Pretraining a small Qwen-2 from scratch on a synthetic world's old knowledge (the science preset's base model).

:func:`pretrain_world` trains ``Qwen2ForCausalLM`` (sizes of :class:`PretrainOptions`) with the world tokenizer
(:mod:`smf.data.world_tokenizer`) on the world's ``pretrain`` texts, one text per sequence followed by a blank line
(as the held-out perplexity joins its texts), loss on every token, shuffled per epoch by (seed, epoch); AdamW,
linear warm-up then cosine decay over ``epochs``. (Packing the texts into 128-token sequences was tried: at the same
number of tokens it took a quarter of the optimizer steps and reached 0.21 old-QA accuracy instead of 0.94.)

**Stopping rule.** After every epoch the old-QA accuracy is measured; training stops at the first epoch end where it
reaches ``target_accuracy`` (0.98), or after ``epochs``. A fixed number of epochs made the base depend on the machine:
30 epochs gave 0.713 on one CPU and 1.000 on another (the memorisation of the old facts happens late and abruptly,
and floating-point paths move when); trained to the target, every machine's base knows the old facts.

**What identifies a base** (:func:`pretrain_fingerprint`): the world and pretrain options, :data:`CODE_VERSION`
(bumped whenever this module or the world's generator would compute another base from the same options), a digest
of the pretraining texts and one of the tokenizer's vocabulary and merges. A finished directory is reused only
when its fingerprint matches and its files still have the digests recorded when they were written.

**Memories pretrained with the model** (``memory``: :class:`PretrainMemory`): additive memories attached to the fresh
decoder, every parameter trained from the first step; saved as a model with memories plus a memory adapter of them in
``final/`` (:func:`save_base`), so a plain ``from_pretrained`` never gives the decoder without them, and sparse
finetuning, LoRA and full finetuning start from it without a retrofit. Bases saved before 2026-11-29 hold a plain
decoder beside the adapter: smf loads them as before (with a warning), :func:`upgrade_base` re-lays them
(``--upgrade``). The fingerprint covers the memory options; a plain base's is computed as before the option
existed.

**Shipped bases.** The science preset's bases are package assets (``smf/assets/science/base-seed{S}/``, 1.2 MB each,
made by ``python -m smf.train.pretrain --config science --seed S --output-dir DIR --ship-to DEST``; the with-memories
bases of ``--config science_pretrained`` in ``base-memories-seed{S}/``, of ``science_pretrained16k`` in
``base-memories16k-seed{S}/``, their weights held once and xz-compressed: :mod:`smf.train.shipped_layout`): where an
asset's fingerprint equals the one asked for (and ``use_shipped`` is on), it is copied instead of pretrained, each
file checked against its recorded digest, so every machine starts from the same weights, to the bit. The run
directory::

    pretrain_checkpoint.pt    model, optimizer, step and fingerprint (every ``save_every`` steps; tensors only)
    final/                    save_pretrained model + tokenizer (``--model DIR`` takes it; with memories also their
                              memory adapter: ``--model DIR --adapter DIR``)
    pretrain_stage.json       written last: fingerprint, file digests, old-QA accuracy, epochs, seconds, source

A directory with a checkpoint of the same fingerprint resumes from it (the data order is a function of the step, so
a resumed run ends where an uninterrupted one does); an unreadable checkpoint is discarded (logged) and training
starts over; a directory of another fingerprint is refused.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from typing import Annotated

import torch
from pydantic import ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt
from tqdm.auto import tqdm

from smf.data.world import WorldOptions, build_world, chance_accuracy
from smf.environment import environment
from smf.errors import ConfigError
from smf.files import file_sha256, read_json_object, write_json_atomic
from smf.options import OPTIONS_CONFIG, Distinct, checked, checked_option, mapping, read_file, section_names
from smf.train.config import CONFIGS
from smf.train.shipped_layout import missing_shipped, unpack_shipped, write_shipped

logger = logging.getLogger(__name__)

CHECKPOINT = "pretrain_checkpoint.pt"
MARKER = "pretrain_stage.json"
FINAL = "final"
CODE_VERSION = 2  # 2: the stopping rule on old-QA accuracy (1: a fixed number of epochs)
SHIPPED = Path(__file__).resolve().parents[1] / "assets" / "science"


@dataclass(frozen=True)
class PretrainMemory:
    """Memories attached before pretraining (``pretrain.memory:``): additive product-key memories at ``layers``,
    trained with every other parameter from the first step (Lin et al. 2025's setting; the retrofit's sizes and
    names). The base is saved as a model with memories plus a memory adapter (``final/``), so sparse finetuning, LoRA
    and full finetuning start from it without a retrofit."""

    __pydantic_config__ = ConfigDict(allow_inf_nan=False, extra="forbid")

    layers: Annotated[tuple[NonNegativeInt, ...], Field(min_length=1), Distinct]  # 0-based decoder layers
    n_keys: PositiveInt = 32  # sub-keys per half: n_keys ** 2 slots per memory layer
    heads: PositiveInt = 2
    topk: PositiveInt = 8  # slots read per head per token
    key_dim: Annotated[int, Field(gt=0, multiple_of=2)] = 32
    alpha_init: PositiveFloat = 1.0  # the memory branch's initial scale (out = mlp(h) + alpha * mem(h))

    def __post_init__(self) -> None:
        if self.topk > self.n_keys:
            raise ValueError(f"memory: topk ({self.topk}) must be at most n_keys ({self.n_keys})")


@dataclass(frozen=True)
class PretrainOptions:
    """Model sizes and optimisation of the pretraining stage (``pretrain:`` of a suite config)."""

    __pydantic_config__ = OPTIONS_CONFIG

    hidden_size: PositiveInt = 64
    intermediate_size: PositiveInt = 256
    num_layers: PositiveInt = 4
    num_heads: PositiveInt = 4
    num_kv_heads: PositiveInt = 2
    epochs: PositiveInt = 40  # at most; the cosine schedule's length
    target_accuracy: Annotated[float, Field(gt=0, le=1)] = 0.98  # stop at the first epoch end reaching it
    lr: PositiveFloat = 3e-3
    batch_size: PositiveInt = 32  # texts per step
    warmup_steps: NonNegativeInt = 50
    weight_decay: float = 0.0
    seed: NonNegativeInt = 0
    save_every: PositiveInt = 500  # optimizer steps between checkpoints (not part of the fingerprint)
    use_shipped: bool = True  # copy a shipped base of the same fingerprint instead of pretraining (not fingerprinted)
    memory: PretrainMemory | None = None  # None: a plain decoder (the retrofit adds memories later)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads}), "
                             f"and num_heads of num_kv_heads ({self.num_kv_heads})")
        beyond = [i for i in (self.memory.layers if self.memory else ()) if i >= self.num_layers]
        if beyond:
            raise ValueError(f"memory: layers {beyond} are beyond the model's {self.num_layers} decoder layers "
                             f"(valid: 0 to {self.num_layers - 1})")

    @classmethod
    def from_dict(cls, raw: dict | None) -> "PretrainOptions":
        return checked(cls, mapping(raw, "pretrain", cls.__dataclass_fields__), section_names("pretrain"))

    def to_dict(self) -> dict:
        return asdict(self)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def tokenizer_digest(tokenizer) -> str:
    """16 hex digits of the tokenizer's vocabulary and merges (what decides every token id)."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    return _digest({"vocab": model["vocab"], "merges": model["merges"]})


def pretrain_fingerprint(world_options, options: PretrainOptions, texts: list[str], tokenizer) -> str:
    """16 hex digits of everything that decides the pretrained model (module docstring; not ``save_every`` nor
    ``use_shipped``)."""
    ignored = ("save_every", "use_shipped") + (("memory",) if options.memory is None else ())  # plain: as before
    return _digest({"world": world_options.pretraining_dict(), "code": CODE_VERSION, "texts": _digest(texts),
                    "tokenizer": tokenizer_digest(tokenizer),
                    "pretrain": {k: v for k, v in options.to_dict().items() if k not in ignored}})


def base_fingerprint(world_options, options: PretrainOptions) -> str:
    """The :func:`pretrain_fingerprint` :func:`pretrain_world` gives the base of ``world_options`` + ``options``
    (builds the world and loads its tokenizer: what ``smf suite --dry-run`` compares a finished base with)."""
    from smf.data.world_tokenizer import world_tokenizer  # transformers and tokenizers, as world_model's

    world = build_world(world_options)
    texts = [row["text"] + "\n\n" for row in world.datasets["pretrain"]]
    return pretrain_fingerprint(world_options, options, texts, world_tokenizer(world.options))


def file_digests(directory: Path) -> dict[str, str]:
    """file name -> sha256 of every file in ``directory`` (a saved model and tokenizer)."""
    return {path.name: file_sha256(path) for path in sorted(directory.iterdir()) if path.is_file()}


def world_model(options: PretrainOptions, tokenizer):
    """A randomly initialised Qwen2ForCausalLM of ``options``' sizes for ``tokenizer`` (seeded by options.seed), with
    the fresh memories of ``options.memory`` attached (initialised after the decoder, from the same seed)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM  # the suite's config checks import this module

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=options.hidden_size, intermediate_size=options.intermediate_size,
        num_hidden_layers=options.num_layers, num_attention_heads=options.num_heads,
        num_key_value_heads=options.num_kv_heads, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(options.seed)
        model = Qwen2ForCausalLM(config)
        if options.memory is not None:
            from smf.model.attach import attach_memories  # transformers: suite config checks import this module

            memory = options.memory
            attach_memories(model, list(memory.layers), "additive", alpha_init=memory.alpha_init,
                            n_keys=memory.n_keys, heads=memory.heads, topk=memory.topk, key_dim=memory.key_dim)
        return model


def save_base(model, options: PretrainOptions, tokenizer, final: Path) -> None:
    """Save the pretrained ``model`` and ``tokenizer`` to ``final`` (``save_pretrained``). With ``options.memory``
    the model is saved with its memories, as every model with memories is (:mod:`smf.model.hf_auto`: a plain
    ``from_pretrained`` gives it with them, or asks for ``trust_remote_code``; never the decoder alone), and a
    memory adapter of them beside it (``memory_adapter.safetensors`` / ``.json``,
    :func:`smf.model.save_memory_adapter`, recording no base model: the folder moves), so ``--model final
    --adapter final`` starts sparse finetuning, LoRA and full finetuning from the network as pretrained."""
    model.save_pretrained(final)
    if options.memory is not None:
        from smf.model.adapter import ADAPTER_CONFIG, save_memory_adapter  # as world_model's

        save_memory_adapter(model, final)
        config = json.loads((final / ADAPTER_CONFIG).read_text())
        write_json_atomic(final / ADAPTER_CONFIG, {**config, "base_model": None})
    tokenizer.save_pretrained(final)


def upgrade_base(final: str | Path) -> bool:
    """Re-lay the base pretrained with memories in ``final`` (a pretraining's ``final/``, its record one folder up,
    or a shipped base's folder, its record inside) from the layout written until 2026-11-29, a plain decoder
    (``config.json`` of type ``qwen2``, which transformers loads without the memories, silently) beside its memory
    adapter, to :func:`save_base`'s; the record's file digests follow. The weights stay bit for bit (checked before
    anything is replaced). Returns False, changing nothing, when ``final`` already has the current layout;
    ConfigError when it holds no such base or its files differ from its record."""
    from smf.model.adapter import ADAPTER_CONFIG, load_memory_adapter  # transformers, as world_model's
    from smf.model.loading import load_base

    final = Path(final)
    marker_path = final / MARKER if (final / MARKER).is_file() else final.parent / MARKER
    if not (final / ADAPTER_CONFIG).is_file() or not marker_path.is_file():
        raise ConfigError(f"--upgrade {final}: not a base pretrained with memories (needs {ADAPTER_CONFIG} there and "
                          f"{MARKER} there or one folder up)")
    marker = read_json_object(marker_path, "pretraining marker", ("files",))
    if _digests(final, marker_path) != marker["files"]:
        raise ConfigError(f"--upgrade {final}: its files differ from those {marker_path} recorded; pretrain it again")
    if json.loads((final / "config.json").read_text()).get("model_type", "").endswith("_smf_memories"):
        return False
    decoder, _ = load_base(str(final))
    load_memory_adapter(decoder, final)
    staged = final.with_name(final.name + ".upgrading")
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(final, staged, ignore=shutil.ignore_patterns("model*.safetensors*"))
    decoder.save_pretrained(staged)
    whole, _ = load_base(str(staged))
    if whole.state_dict().keys() != decoder.state_dict().keys() or not all(
            torch.equal(tensor, decoder.state_dict()[name]) for name, tensor in whole.state_dict().items()):
        shutil.rmtree(staged)
        raise ConfigError(f"--upgrade {final}: the re-laid model does not load back bit for bit; nothing changed")
    retired = final.with_name(final.name + ".retired")
    shutil.rmtree(retired, ignore_errors=True)
    final.rename(retired)
    staged.rename(final)
    write_json_atomic(marker_path, {**marker, "files": _digests(final, marker_path)})
    shutil.rmtree(retired)
    logger.info("%s: re-laid as a model with memories; %s records its new file digests", final, marker_path)
    return True


def _digests(final: Path, marker_path: Path) -> dict[str, str]:
    """:func:`file_digests` of ``final`` without the record, where it lies inside (a shipped base)."""
    return {name: digest for name, digest in file_digests(final).items()
            if final / name != marker_path}


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


def _finished(output_dir: Path, fingerprint: str) -> dict | None:
    """The marker of a finished, intact base of ``fingerprint`` in ``output_dir``, None when there is none;
    ConfigError when it is another base's, or its files changed since they were written."""
    marker_path = output_dir / MARKER
    if not marker_path.is_file():
        return None
    marker = read_json_object(marker_path, "pretraining marker", ("fingerprint",))
    if marker["fingerprint"] != fingerprint:
        raise ConfigError(f"{output_dir} holds a model pretrained with other world or pretrain options, or by an "
                          "older pretraining; delete it or use another directory")
    final = output_dir / FINAL
    if not isinstance(marker.get("files"), dict) or not final.is_dir() or file_digests(final) != marker["files"]:
        raise ConfigError(f"{final}: its files differ from those {marker_path} recorded (changed, truncated or "
                          "missing); delete the directory to pretrain again")
    return marker


def _damaged(source: Path, what: str) -> ConfigError:
    return ConfigError(f"the shipped base {source}: {what} (a damaged install?); reinstall, or set "
                       "pretrain.use_shipped: false to pretrain here")


def _shipped_record(directory: Path) -> dict:
    """The record (``pretrain_stage.json``) of the shipped base in ``directory``: a JSON object with its
    ``fingerprint`` and ``files`` (name -> sha256); the "damaged install" ConfigError naming the file otherwise."""
    path = directory / MARKER
    if not path.is_file():
        raise _damaged(directory, f"its record {path} is missing")
    try:
        record = read_json_object(path, "shipped base record", ("fingerprint", "files"))
    except ConfigError as err:
        raise _damaged(directory, str(err)) from None
    files = record["files"]
    if not isinstance(files, dict) or not all(isinstance(name, str) and "/" not in name and name not in ("", ".", "..")
                                              and isinstance(digest, str) for name, digest in files.items()):
        raise _damaged(directory, f"its record {path} does not map file names to digests")
    return record


def _shipped(fingerprint: str) -> Path | None:
    """The shipped base (``smf/assets/science/*``) of ``fingerprint``, if any (every record read: one damaged
    record is named, whichever base is asked for)."""
    records = {directory: _shipped_record(directory) for directory in sorted(SHIPPED.glob("base-*"))}
    return next((directory for directory, record in records.items() if record["fingerprint"] == fingerprint), None)


def _copy_shipped(source: Path, output_dir: Path) -> dict:
    marker = _shipped_record(source)
    final = output_dir / FINAL
    stray = sorted(path.name for path in final.iterdir() if path.name not in marker["files"]) if final.is_dir() else []
    if stray:
        raise ConfigError(f"{final} holds {', '.join(stray)}, not a file of the shipped base this output folder "
                          f"({output_dir}) is to receive: delete {final} (or the folder) or use another --output-dir")
    missing = missing_shipped(source, marker["files"])
    if missing:
        raise _damaged(source, f"{', '.join(missing)} missing")
    final.mkdir(parents=True, exist_ok=True)
    try:
        unpack_shipped(source, marker["files"], final)
    except ConfigError as err:
        raise _damaged(source, str(err)) from None
    marker = {**marker, "source": f"shipped ({source.name})"}
    write_json_atomic(output_dir / MARKER, marker)
    return marker


def ship_base(output_dir: str | Path, destination: str | Path) -> None:
    """Lay out the finished base in ``output_dir`` (its ``final/`` and record) as a shipped base in the new folder
    ``destination`` (``smf/assets/science/base-*``: the files as :mod:`smf.train.shipped_layout` ships them, the
    record beside them), checked by unpacking it again; ConfigError when ``output_dir`` holds no intact finished
    base or ``destination`` exists."""
    output_dir, destination = Path(output_dir), Path(destination)
    marker = read_json_object(output_dir / MARKER, "pretraining marker", ("fingerprint", "files"))
    _finished(output_dir, marker["fingerprint"])  # its files still have the recorded digests
    if destination.exists():
        raise ConfigError(f"--ship-to {destination}: it exists; delete it or name a new folder")
    staged = destination.with_name(f".{destination.name}.partial")  # not a base-* folder the lookup would read
    shutil.rmtree(staged, ignore_errors=True)
    try:
        write_shipped(output_dir / FINAL, marker["files"], staged)
        shutil.copyfile(output_dir / MARKER, staged / MARKER)
        with tempfile.TemporaryDirectory() as scratch:
            unpack_shipped(staged, marker["files"], Path(scratch))
        staged.rename(destination)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def _load_checkpoint(path: Path, fingerprint: str, model, optimizer) -> int:
    """The step of the checkpoint at ``path`` after loading it into ``model`` and ``optimizer``; 0 (logged) when
    it cannot be read; ConfigError when it is another run's."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated or not a torch file: start over rather than fail
        logger.warning("%s cannot be read (%s); pretraining starts over", path, str(err).splitlines()[0][:120])
        return 0
    if not isinstance(state, dict) or state.get("fingerprint") != fingerprint:
        raise ConfigError(f"{path} is from a run with other world or pretrain options (or none recorded); delete it")
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return int(state["step"])
    except (KeyError, RuntimeError, ValueError, TypeError) as err:
        raise ConfigError(f"{path} does not hold this model's pretraining state "
                          f"({str(err).splitlines()[0][:160]}); delete it") from None


def pretrain_world(world_options, options: PretrainOptions, output_dir: str | Path) -> dict:
    """Pretrain (or reuse, copy from the shipped bases, or resume) the model of ``world_options`` + ``options`` in
    ``output_dir`` (see the module docstring). Returns the marker: {"fingerprint", "files", "seconds",
    "old_qa_accuracy", "chance", "final_loss", "epochs_trained", "reached_target", "skipped", ...}."""
    from smf.data.world_tokenizer import world_tokenizer  # transformers and tokenizers, as world_model's

    output_dir = Path(output_dir)
    world = build_world(world_options)
    tokenizer = world_tokenizer(world.options)
    texts = [row["text"] + "\n\n" for row in world.datasets["pretrain"]]
    fingerprint = pretrain_fingerprint(world_options, options, texts, tokenizer)
    marker = _finished(output_dir, fingerprint)
    if marker is not None:
        return {**marker, "skipped": True}
    shipped = _shipped(fingerprint) if options.use_shipped else None
    if shipped is not None:
        logger.info("base %s: the shipped %s (same fingerprint)", fingerprint, shipped.name)
        return {**_copy_shipped(shipped, output_dir), "skipped": True}
    output_dir.mkdir(parents=True, exist_ok=True)
    features = [tokenizer(text)["input_ids"] for text in texts]
    model = world_model(options, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=options.weight_decay)
    steps_per_epoch = len(features) // options.batch_size
    if steps_per_epoch == 0:
        raise ConfigError(f"pretrain: batch_size {options.batch_size} exceeds the {len(features)} pretraining texts")
    total = steps_per_epoch * options.epochs
    checkpoint_path = output_dir / CHECKPOINT
    step = _load_checkpoint(checkpoint_path, fingerprint, model, optimizer) if checkpoint_path.is_file() else 0
    if step:
        logger.info("pretraining resumes at step %d of at most %d", step, total)
    retain = world.datasets["eval_retain"]
    started, batches_epoch, accuracy, loss = time.perf_counter(), None, None, None
    if step and step % steps_per_epoch == 0:  # resumed at an epoch end: the rule may already have stopped there
        accuracy = old_qa_accuracy(model.eval(), tokenizer, retain)
    with tqdm(total=total, initial=step, desc="pretrain", unit="step") as progress:
        while step < total and not (accuracy is not None and accuracy >= options.target_accuracy):
            epoch, position = divmod(step, steps_per_epoch)
            if epoch != batches_epoch:
                batches, batches_epoch = epoch_batches(features, options.batch_size, options.seed, epoch), epoch
            model.train()
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
            progress.set_postfix(loss=f"{loss.item():.3f}", old_acc="?" if accuracy is None else f"{accuracy:.3f}")
            end_of_epoch = step % steps_per_epoch == 0
            if end_of_epoch:
                accuracy = old_qa_accuracy(model.eval(), tokenizer, retain)
            if step % options.save_every == 0 or step == total or (end_of_epoch and
                                                                    accuracy >= options.target_accuracy):
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                            "fingerprint": fingerprint}, checkpoint_path)
    model.eval()
    if accuracy is None or step % steps_per_epoch:  # the last epoch's end was not measured (a partial epoch)
        accuracy = old_qa_accuracy(model, tokenizer, retain)
    final = output_dir / FINAL
    save_base(model, options, tokenizer, final)
    marker = {"fingerprint": fingerprint, "files": file_digests(final), "seconds": round(time.perf_counter() - started, 3),
              "old_qa_accuracy": accuracy, "chance": chance_accuracy(),
              "final_loss": None if loss is None else round(loss.item(), 4),
              "parameters": sum(p.numel() for p in model.parameters()), "steps": step,
              "epochs_trained": step // steps_per_epoch, "reached_target": accuracy >= options.target_accuracy,
              "source": "pretrained here", "environment": environment()}
    write_json_atomic(output_dir / MARKER, marker)
    checkpoint_path.unlink()
    if not marker["reached_target"]:
        logger.warning("pretraining stopped after %d epochs at old-QA accuracy %.3f, below the target %.2f: raise "
                       "pretrain.epochs", options.epochs, accuracy, options.target_accuracy)
    logger.info("pretrained: old-QA accuracy %.3f (chance %.3f) after %d epochs", accuracy, marker["chance"],
                marker["epochs_trained"])
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


def main(argv: list[str] | None = None) -> int:
    """``python -m smf.train.pretrain --config science --seed S --output-dir DIR``: pretrain the base of a suite
    config's world and pretraining options (with ``base_per_seed``, world and pretraining seed ``S``) here, never
    copying a shipped one (a finished one is reused): the command that remakes the shipped bases
    (``smf/assets/science/``), ``--ship-to DEST`` laying it out as one (:func:`ship_base`). ``--upgrade FINAL``
    re-lays a base pretrained with memories before 2026-11-29 instead (:func:`upgrade_base`)."""
    parser = argparse.ArgumentParser(prog="python -m smf.train.pretrain", description=main.__doc__)
    parser.add_argument("--config", help="suite config: a file or a shipped name (default: science)")
    parser.add_argument("--seed", type=int, help="world and pretraining seed (base_per_seed suites only; default 0)")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--output-dir", help="where pretrain_stage.json and final/ go")
    target.add_argument("--upgrade", metavar="FINAL", help="re-lay the final/ folder of a base pretrained with "
                        "memories before 2026-11-29 (a plain decoder beside its memory adapter) as a model with "
                        "memories (upgrade_base), and exit")
    parser.add_argument("--ship-to", metavar="DEST", help="with --output-dir: then lay the base out as a shipped "
                        "base in the new folder DEST (smf/assets/science/base-*; ship_base)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.upgrade is not None:
        if args.config is not None or args.seed is not None or args.ship_to is not None:
            parser.error("--upgrade takes no --config, --seed or --ship-to (the base's folder says what it is)")
        try:
            changed = upgrade_base(args.upgrade)
        except ConfigError as err:
            parser.exit(2, f"error: {err}\n")
        print(f"{args.upgrade}: {'re-laid as a model with memories' if changed else 'already a model with memories'}")
        return 0
    args.config = args.config or "science"
    try:
        path = Path(args.config) if Path(args.config).is_file() else CONFIGS / f"suite_{args.config}.yaml"
        if not path.is_file():
            raise ConfigError(f"--config {args.config!r}: no such file, nor a shipped suite config")
        raw = read_file(path)
        if not raw.get("world") or not raw.get("pretrain"):  # else a default world's base, unasked for
            raise ConfigError(f"--config {args.config!r}: no world and pretrain sections, so no base to pretrain")
        if args.seed is not None and not raw.get("base_per_seed"):  # else ignored: the sections give the seeds
            raise ConfigError(f"--seed {args.seed}: {path.name} has no base_per_seed; its world and pretrain sections "
                              "give the seeds")
        seeded = {"seed": args.seed or 0} if raw.get("base_per_seed") else {}
        world = WorldOptions.from_dict({**mapping(raw["world"], "world"), **seeded})
        options = PretrainOptions.from_dict({**mapping(raw["pretrain"], "pretrain"), **seeded, "use_shipped": False})
        threads = checked_option("threads", PositiveInt | None, raw.get("threads"))  # as the suite checks it
        if threads is not None:
            torch.set_num_threads(threads)
        marker = pretrain_world(world, options, args.output_dir)
        if args.ship_to is not None:
            ship_base(args.output_dir, args.ship_to)
    except ConfigError as err:
        parser.exit(2, f"error: {err}\n")
    print(json.dumps({k: v for k, v in marker.items() if k != "environment"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
