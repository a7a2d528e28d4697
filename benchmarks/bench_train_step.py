"""One training step of each recipe on a Qwen-2.5-0.5B-shaped model: time, throughput and peak memory.

The model is Qwen2ForCausalLM built from Qwen-2.5-0.5B's architecture with random
weights (nothing is downloaded). Each recipe is set up as ``smf train`` sets it up
(:mod:`smf.train.recipes`) from the same library objects, and stepped by :func:`train_step`, the trainer's
:func:`smf.train.loop.run_step` for one process (bf16 autocast on CUDA, the authors' protocol's loss, gradient
clipping, the recipe's optimizer; tests/test_bench_train_step.py holds the two to bit-identical parameters and
losses over two steps). It imports nothing that needs pydantic (``smf.train.config``, ``recipes`` and ``loop``
do), so that it runs on a stock CUDA image without it; :data:`LR` and :class:`StepSettings` are ``smf train``'s
defaults (the same test compares them):

  sparse    three additive memories (layers 6, 12, 18, paper size), only the top-T value
            rows train (TF-IDF against random background counts), RowSparseAdamW
  retrofit  the same memories, every memory parameter trains densely, AdamW
  lora      peft LoRA r = 16 on the seven projections of every layer, AdamW
  full      every parameter, AdamW

A step is the paper's: a global batch of 16 sequences of up to 1,024 tokens as 4
micro-batches of 4 (right-padded to random lengths between half and all of
``--seq-len``). Reported per recipe: median step time, tokens per second, the step's
time over full finetuning's, peak memory allocated during a step (CUDA), trainable
parameters, and on CUDA the host's and the GPU's busy time in one profiled step (when
the host's exceeds the GPU's, the step is bound by the host); on CPU the peak column is the
process's resident-set high-water mark (run one recipe per process to read it per recipe).
``--compile`` compiles each model as ``smf train --compile`` does; ``--rows-first`` makes the
sparse step fill rows first: count reads in a no-grad forward and select before its backwards (the fill
``smf train`` takes when a step's kept reads would outweigh a dense gradient) instead of keeping
its reads until the step's end (fill "reads_kept"). ``--jsonl PATH`` saves each recipe's row the moment it
finishes, a recipe that raises (out of memory, say) costing that recipe only (benchmarks/guarded.py).

    python benchmarks/bench_train_step.py                     # CUDA, the paper's step
    python benchmarks/bench_train_step.py --tiny --device cpu # the tiny model, seconds on CPU
    python benchmarks/bench_train_step.py --device cpu --micro-batches 4 --micro-batch-size 1 --seq-len 128 \
        --warmup 1 --repeats 2                                # the 0.5B model on CPU, a few minutes
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

RECIPES = ("sparse", "retrofit", "lora", "full")
LR = {"retrofit": 5e-4, "sparse": 5e-4, "lora": 2e-4, "full": 5e-5}  # smf.train.config.RECIPE_LR


@dataclass(frozen=True)
class StepSettings:
    """The options the trainer's step reads, at ``smf train``'s defaults (smf.train.config.RunConfig.resolved)."""

    recipe: str
    bf16: str = "auto"
    max_grad_norm: float = 1.0
    protocol: str = "authors"
    compile: bool = False


@dataclass
class StepSetup:
    """What :func:`train_step` needs of a recipe (the fields of smf.train.recipes.TrainingSetup it reads)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: object  # smf.train.steps.StepHooks


# Qwen/Qwen2.5-0.5B-Instruct's config.json (architecture fields).
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True)


def build_model(tiny: bool):
    """(model in fp32 on CPU, memory layers, memory sizes): Qwen-2.5-0.5B-shaped, or the tiny preset's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from smf.vocabulary import TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS

    if tiny:
        from smf.tiny import tiny_config

        return Qwen2ForCausalLM(tiny_config()), list(TINY_MEMORY_LAYERS), dict(TINY_MEMORY_KWARGS)
    fields = dict(QWEN25_05B)
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
    return Qwen2ForCausalLM(Qwen2Config(**fields)), [6, 12, 18], dict(n_keys=128, heads=4, topk=16, key_dim=256)


def build_setup(recipe: str, tiny: bool, device: torch.device, rows_per_step: int, backend: str | None,
                rows_first: bool = False, compile: bool = False):
    """(:class:`StepSetup`, :class:`StepSettings`, trainable parameters) for ``recipe``, as ``smf train`` builds
    its setup from a hub model."""
    from smf.model import apply_lora, attach_memories, configure_trainable
    from smf.train.steps import DenseStep, MemoryUpdateStep, bf16_autocast
    from smf_kernels.sparse import BackgroundStats, RowSparseAdamW, SparseMemoryController

    model, layers, memory = build_model(tiny)
    settings = StepSettings(recipe=recipe, compile=compile)
    step = DenseStep()
    if recipe in ("sparse", "retrofit"):
        attach_memories(model, layers, "additive", alpha_init=0.01, backend=backend, **memory)
        configure_trainable(model, recipe)
    if recipe == "lora":
        model = apply_lora(model, r=16, alpha=32, dropout=0.05)
    if recipe == "full":
        configure_trainable(model, "full")
    model.to(device).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    if recipe == "sparse":
        controller = SparseMemoryController(model, rule="tfidf", rows_per_step=rows_per_step)
        background = BackgroundStats.for_memories(controller.memories)
        generator = torch.Generator().manual_seed(0)
        for name, module in controller.memories.items():
            for _ in range(4):  # four background documents with random reads
                background.add_batch(name, torch.randint(0, 3, (module.values.shape[0],), generator=generator))
        controller.set_background(background)
        # rows_first: a bound above any slot count, so that plan_fill fills rows first under accumulation
        step = MemoryUpdateStep(controller, bf16_autocast(settings.bf16, device), compiled=compile,
                                step_tokens=2 ** 62 if rows_first else None)
        optimizer = RowSparseAdamW(trainable, lr=LR[recipe])
    else:
        optimizer = torch.optim.AdamW(trainable, lr=LR[recipe])
    return StepSetup(model, optimizer, step), settings, sum(p.numel() for p in trainable)


def cosine_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int):
    """smf.train.loop.cosine_schedule: linear warm-up from 0, then cosine decay to 0 at ``total_steps``."""
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, warmup_steps, total_steps)


def train_step(model: torch.nn.Module, setup: StepSetup, scheduler, batches: list[dict], num_tokens: int,
               settings: StepSettings, device: torch.device) -> torch.Tensor:
    """One optimizer step over ``batches``: smf.train.loop.run_step in one process (no DDP or FSDP). ``model``: the
    model to call (compiled or not); ``num_tokens``: target tokens of the whole step. Returns the summed loss (0-d)."""
    import torch.nn.functional as F

    from smf.data import IGNORE_INDEX, get_protocol
    from smf.train.steps import bf16_autocast

    autocast = bf16_autocast(settings.bf16, device)
    per_micro_batch = settings.recipe == "sparse" and get_protocol(settings.protocol).sparse_loss_sums_micro_batch_means
    setup.step.begin_step(model if settings.compile else setup.model, batches)
    loss_sum = torch.zeros((), device=device)
    for batch in batches:
        with autocast():  # smf.train.loop.summed_token_loss
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            shifted = logits[:, :-1].float()
            loss = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        setup.step.after_forward()
        if per_micro_batch:  # smf.train.loop.micro_batch_mean_scale: computed on the device, no host sync
            tokens = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
            scale = (1.0 / tokens.clamp(min=1).double()).float()
        else:
            scale = 1 / max(num_tokens, 1)
        (loss * scale).backward()
        loss_sum += loss.detach()
    setup.step.finish_step(setup.optimizer, max_grad_norm=settings.max_grad_norm)
    scheduler.step()
    return loss_sum


def micro_batches(vocab: int, count: int, size: int, seq_len: int, device: torch.device, seed: int) -> list[dict]:
    """``count`` micro-batches of ``size`` right-padded sequences of random tokens (lengths seq_len/2..seq_len)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (size, seq_len), generator=generator)
        lengths = torch.randint(seq_len // 2, seq_len + 1, (size,), generator=generator)
        mask = torch.arange(seq_len)[None, :] < lengths[:, None]
        labels = torch.where(mask, ids, -100)
        batches.append({"input_ids": ids.to(device), "attention_mask": mask.long().to(device),
                        "labels": labels.to(device)})
    return batches


def _rss_high_water_gib() -> float:
    """This process's resident-set high-water mark so far (Linux: ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def measure(recipe: str, args, device: torch.device) -> dict:
    torch.manual_seed(0)
    setup, settings, trainable = build_setup(recipe, args.tiny, device, args.rows, args.backend, args.rows_first,
                                           args.compile)
    model = torch.compile(setup.model, mode="reduce-overhead") if args.compile else setup.model
    vocab = setup.model.config.vocab_size
    scheduler = cosine_schedule(setup.optimizer, warmup_steps=1, total_steps=args.warmup + args.repeats + 1)
    times, peak = [], 0
    for index in range(args.warmup + args.repeats):
        batches = micro_batches(vocab, args.micro_batches, args.micro_batch_size, args.seq_len, device, seed=index)
        real_tokens = sum(int(b["attention_mask"].sum()) for b in batches)  # the loss is averaged over these
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        train_step(model, setup, scheduler, batches, real_tokens, settings, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak = max(peak, torch.cuda.max_memory_allocated(device))
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    padded_tokens = args.micro_batches * args.micro_batch_size * args.seq_len
    result = dict(recipe=recipe, step_ms=step_s * 1e3, padded_tokens_per_s=padded_tokens / step_s,
                  peak_gib=peak / 2 ** 30 if device.type == "cuda" else _rss_high_water_gib(), trainable=trainable,
                  host_ms=None, device_ms=None)
    if device.type == "cuda":  # one more step under the profiler: the host's work beside the GPU's
        batches = micro_batches(vocab, args.micro_batches, args.micro_batch_size, args.seq_len, device, seed=args.warmup + args.repeats)
        real_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
        result["host_ms"], result["device_ms"] = profile_step(
            lambda: train_step(model, setup, scheduler, batches, real_tokens, settings, device), device)
    del setup
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def profile_step(step, device: torch.device) -> tuple[float, float]:
    """(host ms, GPU ms) of one call of ``step``: the profiler's total self CPU time of every op (the host's
    dispatch and launch work, Python between ops not counted) and total self CUDA time of every kernel."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    events = prof.key_averages()
    return (sum(e.self_cpu_time_total for e in events) / 1e3, sum(e.self_device_time_total for e in events) / 1e3)


def table(results: list[dict]) -> str:
    """Markdown rows of :func:`measure` results and of failed recipes ({"item", "reason"})."""
    full = next((r["step_ms"] for r in results if r.get("recipe") == "full"), None)
    lines = ["| recipe | trainable params | step ms | tokens/s (padded) | step / full | peak GiB | host ms | GPU ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "reason" in r:
            lines.append(f"| {r['item']} | failed: {r['reason']} | - | - | - | - | - | - |")
            continue
        ratio = f"{r['step_ms'] / full:.2f}x" if full else "-"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        host = f"{r['host_ms']:.1f}" if r["host_ms"] is not None else "-"
        gpu = f"{r['device_ms']:.1f}" if r["device_ms"] is not None else "-"
        lines.append(f"| {r['recipe']} | {r['trainable']:,} | {r['step_ms']:.1f} | {r['padded_tokens_per_s']:,.0f} "
                     f"| {ratio} | {peak} | {host} | {gpu} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--tiny", action="store_true", help="the tiny preset's model and memories instead of 0.5B")
    p.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES), help="recipes to step")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (default: 4)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch (default: 4)")
    p.add_argument("--seq-len", type=int, default=1024, help="padded sequence length (default: 1024)")
    p.add_argument("--rows", type=int, default=512, help="T: value rows trained per memory per step (sparse)")
    p.add_argument("--backend", default=None, help="memory kernel backend (default: automatic)")
    p.add_argument("--rows-first", action="store_true",
                   help="the sparse step fills rows first: counts reads in a no-grad forward and selects before its "
                        "backwards (default: fill reads_kept)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every recipe's model (mode reduce-overhead), as smf train --compile does")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps; the median is reported (default: 5)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--jsonl", metavar="PATH",
                   help="append each recipe's row to PATH the moment it finishes; a recipe that raises (out of memory, "
                        "say) costs that recipe only (benchmarks/guarded.py)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu --tiny)")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    from guarded import run_items

    rows = run_items(args.recipes, lambda recipe: measure(recipe, args, device), args.jsonl, device)
    results = [r["result"] for r in rows if r["event"] == "done"]
    print(f"one step on {name}: {'tiny' if args.tiny else 'Qwen-2.5-0.5B-shaped'} model, {args.micro_batches} "
          f"micro-batches of {args.micro_batch_size} x {args.seq_len} tokens, T = {args.rows}\n")
    print(table([r["result"] if r["event"] == "done" else r for r in rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if len(results) == len(rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
