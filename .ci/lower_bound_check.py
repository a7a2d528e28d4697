"""The oldest transformers pyproject.toml accepts, checked end to end (run by .ci/run in a venv holding it).

Saves a tiny Qwen-2 with memories, loads it back with smf (``smf.model.from_pretrained``) and through the code
saved beside it in a process that cannot import smf (``trust_remote_code=True``), both with the saved logits, loads
its tokenizer subfolder there with nothing on stderr (no custom-code prompt: smf.model.saved_tokenizer),
loads the checkpoint saved before the memory projections were renamed (tests/fixtures/old_projection_names) with
smf, with the old code's logits, and saves it again under the new names (loaded back without smf), then runs one
``SparseMemoryTrainer`` step and checks that only selected value rows changed and that its log holds
``grad_norm`` (4.57 logs none of its own: the trainer sets ``max_grad_norm`` to 0 and clips itself).
Prints one line per check; exits non-zero on the first failure.
"""
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import TrainingArguments

from smf.model import attach_memories, configure_trainable, from_pretrained, save_tokenizer
from smf.tiny import TINY_MEMORY_KWARGS, tiny_model, tiny_tokenizer
from smf_kernels.hf import SparseMemoryTrainer
from smf_kernels.sparse import SparseMemoryController

OLD_NAMES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "old_projection_names"
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
TOKENIZER_WITHOUT_SMF = WITHOUT_SMF[:WITHOUT_SMF.index("import torch")] + r"""
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], subfolder="tokenizer")
print(tokenizer("ab").input_ids)
"""


class Sequences(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 256, (4, 10), generator=torch.Generator().manual_seed(3))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "attention_mask": torch.ones(10, dtype=torch.long),
                "labels": self.ids[index]}


def _load_without_smf(directory: Path, tmp: str, script: str = WITHOUT_SMF) -> str:
    """What ``script`` prints in a process without smf: the class it loads ``directory`` as (``trust_remote_code=True``,
    its ``ref.pt`` logits), or the token ids of its tokenizer subfolder (``TOKENIZER_WITHOUT_SMF``, which must load
    with nothing on stderr: no custom-code prompt, no model-type warning)."""
    done = subprocess.run([sys.executable, "-c", script, str(directory)], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env={"HF_MODULES_CACHE": str(Path(tmp) / "modules"),
                                                         "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert script != TOKENIZER_WITHOUT_SMF or not done.stderr.strip(), done.stderr[-3000:]
    return done.stdout.strip()


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
        save_tokenizer(tiny_tokenizer(), directory)
        torch.save({"ids": ids, "logits": logits}, directory / "ref.pt")

        loaded = from_pretrained(directory, backend="torch")
        assert torch.equal(loaded(ids).logits, logits), "smf.model.from_pretrained: logits differ"
        print("smf.model.from_pretrained: equal logits")
        print(f"trust_remote_code without smf: {_load_without_smf(directory, tmp)}, equal logits")
        ids_ab = _load_without_smf(directory, tmp, TOKENIZER_WITHOUT_SMF)
        assert ids_ab == "[97, 98]", ids_ab
        print("tokenizer subfolder without smf: loaded, nothing on stderr (no prompt, no warning)")

        reference = load_file(OLD_NAMES / "reference.safetensors")
        old = from_pretrained(OLD_NAMES / "hf", backend="torch")
        with torch.no_grad():
            old_logits = old(reference["ids"]).logits
        # the stored reference comes from another CPU: within float32 precision (tests/test_old_projection_names.py's
        # LOGITS_ATOL, ~200 ulps of the largest logit); comparisons on this machine below stay bit for bit
        difference = (old_logits - reference["logits"]).abs().max().item()
        assert difference <= 1e-4, f"old projection names: logits differ by {difference:.3g}"
        old.save_pretrained(Path(tmp) / "resaved")
        torch.save({"ids": reference["ids"], "logits": old_logits}, Path(tmp) / "resaved" / "ref.pt")
        with safe_open(Path(tmp) / "resaved" / "model.safetensors", "pt") as handle:
            assert not [name for name in handle.keys() if "_proj." in name and ".memory." in name]
        _load_without_smf(Path(tmp) / "resaved", tmp)
        print(f"checkpoint of the old projection names: logits within {difference:.1e} of the stored reference with "
              "smf; saved again under the new names, equal logits without smf")

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
