"""SMF with SparseMemoryTrainer, the base model under accelerate's FSDP2 (docs/sharding.md):

    accelerate launch --config_file docs/accelerate/fsdp2.yaml docs/accelerate/smf_fsdp2.py --output-dir run

trains the tiny Qwen-2 with memories for a few steps on 2 processes, prints how many parameters FSDP2 sharded
and writes the memory adapter to ``run/final``; with ``--save-steps N`` the Trainer also writes its own
checkpoints (``run/checkpoint-N``: the whole model, loadable with ``smf.model.from_pretrained``), which
``--resume-from-checkpoint run/checkpoint-N`` continues. ``python docs/accelerate/smf_fsdp2.py --output-dir run1
--per-device-batch 4`` is the same global batch in one process. (accelerate 1.15 turns FSDP on only on GPUs and other
accelerators: on a CPU-only machine the command above runs DDP and prints 0 sharded parameters, whatever the
settings; docs/sharding.md says why, and tests/test_hf_fsdp2.py runs it on CPU with accelerate's state set to
FSDP2.) For a real model, load it with ``smf.model.load_with_adapter`` (or attach and retrofit memories) instead
of the tiny one, and give the trainer your dataset.
"""
import argparse

import torch
from torch.distributed.tensor import DTensor
from transformers import TrainingArguments

from smf.model import attach_memories, configure_trainable, save_memory_adapter
from smf.tiny import TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS, tiny_model
from smf_kernels.hf import SparseMemoryTrainer
from smf_kernels.sparse import SparseMemoryController


class RandomSequences(torch.utils.data.Dataset):
    """``count`` random byte sequences of ``length`` tokens, every token a target."""

    def __init__(self, count: int, length: int = 16, seed: int = 3):
        self.ids = torch.randint(0, 256, (count, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "attention_mask": torch.ones_like(self.ids[index]),
                "labels": self.ids[index]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--per-device-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save-steps", type=int, default=0, help="a Trainer checkpoint every N steps (0: none)")
    parser.add_argument("--resume-from-checkpoint", help="a Trainer checkpoint of this run to continue from")
    args = parser.parse_args()
    model = tiny_model()
    torch.manual_seed(0)
    attach_memories(model, TINY_MEMORY_LAYERS, "additive+s", **TINY_MEMORY_KWARGS)  # alpha trains too
    configure_trainable(model, "sparse")
    controller = SparseMemoryController(model, rule="tfidf", rows_per_step=16)
    background = RandomSequences(8, seed=7)
    controller.collect_background([{"input_ids": background.ids[i:i + 1]} for i in range(len(background))],
                                  progress=False)
    training = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, learning_rate=1e-2,
                                 per_device_train_batch_size=args.per_device_batch, max_grad_norm=1.0,
                                 lr_scheduler_type="constant", save_strategy="steps" if args.save_steps else "no",
                                 save_steps=args.save_steps, report_to=[], use_cpu=not torch.cuda.is_available(),
                                 dataloader_num_workers=0, seed=11, logging_steps=1)
    trainer = SparseMemoryTrainer(model=model, args=training, train_dataset=RandomSequences(16),
                                  controller=controller)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    sharded = sum(isinstance(p, DTensor) for p in trainer.model.parameters())
    if trainer.is_world_process_zero():  # the memories are plain tensors on every rank: rank 0 writes them
        total = len(list(trainer.model.parameters()))
        print(f"{trainer.args.world_size} processes, {sharded} of {total} parameters sharded by FSDP2")
        save_memory_adapter(model, f"{args.output_dir}/final")


if __name__ == "__main__":
    main()
