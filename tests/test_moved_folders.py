"""Issue 57, a suite folder moved with a partly finished run inside: a memory adapter knows its base by the base's
weights wherever the base lies now (adapters written before it recorded them: the base at its place in the run folder
that moved with them), a run's recorded base and adapter are found in its moved folder, and a suite stopped after its
retrofit, then moved, resumes with the results it would have given in place."""
import json
import shutil

import pytest
import torch

from smf.errors import ConfigError
from smf.model import attach_memories, load_base, load_with_adapter, memory_blocks, save_memory_adapter
from smf.model.loading import load_run
from smf.tiny import TINY_MEMORY_KWARGS, tiny_model, tiny_tokenizer


def _base(directory, seed=0):
    """A tiny base saved in ``directory`` (weights, config, tokenizer); returns its path as a string."""
    tiny_model(seed=seed).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return str(directory)


def _retrofit(folder):
    """``folder`` with a base (``base/``) and a retrofit run on it (``retrofit/``: run_config.json recording where it
    ran, final/ its adapter of random memories); returns the ids of a batch and the adapted model's logits on it."""
    model, _ = load_base(_base(folder / "base"))
    attach_memories(model, (1, 3), "additive", **TINY_MEMORY_KWARGS)
    torch.manual_seed(57)
    with torch.no_grad():
        for block in memory_blocks(model):
            block.alpha.fill_(0.7)
            for parameter in block.memory.parameters():
                parameter.normal_()
    save_memory_adapter(model, folder / "retrofit" / "final")
    (folder / "retrofit" / "run_config.json").write_text(json.dumps({
        "recipe": "retrofit", "model": str(folder / "base"), "output_dir": str(folder / "retrofit")}))
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 13))
    with torch.no_grad():
        return ids, model(ids).logits


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_an_adapter_knows_its_base_by_its_weights_wherever_it_lies(tmp_path):
    ids, expected = _retrofit(tmp_path / "here")
    config = json.loads((tmp_path / "here" / "retrofit" / "final" / "memory_adapter.json").read_text())
    assert config["base_model"] == str(tmp_path / "here" / "base") and len(config["base_sha256"]) == 64
    shutil.copytree(tmp_path / "here" / "base", tmp_path / "copy")
    shutil.rmtree(tmp_path / "here" / "base")  # moved: the recorded path holds nothing now
    model, _ = load_with_adapter(str(tmp_path / "copy"), tmp_path / "here" / "retrofit")
    assert torch.equal(_logits(model, ids), expected)
    other = _base(tmp_path / "other", seed=1)  # another base, the adapter's sizes: refused as before
    with pytest.raises(ConfigError, match=f"trained on base model '{tmp_path / 'here' / 'base'}' but --model is "
                                          f"'{other}'; pass --model"):
        load_with_adapter(other, tmp_path / "here" / "retrofit")
    with pytest.raises(ConfigError, match="trained on base model .* but --model is 'tiny'"):
        load_with_adapter("tiny", tmp_path / "here" / "retrofit")


def test_an_adapter_written_before_the_digest_finds_its_base_where_its_folder_moved(tmp_path):
    """No ``base_sha256``: the base is accepted at its recorded place in the run folder that moved with the adapter
    (and found there without --model), not at any other place, not when the adapter's run folder stayed."""
    ids, expected = _retrofit(tmp_path / "here")
    final = tmp_path / "here" / "retrofit" / "final" / "memory_adapter.json"
    final.write_text(json.dumps({k: v for k, v in json.loads(final.read_text()).items() if k != "base_sha256"}))
    shutil.copytree(tmp_path / "here" / "base", tmp_path / "here" / "base-copy")
    with pytest.raises(ConfigError, match="but --model is"):  # in place, the same weights at another path
        load_with_adapter(str(tmp_path / "here" / "base-copy"), tmp_path / "here" / "retrofit")
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.move(tmp_path / "here", moved)
    for base in (str(moved / "base"), None):
        model, _ = load_with_adapter(base, moved / "retrofit")
        assert torch.equal(_logits(model, ids), expected)
    with pytest.raises(ConfigError, match="but --model is"):
        load_with_adapter(str(moved / "base-copy"), moved / "retrofit")


def test_a_finished_run_in_a_moved_folder_loads_its_base_there(tmp_path):
    """load_run (smf eval, the suite's evaluation) finds the base its run_config.json recorded inside the folder at
    its new place."""
    ids, expected = _retrofit(tmp_path / "here")
    shutil.move(tmp_path / "here", tmp_path / "moved")
    assert torch.equal(_logits(load_run(tmp_path / "moved" / "retrofit")[0], ids), expected)


def test_only_paths_inside_the_folder_that_moved_are_relocated(tmp_path):
    from smf.model.relocation import moved_roots, relocated
    (tmp_path / "b" / "suite" / "pretrain").mkdir(parents=True)
    roots = moved_roots(tmp_path / "a" / "suite" / "train" / "x", tmp_path / "b" / "suite" / "train" / "x")
    assert roots == (tmp_path / "a", tmp_path / "b")
    assert relocated(str(tmp_path / "a" / "suite" / "pretrain"), roots) == str(tmp_path / "b" / "suite" / "pretrain")
    for path in (str(tmp_path / "a" / "suite" / "world"),  # nothing there in the new folder: as recorded
                 str(tmp_path / "models" / "qwen"), "Qwen/Qwen2-0.5B", "tiny", None):
        assert relocated(path, roots) == path
    assert moved_roots(tmp_path / "x", tmp_path / "x") is None and moved_roots("runs/x", tmp_path / "runs" / "x") \
        is None


SUITE = {"name": "mv", "seeds": [0], "device": "cpu", "conditions": ["additive-tfidf"],
         "world": {"seed": 3, "n_old": 40, "n_new": 8, "bio_renders": 4, "heldout_people": 10, "n_retain": 40},
         "pretrain": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                      "epochs": 1},
         "train": {"global_batch_size": 8, "micro_batch_size": 8, "n_keys": 8, "rows_per_step": 4},
         "stages": {"retrofit": {"epochs": 1}, "sparse": {"epochs": 1}}, "lr_sweep": {"sparse": [1e-2]}}


def test_a_suite_stopped_after_its_retrofit_resumes_in_a_moved_folder(tmp_path, caplog):
    """A world suite stopped mid-run (its retrofit finished, the background not, the sparse stage between its last
    checkpoint and its final adapter), moved, then called with the same config on the new folder: the retrofit is
    kept, the sparse stage resumes from its checkpoint, the run's results are those of the suite that was not
    stopped, and its packed record names the base inside the folder."""
    import yaml
    from smf.cli import main
    from smf.suite.shipped import pack_suite
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(SUITE))
    whole, stopped, moved = tmp_path / "whole", tmp_path / "stopped", tmp_path / "elsewhere" / "moved"
    assert main(["--log-level", "WARNING", "suite", "--config", str(tmp_path / "suite.yaml"), "--output-dir",
                 str(whole), "--no-report"]) == 0
    shutil.copytree(whole, stopped)
    run = next((whole / "train").iterdir()).name
    for path in ("results", "eval", "background", f"train/{run}/final", f"train/{run}/suite_stage.json"):
        (shutil.rmtree if (stopped / path).is_dir() else (stopped / path).unlink)(stopped / path)
    moved.parent.mkdir()
    shutil.move(stopped, moved)
    caplog.set_level("INFO")
    assert main(["suite", "--config", str(tmp_path / "suite.yaml"), "--output-dir", str(moved), "--no-report"]) == 0
    assert "starting retrofit" not in caplog.text and f"resuming train: {moved / 'train' / run}" in caplog.text
    expected, got = (json.loads((folder / "results" / f"{run}.json").read_text()) for folder in (whole, moved))
    assert got["metrics"] == expected["metrics"] and got["config_hash"] == expected["config_hash"]
    for name in ("train/{}/final/memory_adapter.safetensors".format(run), "background/additive-seed0/"
                 "background.safetensors"):
        assert (moved / name).read_bytes() == (whole / name).read_bytes(), name
    assert pack_suite(moved)["runs"][0]["model"] == "<suite>/pretrain/final"
