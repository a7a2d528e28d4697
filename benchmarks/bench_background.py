"""Background statistics: one document per forward (the controller's collect_background) against several per
forward (collect_background_batched), on a random-weight Qwen-2 with scaled memories: milliseconds (wall and
process CPU) per document, and how far the statistics differ (reads moved to another slot by a near-tie of the
top-k that the padded batch rounds otherwise; document frequencies changed).

    python benchmarks/bench_background.py --device cpu                        # small model, 64 documents
    python benchmarks/bench_background.py --device cuda --hidden 896 --layers 24 --intermediate 4864 --docs 256
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from smf.model import attach_memories  # noqa: E402
from smf_kernels.sparse import SparseMemoryController  # noqa: E402
from smf_kernels.sparse.background_collection import collect_background_batched  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    args = parser.parse_args()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                         num_key_value_heads=max(1, args.hidden // 128), tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).to(args.device).eval()
    attach_memories(model)  # sizes scaled to the model
    model.to(args.device)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.docs,)).tolist()
    documents = [torch.randint(1, config.vocab_size, (n,)).tolist() for n in lengths]

    def timed(run):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        stats = run()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return stats, time.perf_counter() - wall, time.process_time() - cpu

    single, wall, cpu = timed(lambda: SparseMemoryController(model, rows_per_step=1).collect_background(
        [{"input_ids": torch.tensor([d], device=args.device),
          "attention_mask": torch.ones(1, len(d), dtype=torch.long, device=args.device)} for d in documents]))
    rows = [{"batch_size": 1, "ms_per_doc_wall": 1000 * wall / args.docs, "ms_per_doc_cpu": 1000 * cpu / args.docs,
             "identical": True}]
    for batch_size in args.batch_sizes:
        stats, wall, cpu = timed(lambda: collect_background_batched(model, documents, batch_size=batch_size,
                                                                    pad_id=0, device=args.device))
        moved = sum(int((stats.reads[n] - single.reads[n]).abs().sum()) // 2 for n in single.configs)
        df_moved = sum(int((stats.doc_freq[n] - single.doc_freq[n]).abs().sum()) for n in single.configs)
        rows.append({"batch_size": batch_size, "ms_per_doc_wall": 1000 * wall / args.docs,
                     "ms_per_doc_cpu": 1000 * cpu / args.docs, "identical": moved == df_moved == 0,
                     "reads_moved": moved, "doc_freq_changed": df_moved,
                     "reads_total": sum(int(single.reads[n].sum()) for n in single.configs)})
    print(json.dumps({"device": args.device, "hidden": args.hidden, "layers": args.layers, "docs": args.docs,
                      "lengths": [args.min_len, args.max_len], "threads": torch.get_num_threads(), "rows": rows},
                     indent=1))


if __name__ == "__main__":
    main()
