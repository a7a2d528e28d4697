"""Device memory per rank of SMF, LoRA and full finetuning under DDP, FSDP2 and sharded memories: a byte model.

Parameters are counted on modules built on the ``meta`` device (no weights, no download): Qwen-2.5-0.5B, 7B and
72B from their published architectures, with the paper's memories scaled to each model (smf.model.sizes: layers
at 1/4, 1/2 and 3/4 of the depth, slots growing with the MLP width) attached in mode additive+s. Bytes per rank,
for ``W`` data-parallel ranks and the trainer's defaults (fp32 weights, bf16 autocast, AdamW, 4 x 1,024 tokens
per rank and micro-batch, T = 512 rows per memory and step):

- base: the base model's weights, 4 bytes each; under FSDP2 a 1/W shard;
- memories: every memory parameter (4 bytes), with the value tables' AdamW moments (8 bytes per element) and
  the per-slot ``row_step`` and read counts (8 + 8 bytes) for SMF; ``--shard-memories`` splits values and moments
  by columns (1/W), the rest stays replicated;
- training state: gradients + AdamW moments of what trains besides the memories (12 bytes per parameter: every
  base weight for full finetuning, the LoRA weights (r = 16, seven projections) for LoRA; SMF: the T rows'
  compact gradient); under FSDP2 a 1/W shard;
- FSDP transient: the whole (fp32) parameters of the root unit (embeddings / output head, kept gathered for the
  step) and of one decoder layer being computed, plus that layer's whole gradient before its reduce-scatter
  when the base model trains (full);
- activations (independent of W): per token and decoder layer, the tensors autograd keeps in bf16 (two norm
  inputs in fp32, q, k, v, the attention output, the MLP's gate, up, activation and product: 2 (2 h + 2 kv +
  4 I) + 8 h bytes) and the logits (bf16, their fp32 copy and its gradient: 10 V bytes per token).

Not counted: the CUDA context and allocator slack, communication buffers, the CPU-side background statistics.

    python benchmarks/fsdp_memory_model.py            # docs/sharding.md's tables
"""
from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from smf.model import attach_memories
from smf.model.sizes import scaled_memory_sizes

GIB = 2 ** 30
TOKENS_PER_RANK = 4 * 1024
ROWS_PER_STEP = 512
LORA_RANK = 16
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WORLDS = (8, 64)
# The published config.json of each model (hidden, MLP width, layers, heads, key/value heads, vocabulary, tied).
MODELS = {
    "Qwen-2.5-0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                          num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen-2.5-7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                        num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "Qwen-2.5-72B": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
ENGINES = ("DDP", "FSDP2", "FSDP2 + sharded memories")


def counts(name: str) -> dict:
    """Parameter and size counts of model ``name`` with its scaled memories (meta device)."""
    config = Qwen2Config(**MODELS[name])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    base = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    root = model.model.embed_tokens.weight.numel() + model.model.norm.weight.numel()
    if not config.tie_word_embeddings:
        root = max(root, model.lm_head.weight.numel())  # the embeddings are a unit of their own then
    lora = sum(LORA_RANK * (m.in_features + m.out_features) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in LORA_TARGETS)
    sizes = scaled_memory_sizes(config)
    with torch.device("meta"):
        blocks = attach_memories(model, layers=sizes["layers"], mode="additive+s",
                                 **{k: sizes[k] for k in ("n_keys", "heads", "topk", "key_dim")})
    memories = [block.memory for block in blocks]
    kv = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    return {"base": base, "layer": layer, "root": root, "lora": lora, "hidden": config.hidden_size,
            "layers": config.num_hidden_layers, "kv": kv, "mlp": config.intermediate_size,
            "vocab": config.vocab_size, "slots": sum(m.num_slots for m in memories),
            "values": sum(m.values.numel() for m in memories), "value_dim": memories[0].value_dim,
            "memory_params": sum(p.numel() for m in memories for p in m.parameters()) + len(blocks),
            "memory_layers": len(blocks), "n_keys": sizes["n_keys"]}


def per_rank(c: dict, recipe: str, engine: str, world: int) -> dict[str, float]:
    """Bytes per rank of ``recipe`` (sparse, lora, full) under ``engine`` at ``world`` ranks (module docstring)."""
    fsdp = engine != "DDP"
    shard = world if fsdp else 1
    out = {"base": 4 * c["base"] / shard}
    if recipe == "sparse":
        split = world if engine.endswith("sharded memories") else 1
        values = c["values"]
        out["memories"] = 4 * (c["memory_params"] - values) + 12 * values / split + 16 * c["slots"]
        out["training state"] = 4 * c["memory_layers"] * ROWS_PER_STEP * c["value_dim"] / split
    else:
        out["memories"] = 0
        trained = c["base"] if recipe == "full" else c["lora"]
        out["training state"] = 12 * trained / shard
    out["FSDP transient"] = 4 * (c["root"] + c["layer"] * (2 if recipe == "full" else 1)) if fsdp else 0
    per_token_layer = 2 * (2 * c["hidden"] + 2 * c["kv"] + 4 * c["mlp"]) + 8 * c["hidden"]
    out["activations"] = TOKENS_PER_RANK * (c["layers"] * per_token_layer + 10 * c["vocab"])
    out["total"] = sum(out.values())
    return out


def table(name: str) -> str:
    """docs/sharding.md's table of model ``name``: GiB per rank by recipe, engine and world size."""
    c = counts(name)
    head = (f"**{name}**: {c['base'] / 1e9:.2f}B base parameters; memories at {c['memory_layers']} layers, "
            f"{c['n_keys'] ** 2:,} slots x {c['value_dim']} each ({c['values'] / 1e9:.3f}B values)\n\n"
            "| recipe | engine | W | base | memories | training state | FSDP transient | activations | total |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for recipe in ("sparse", "lora", "full"):
        for engine in ENGINES if recipe == "sparse" else ENGINES[:2]:
            for world in WORLDS if engine != "DDP" else WORLDS[:1]:  # DDP replicates: the same at any W
                b = per_rank(c, recipe, engine, world)
                shown = world if engine != "DDP" else "any"
                rows.append(f"| {recipe} | {engine} | {shown} | " + " | ".join(
                    f"{b[k] / GIB:.2f}" for k in ("base", "memories", "training state", "FSDP transient",
                                                  "activations", "total")) + " |")
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print("\n\n".join(table(name) for name in MODELS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
