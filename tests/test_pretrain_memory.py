"""Pretraining with memories attached (``pretrain.memory``, issue 48 item 4): the base is saved as a plain decoder plus
a memory adapter that load back to the network as pretrained; the fingerprint covers the memory options (and a plain
base's stays what it was); bad memory options are refused in one line; a suite on such a base runs no retrofit, and
its sparse, LoRA, full and base runs all hold the pretrained memories."""
import json
from pathlib import Path

import pytest
import torch
import yaml

from smf.data.world import WorldOptions, build_world
from smf.data.world_tokenizer import world_tokenizer
from smf.errors import ConfigError
from smf.model import memory_blocks
from smf.model.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from smf.model.loading import load_base, load_model, load_with_adapter
from smf.suite.config import load_suite_config, parse_suite_config
from smf.train import pretrain as module
from smf.train.pretrain import FINAL, PretrainOptions, old_qa_accuracy, pretrain_fingerprint, pretrain_world

WORLD = {"seed": 5, "n_old": 24, "n_new": 4, "bio_renders": 2, "heldout_people": 4, "n_retain": 24}
TINY = {"hidden_size": 16, "intermediate_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
        "epochs": 2, "lr": 1e-2, "batch_size": 16, "warmup_steps": 2}
MEMORY = {"layers": [1], "n_keys": 4, "heads": 1, "topk": 2, "key_dim": 4, "alpha_init": 0.5}


@pytest.fixture(scope="module")
def with_memories(tmp_path_factory):
    directory = tmp_path_factory.mktemp("with-memories")
    options = PretrainOptions.from_dict({**TINY, "memory": MEMORY})
    return directory, pretrain_world(WorldOptions.from_dict(WORLD), options, directory)


def test_the_base_is_a_plain_decoder_plus_an_adapter_that_loads_back_as_pretrained(with_memories):
    directory, marker = with_memories
    final = directory / FINAL
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "model.safetensors"} <= set(marker["files"])
    assert json.loads((final / ADAPTER_CONFIG).read_text())["base_model"] is None  # the folder moves (suites copy it)
    plain, tokenizer = load_base(str(final))
    assert not memory_blocks(plain) and plain.config.model_type == "qwen2"
    model, _ = load_with_adapter(str(final), final)
    (block,) = memory_blocks(model)
    assert block.layer_index == 1 and block.mode == "additive" and block.memory.num_slots == 16
    assert float(block.alpha) != MEMORY["alpha_init"]  # alpha trained with the rest
    rows = build_world(WorldOptions.from_dict(WORLD)).datasets["eval_retain"]
    assert old_qa_accuracy(model, tokenizer, rows) == marker["old_qa_accuracy"]  # the network the marker measured
    ids = torch.tensor([tokenizer("Question: who is Ada?")["input_ids"]])
    assert not torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)  # the memories matter


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


def test_every_shipped_base_is_intact_and_is_the_one_its_preset_asks_for():
    from smf.suite.config import seed_config

    tokenizer, wanted = world_tokenizer(), {}
    for preset in ("science", "science_pretrained"):
        config = load_suite_config(preset)
        for seed in range(5):
            own = seed_config(config, seed)
            world = WorldOptions.from_dict(own.world)
            texts = [row["text"] + "\n\n" for row in build_world(world).datasets["pretrain"]]
            wanted[pretrain_fingerprint(world, PretrainOptions.from_dict(own.pretrain), texts, tokenizer)] = (
                preset, seed)
    shipped = sorted(module.SHIPPED.glob("base-*"))
    assert len(shipped) >= 5
    for directory in shipped:
        marker = json.loads((directory / module.MARKER).read_text())
        assert module.file_digests(directory) == {**marker["files"], module.MARKER: module.file_digests(directory)[
            module.MARKER]}, directory.name
        preset, seed = wanted[marker["fingerprint"]]
        assert directory.name == f"base-{'memories-' if preset == 'science_pretrained' else ''}seed{seed}"
        assert marker["reached_target"] and (ADAPTER_CONFIG in marker["files"]) == (preset == "science_pretrained")
    assets = Path(module.__file__).resolve().parents[1] / "assets"
    assert sum(path.stat().st_size for path in assets.rglob("*") if path.is_file()) <= 60 * 2 ** 20
