"""Pretraining with memories attached (``pretrain.memory``, issue 48 item 4): the base is saved as a plain decoder plus
a memory adapter that load back to the network as pretrained; the fingerprint covers the memory options (and a plain
base's stays what it was); bad memory options are refused in one line; a suite on such a base runs no retrofit, and
its sparse, LoRA, full and base runs all hold the pretrained memories."""
import hashlib
import json
import logging
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from smf.data.world import WorldOptions, build_world
from smf.data.world_tokenizer import world_tokenizer
from smf.errors import ConfigError
from smf.model import memory_blocks
from smf.model.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_memory_adapter
from smf.model.hf_auto import decoder_config
from smf.model.loading import load_base, load_model, load_with_adapter
from smf.suite.config import load_suite_config, parse_suite_config
from smf.train import pretrain as module
from smf.train.pretrain import FINAL, PretrainOptions, old_qa_accuracy, pretrain_fingerprint, pretrain_world
from smf.train.shipped_layout import shipped_name

WORLD = {"seed": 5, "n_old": 24, "n_new": 4, "bio_renders": 2, "heldout_people": 4, "n_retain": 24}
TINY = {"hidden_size": 16, "intermediate_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
        "epochs": 2, "lr": 1e-2, "batch_size": 16, "warmup_steps": 2}
MEMORY = {"layers": [1], "n_keys": 4, "heads": 1, "topk": 2, "key_dim": 4, "alpha_init": 0.5}


@pytest.fixture(scope="module")
def with_memories(tmp_path_factory):
    directory = tmp_path_factory.mktemp("with-memories")
    options = PretrainOptions.from_dict({**TINY, "memory": MEMORY})
    return directory, pretrain_world(WorldOptions.from_dict(WORLD), options, directory)


def test_the_base_is_a_model_with_memories_plus_an_adapter_that_load_back_as_pretrained(with_memories):
    directory, marker = with_memories
    final = directory / FINAL
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "model.safetensors", "modeling_smf_memories.py"} <= set(marker["files"])
    assert json.loads((final / ADAPTER_CONFIG).read_text())["base_model"] is None  # the folder moves (suites copy it)
    whole, tokenizer = load_base(str(final))  # save_pretrained of the model with its memories
    assert whole.config.model_type == "qwen2_smf_memories" and len(memory_blocks(whole)) == 1
    model, _ = load_with_adapter(str(final), final)  # the adapter's memories in place of the loaded ones
    (block,) = memory_blocks(model)
    assert block.layer_index == 1 and block.mode == "additive" and block.memory.num_slots == 16
    assert float(block.alpha) != MEMORY["alpha_init"]  # alpha trained with the rest
    rows = build_world(WorldOptions.from_dict(WORLD)).datasets["eval_retain"]
    assert old_qa_accuracy(model, tokenizer, rows) == marker["old_qa_accuracy"]  # the network the marker measured
    ids = torch.tensor([tokenizer("Question: who is Ada?")["input_ids"]])
    assert torch.equal(model(input_ids=ids).logits, whole(input_ids=ids).logits)
    with torch.no_grad():
        memory_blocks(whole)[0].alpha.zero_()
    assert not torch.equal(model(input_ids=ids).logits, whole(input_ids=ids).logits)  # the memories matter


def test_the_fingerprint_covers_the_memory_options_and_keeps_plain_bases(with_memories):
    _, marker = with_memories
    world = WorldOptions.from_dict(WORLD)
    texts = [row["text"] + "\n\n" for row in build_world(world).datasets["pretrain"]]
    tokenizer = world_tokenizer()

    def fingerprint(**changes):
        return pretrain_fingerprint(world, PretrainOptions.from_dict({**TINY, **changes}), texts, tokenizer)

    assert fingerprint(memory=MEMORY) == marker["fingerprint"]
    others = {fingerprint(memory={**MEMORY, name: value}) for name, value in
              (("layers", [0]), ("n_keys", 8), ("heads", 2), ("topk", 1), ("key_dim", 8), ("alpha_init", 1.0))}
    assert len(others) == 6 and marker["fingerprint"] not in others
    plain = fingerprint()
    assert plain not in others | {marker["fingerprint"]}
    options = PretrainOptions.from_dict(TINY)  # a plain base's fingerprint is computed as before the option existed
    assert plain == module._digest({
        "world": world.to_dict(), "code": module.CODE_VERSION, "texts": module._digest(texts),
        "tokenizer": module.tokenizer_digest(tokenizer),
        "pretrain": {k: v for k, v in options.to_dict().items() if k not in ("save_every", "use_shipped", "memory")}})


@pytest.mark.parametrize("memory, message", [
    ({**MEMORY, "layers": [2]}, r"^pretrain: memory: layers \[2\] are beyond the model's 2 decoder layers"),
    ({**MEMORY, "layers": []}, r"^pretrain: option 'memory.layers'"),
    ({**MEMORY, "layers": [1, 1]}, r"^pretrain: option 'memory.layers'.*repeats"),
    ({**MEMORY, "topk": 5}, r"^pretrain: option 'memory': memory: topk \(5\) must be at most n_keys \(4\)"),
    ({**MEMORY, "key_dim": 5}, r"^pretrain: option 'memory.key_dim'"),
    ({**MEMORY, "alpha_init": 0}, r"^pretrain: option 'memory.alpha_init'"),
    ({**MEMORY, "slots": 16}, r"^pretrain: option 'memory.slots'"),
    ({"n_keys": 4}, r"^pretrain: option 'memory.layers' is required"),
    ("yes", r"^pretrain: option 'memory'"),
])
def test_bad_memory_options_are_refused_in_one_line(memory, message):
    with pytest.raises(ConfigError, match=message) as caught:
        PretrainOptions.from_dict({**TINY, "memory": memory})
    assert "\n" not in str(caught.value)


def _suite(tmp_path, **changes) -> dict:
    raw = yaml.safe_load((Path(__file__).parents[1] / "smf" / "configs" / "suite_science_pretrained.yaml").read_text())
    for key in ("variants", "schedule_sweep", "hypotheses"):  # one rate per method at the stage's epochs
        raw.pop(key, None)
    raw.update(output_dir=str(tmp_path / "suite"), seeds=[5], world={k: v for k, v in WORLD.items() if k != "seed"},
               pretrain={**TINY, "memory": MEMORY},
               lr_sweep={"sparse": [1e-2], "lora": [1e-3], "full": [1e-3]}, matched_learning=[0.5])
    raw["train"].update(layers=[1], n_keys=4, heads=1, topk=2, key_dim=4, alpha_init=MEMORY["alpha_init"],
                        rows_per_step=4, n_background=8, warmup_steps=0)
    raw["stages"] = {"sparse": {"epochs": 1}, "lora": {"epochs": 1}, "full": {"epochs": 1}}
    raw.update(changes)
    return raw


def test_a_suite_refuses_what_a_base_with_memories_cannot_run(tmp_path):
    with pytest.raises(ConfigError, match=r"^conditions \['replacement-kl'\]: a base pretrained with its memories"):
        parse_suite_config(_suite(tmp_path, conditions=["base", "replacement-kl"]), tmp_path, check_paths=False)
    raw = _suite(tmp_path)
    raw["train"]["n_keys"] = 8
    with pytest.raises(ConfigError, match=r"^train: option 'n_keys' is 8 but pretrain.memory.n_keys is 4"):
        parse_suite_config(raw, tmp_path, check_paths=False)
    assert load_suite_config("science_pretrained").pretrain["memory"]["layers"] == [1, 3]


def test_the_16384_slot_pretrained_preset_holds_the_retrofits_memories_and_schedule_equal():
    """Pretrained vs retrofitted at 16,384 slots (issue 58 item 5) compares the same memories, world, base sizes and
    paper-like SMF (T, +S, alpha's rate, the six configurations) on the same seeds; only how the memories came is
    meant to differ."""
    pretrained, retrofitted = load_suite_config("science_pretrained16k"), load_suite_config("science")
    memory = pretrained.pretrain["memory"]
    paper_like = {**retrofitted.train, **retrofitted.variants["paper-like"]}
    assert {key: paper_like[key] for key in memory if key != "layers"} == {k: v for k, v in memory.items()
                                                                           if k != "layers"}
    assert memory["layers"] == paper_like["layers"] and memory["n_keys"] ** 2 == 16384
    assert pretrained.variants["paper-like"] == {key: value for key, value in retrofitted.variants["paper-like"].items()
                                                 if key != "n_keys"}
    assert pretrained.seeds == retrofitted.seeds and pretrained.world == retrofitted.world
    assert {k: v for k, v in pretrained.pretrain.items() if k != "memory"} == retrofitted.pretrain
    assert pretrained.schedule_sweep["full"] == retrofitted.schedule_sweep["full"]
    grid = {"paper-like": pretrained.configurations(None, "paper-like"),
            "placed": pretrained.configurations(None, "placed")}  # the second registration: only its grid differs
    assert pretrained.variant_options("placed") == pretrained.variant_options("paper-like")
    assert len(grid["placed"]) == len(grid["paper-like"]) == 6 and not set(grid["placed"]) & set(grid["paper-like"])


def test_a_suite_on_a_base_with_memories_runs_no_retrofit(tmp_path, monkeypatch):
    from smf.suite import runner

    loaded = []  # what each evaluation loads: the base condition too evaluates the network with its memories
    monkeypatch.setattr(runner, "load_model", lambda *args: loaded.append(args[1]) or load_model(*args))
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(_suite(tmp_path, conditions=["base", "additive-kl", "additive+s-tfidf", "lora",
                                                                 "full"])))
    config = load_suite_config(str(path))
    results = {r["condition"]: r for r in runner.run_suite(config)}
    root = config.output_dir
    final = root / "bases" / "seed5" / "pretrain" / FINAL
    assert set(results) == set(config.conditions) and not (root / "retrofit").exists()
    assert final in loaded
    assert (root / "background" / "additive-seed5").is_dir()
    assert all("retrofit_s" not in r["timing"] for r in results.values())
    pretrained = {name: tensor.clone() for name, tensor in load_with_adapter(str(final), final)[0].state_dict().items()
                  if ".memory." in name or name.endswith(".alpha")}
    for run in ("base-seed5", "additive-kl-lr0.01-seed5", "lora-lr0.001-seed5", "full-lr0.001-seed5"):
        model, _ = load_model(str(final), final if run.startswith("base") else root / "train" / run)
        state = {name.replace("base_model.model.", "").replace(".base_layer", ""): tensor
                 for name, tensor in model.state_dict().items() if ".memory." in name or name.endswith(".alpha")}
        assert set(state) == set(pretrained), run  # every run holds the pretrained memories
        changed = any(not torch.equal(state[name], pretrained[name]) for name in pretrained)
        assert changed == (run.startswith(("additive", "full"))), run  # LoRA leaves them frozen
    run_config = json.loads((root / "train" / "lora-lr0.001-seed5" / "run_config.json").read_text())
    assert run_config["adapter"] == str(final)
    from smf.suite.report import write_suite_report

    assert "report.md" in {p.name for p in write_suite_report(root)}
    diagnostics = json.loads((root / "science_diagnostics.json").read_text())
    assert set(diagnostics["retrofit"]) == {"pretrained-seed5"}  # the pretrained memories, named apart per seed


def test_a_stream_on_a_base_with_memories_starts_every_method_from_them(tmp_path):
    from smf.suite import runner
    from smf.suite.plan import Run
    from smf.suite.stream import StreamLayout

    raw = _suite(tmp_path, conditions=["base", "additive-kl", "lora", "full"], stream={"tasks": 2})
    raw["train"].update(global_batch_size=4, micro_batch_size=4)
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_suite_config(str(path))
    results = {r["condition"]: r for r in runner.run_suite(config)}
    root, streams = config.output_dir, StreamLayout(config.output_dir, 2)
    final = root / "bases" / "seed5" / "pretrain" / FINAL
    assert not (root / "retrofit").exists() and all(len(r["stream"]["stages"]) == (1 if c == "base" else 2)
                                                     for c, r in results.items())
    pretrained = {name: tensor.clone() for name, tensor in load_with_adapter(str(final), final)[0].state_dict().items()
                  if ".memory." in name or name.endswith(".alpha")}
    runs = {"additive-kl": "additive-kl-lr0.01-seed5", "lora": "lora-lr0.001-seed5", "full": "full-lr0.001-seed5"}
    for condition, run in runs.items():
        stage_one = json.loads((streams.stage_dir(Run(condition, 5, lr=results[condition]["lr"]), 1)
                                / "run_config.json").read_text())
        assert stage_one["adapter"] == str(final), condition  # stage 1 starts from the pretrained memories
        model, _ = load_model(str(final), root / "train" / run)  # after both stages
        state = {name.replace("base_model.model.", "").replace(".base_layer", ""): tensor
                 for name, tensor in model.state_dict().items() if ".memory." in name or name.endswith(".alpha")}
        assert set(state) == set(pretrained), run  # the memories are still there after the stream
        changed = any(not torch.equal(state[name], pretrained[name]) for name in pretrained)
        assert changed == (condition != "lora"), run  # LoRA leaves them frozen, stage after stage


SHIPPED_PREFIX = {"science": "base-seed", "science_pretrained": "base-memories-seed",
                  "science_pretrained16k": "base-memories16k-seed"}


def test_every_shipped_base_is_intact_and_is_the_one_its_preset_asks_for():
    """Each shipped base holds what its layout ships (smf.train.shipped_layout: with memories, the model's weights
    once, xz-compressed) with the digests its pretraining recorded, is the base of the preset and seed its name says,
    and all the assets fit in 60 MiB."""
    from smf.suite.config import seed_config

    tokenizer, wanted = world_tokenizer(), {}
    for preset in SHIPPED_PREFIX:
        config = load_suite_config(preset)
        for seed in range(5):
            own = seed_config(config, seed)
            world = WorldOptions.from_dict(own.world)
            texts = [row["text"] + "\n\n" for row in build_world(world).datasets["pretrain"]]
            wanted[pretrain_fingerprint(world, PretrainOptions.from_dict(own.pretrain), texts, tokenizer)] = (
                preset, seed)
    shipped = sorted(module.SHIPPED.glob("base-*"))
    assert len(shipped) == 15
    for directory in shipped:
        marker = json.loads((directory / module.MARKER).read_text())
        names = {name: shipped_name(name, marker["files"]) for name in marker["files"]}
        assert {path.name for path in directory.iterdir()} == {*names.values(), module.MARKER} - {None}
        for name, held in names.items():
            if held is not None:
                data = (directory / held).read_bytes()
                data = lzma.decompress(data, format=lzma.FORMAT_XZ) if held.endswith(".xz") else data
                assert hashlib.sha256(data).hexdigest() == marker["files"][name], (directory.name, name)
        preset, seed = wanted[marker["fingerprint"]]
        assert directory.name == f"{SHIPPED_PREFIX[preset]}{seed}"
        assert marker["reached_target"] and (ADAPTER_CONFIG in marker["files"]) == (preset != "science")
        assert (names[ADAPTER_WEIGHTS] is None and names["model.safetensors"].endswith(".xz")
                if preset != "science" else names["model.safetensors"] == "model.safetensors")
    assets = Path(module.__file__).resolve().parents[1] / "assets"
    assert sum(path.stat().st_size for path in assets.rglob("*") if path.is_file()) <= 60 * 2 ** 20


def test_the_copy_of_a_shipped_16384_slot_base_is_the_pretrained_base_to_the_bit(tmp_path):
    """What the suite copies for science_pretrained16k (its adapter's weights written again from the model, the
    model's decompressed) has every digest its pretraining recorded, so the runs' hashes and results stand."""
    source = module.SHIPPED / "base-memories16k-seed0"
    copied = module._copy_shipped(source, tmp_path / "run")
    assert copied["source"] == "shipped (base-memories16k-seed0)"
    assert module.file_digests(tmp_path / "run" / FINAL) == json.loads((source / module.MARKER).read_text())["files"]
    assert ADAPTER_WEIGHTS in copied["files"] and not (source / ADAPTER_WEIGHTS).exists()


def test_a_base_shipped_and_copied_back_is_bit_identical_and_a_damaged_xz_is_named(with_memories, tmp_path):
    directory, marker = with_memories
    shipped = tmp_path / "base-test"
    module.ship_base(directory, shipped)
    assert [path.name for path in tmp_path.iterdir()] == ["base-test"]  # no staging folder left
    assert {path.name for path in shipped.iterdir()} == (set(marker["files"]) - {ADAPTER_WEIGHTS, "model.safetensors"}
                                                         | {"model.safetensors.xz", module.MARKER})
    packed = shipped / "model.safetensors.xz"
    assert lzma.decompress(packed.read_bytes()) == (directory / FINAL / "model.safetensors").read_bytes()
    module._copy_shipped(shipped, tmp_path / "copy")
    assert module.file_digests(tmp_path / "copy" / FINAL) == marker["files"]
    with pytest.raises(ConfigError, match="it exists"):
        module.ship_base(directory, shipped)
    whole = packed.read_bytes()
    unreadable = "model.safetensors.xz cannot be decompressed"
    for damaged, cause in ((whole[:len(whole) // 2], unreadable),  # truncated
                           (whole[:200] + bytes([whole[200] ^ 1]) + whole[201:], unreadable),  # one bit flipped
                           (lzma.compress(b"another file"), "model.safetensors differs from its record")):
        packed.write_bytes(damaged)
        with pytest.raises(ConfigError, match=r"a damaged install\?\)") as refused:
            module._copy_shipped(shipped, tmp_path / "again")
        assert f"the shipped base {shipped}: {cause}" in str(refused.value)
        assert not (tmp_path / "again" / module.MARKER).exists()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_plain_from_pretrained_of_the_base_loads_its_memories_or_asks_for_trust_remote_code(with_memories):
    """Issue 57 item 5: a plain AutoModelForCausalLM load of the base gave the decoder without its memories, silently.
    Now: with smf imported, the network as pretrained; without smf, transformers asks for trust_remote_code, and
    with it the saved code's plain memories give the same logits."""
    directory, _ = with_memories
    final = directory / FINAL
    model, _ = load_with_adapter(str(final), final)
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7]])
    loaded = AutoModelForCausalLM.from_pretrained(final)
    assert [block.layer_index for block in memory_blocks(loaded)] == [1]
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    script = ("import json, sys, torch\nfrom transformers import AutoModelForCausalLM\n"
              "try:\n    AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
              "except ValueError as err:\n    print('ERROR', str(err).replace(chr(10), ' '))\n"
              "assert not any(name.split('.')[0] == 'smf' for name in sys.modules)\n"
              "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
              "print(json.dumps(model(input_ids=torch.tensor([[5, 17, 99, 3, 250, 41, 7]])).logits.tolist()))\n")
    result = subprocess.run([sys.executable, "-c", script, str(final)], capture_output=True, text=True, timeout=300,
                            stdin=subprocess.DEVNULL, env={**os.environ, "SMF_SAVED_CODE_PLAIN": "1"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()  # transformers' refused prompt (stdin closed), its error, the logits
    error, logits = next(line for line in lines if "ERROR" in line), lines[-1]
    assert "trust_remote_code=True" in error.partition("ERROR")[2], error
    reference = _logits(model, ids)
    assert float((torch.tensor(json.loads(logits)) - reference).norm() / reference.norm()) < 1e-5


def _former_layout(final: Path, old: Path) -> None:
    """Write into ``old`` the base of ``final`` as smf.train.pretrain saved it until 2026-11-29 (a plain decoder:
    the base config and every tensor but the memories', beside the memory adapter), its record one folder up."""
    model, _ = load_base(str(final))
    shutil.copytree(final, old)
    for name in ("model.safetensors", "config.json", "modeling_smf_memories.py"):
        (old / name).unlink()
    memories = tuple(f"{name}.{part}" for name, module in model.named_modules() if hasattr(module, "memory")
                     for part in ("memory.", "alpha"))
    model.config = decoder_config(model.config)
    model.save_pretrained(old, state_dict={k: v for k, v in model.state_dict().items() if not k.startswith(memories)})
    marker = json.loads((final.parent / module.MARKER).read_text())
    (old.parent / module.MARKER).write_text(json.dumps({**marker, "files": module.file_digests(old)}))


def test_a_base_in_the_former_layout_loads_with_a_warning_and_upgrades_bit_for_bit(with_memories, tmp_path, caplog,
                                                                                   capsys):
    directory, marker = with_memories
    old = tmp_path / "pretrain" / FINAL
    _former_layout(directory / FINAL, old)
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7]])
    assert not memory_blocks(AutoModelForCausalLM.from_pretrained(old))  # what transformers made of it: no memories
    reference = _logits(load_with_adapter(str(directory / FINAL), directory / FINAL)[0], ids)
    with caplog.at_level(logging.WARNING, logger="smf.model.loading"):
        first, _ = load_with_adapter(str(old), old)
        load_model(str(old), old)  # warned once a process
    warned = [r.getMessage() for r in caplog.records if "--upgrade" in r.getMessage()]
    assert len(warned) == 1 and f"python -m smf.train.pretrain --upgrade {old}" in warned[0], warned
    assert torch.equal(_logits(first, ids), reference)
    assert module.main(["--upgrade", str(old)]) == 0
    assert json.loads((old / "config.json").read_text())["model_type"] == "qwen2_smf_memories"
    assert module._finished(old.parent, marker["fingerprint"])["files"] == module.file_digests(old)
    assert not list(old.parent.glob(f"{FINAL}.*"))  # no staging or retired folder left
    for model in (AutoModelForCausalLM.from_pretrained(old), load_with_adapter(str(old), old)[0]):
        assert torch.equal(_logits(model, ids), reference)
    assert module.main(["--upgrade", str(old)]) == 0  # already re-laid: nothing changes
    assert capsys.readouterr().out.splitlines()[-1] == f"{old}: already a model with memories"
    with pytest.raises(SystemExit) as caught:
        module.main(["--upgrade", str(tmp_path)])
    assert caught.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: --upgrade {tmp_path}: not a base pretrained with memories")
    (old / "tokenizer.json").write_text("{}")
    with pytest.raises(SystemExit):
        module.main(["--upgrade", str(old)])
    assert "its files differ from those" in capsys.readouterr().err


def test_an_adapter_replaces_held_memories_only_where_they_are_and_of_their_sizes(with_memories, tmp_path):
    directory, _ = with_memories
    final = directory / FINAL
    other = tmp_path / "adapter"
    shutil.copytree(final, other)
    config = json.loads((other / ADAPTER_CONFIG).read_text())
    tensors = load_file(str(other / ADAPTER_WEIGHTS))
    (other / ADAPTER_CONFIG).write_text(json.dumps({**config, "mode": "additive+s"}))
    model, _ = load_base(str(final))
    load_memory_adapter(model, other)  # the held additive memories switch to the adapter's mode
    assert memory_blocks(model)[0].mode == "additive+s" and model.config.smf_memories["mode"] == "additive+s"
    save_file({name.replace("layers.1.", "layers.0."): tensor for name, tensor in tensors.items()},
              str(other / ADAPTER_WEIGHTS))
    (other / ADAPTER_CONFIG).write_text(json.dumps({**config, "layers": [0]}))
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"the model already holds memories \(additive\+s at layers \[1\]"):
        load_memory_adapter(model, other)
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())  # unchanged


def test_the_shipped_bases_with_memories_load_whole_as_pretrained(tmp_path):
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7]])
    shipped = sorted(module.SHIPPED.glob("base-memories-seed*"))
    assert len(shipped) == 5
    for source in shipped:
        module._copy_shipped(source, tmp_path / source.name)  # as the suite copies it
        directory = tmp_path / source.name / FINAL
        assert json.loads((directory / "config.json").read_text())["model_type"] == "qwen2_smf_memories"
        whole = AutoModelForCausalLM.from_pretrained(directory)
        assert [block.layer_index for block in memory_blocks(whole)] == [1, 3]
        assert torch.equal(_logits(whole, ids), _logits(load_with_adapter(str(directory), directory)[0], ids))


def test_a_retrofit_on_a_base_that_holds_memories_is_refused_in_one_line(with_memories, tmp_path, capsys):
    """smf retrofit adds fresh memories to a plain base; on a base pretrained with memories it says so in one line
    (exit 2) and writes nothing, instead of the attach's ValueError traceback."""
    from smf import cli
    directory, _ = with_memories
    out = tmp_path / "retrofit"
    code = cli.main(["retrofit", "--preset", "tiny", "--model", str(directory / FINAL), "--output-dir", str(out)])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not the loading bars
    assert code == 2 and len(errors) == 1 and not out.exists()
    assert errors[0].startswith("smf retrofit: error: --model: ") and "holds memories at layers [1]" in errors[0]
