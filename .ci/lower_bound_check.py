"""The oldest transformers pyproject.toml accepts, checked end to end (run by .ci/run in a venv holding it).

Saves a tiny Qwen-2 with memories, loads it back with smf (``smf.model.from_pretrained``) and through the code
saved beside it in a process that cannot import smf (``trust_remote_code=True``), both with the saved logits,
then runs one ``SparseMemoryTrainer`` step and checks that only selected value rows changed and that its log holds
``grad_norm`` (4.57 logs none of its own: the trainer sets ``max_grad_norm`` to 0 and clips itself).
Prints one line per check; exits non-zero on the first failure.
"""
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import TrainingArguments

from smf.model import attach_memories, configure_trainable, from_pretrained
from smf.tiny import TINY_MEMORY_KWARGS, tiny_model
from smf_kernels.hf import SparseMemoryTrainer
from smf_kernels.sparse import SparseMemoryController

WITHOUT_SMF = r"""
import importlib.abc, sys
class NoSmf(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("smf", "smf_kernels"):
            raise ImportError(name + " is blocked: the saved code must load the model")
sys.meta_path.insert(0, NoSmf())
import torch
from transformers import AutoModelForCausalLM
ref = torch.load(sys.argv[1] + "/ref.pt", weights_only=True)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert torch.equal(model(ref["ids"]).logits, ref["logits"]), "saved code: logits differ"
print(type(model).__name__)
"""


class Sequences(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 256, (4, 10), generator=torch.Generator().manual_seed(3))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "attention_mask": torch.ones(10, dtype=torch.long),
                "labels": self.ids[index]}


def main() -> None:
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "saved"
        model = tiny_model()
        attach_memories(model, (2, 5), "additive+s", backend="torch", **TINY_MEMORY_KWARGS)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.02)
        ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            logits = model(ids).logits
        model.save_pretrained(directory)
        torch.save({"ids": ids, "logits": logits}, directory / "ref.pt")

        loaded = from_pretrained(directory, backend="torch")
        assert torch.equal(loaded(ids).logits, logits), "smf.model.from_pretrained: logits differ"
        print("smf.model.from_pretrained: equal logits")
        done = subprocess.run([sys.executable, "-c", WITHOUT_SMF, str(directory)], capture_output=True, text=True,
                              env={"HF_MODULES_CACHE": str(Path(tmp) / "modules"), "HF_HUB_OFFLINE": "1",
                                   "PATH": "/usr/bin:/bin"})
        assert done.returncode == 0, done.stderr[-3000:]
        print(f"trust_remote_code without smf: {done.stdout.strip()}, equal logits")

        configure_trainable(loaded, "sparse")
        controller = SparseMemoryController(loaded, rule="tfidf", rows_per_step=6)
        controller.collect_background([{"input_ids": ids[i:i + 1]} for i in range(2)])
        before = {name: memory.values.detach().clone() for name, memory in controller.memories.items()}
        args = TrainingArguments(output_dir=str(Path(tmp) / "trainer"), max_steps=1, per_device_train_batch_size=2,
                                 learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True, logging_steps=1)
        trainer = SparseMemoryTrainer(model=loaded, args=args, train_dataset=Sequences(), controller=controller)
        trainer.train()
        for name, memory in controller.memories.items():
            changed = (memory.values.detach() != before[name]).any(dim=1).nonzero().squeeze(1)
            selected = set(trainer.last_selected_rows[name].tolist())
            assert 0 < changed.numel() <= 6 and set(changed.tolist()) <= selected, (name, changed, selected)
        logged = [log for log in trainer.state.log_history if "loss" in log]
        assert logged and all(log.get("grad_norm", 0) > 0 for log in logged), logged
        print("SparseMemoryTrainer: one step, only selected rows changed, grad_norm logged")


if __name__ == "__main__":
    main()
