"""--row-optimizer and --alpha-lr: the optimizer and parameter groups they make, the schedule over both groups, a
run with RowSparseSGD that resumes bit-identical, one-line refusals where the flags would be ignored, and suite
fingerprints unchanged at their defaults."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

from smf.errors import ConfigError
from smf.model.adapter import ADAPTER_WEIGHTS
from smf.suite.fingerprints import options_fingerprint
from smf.train import build_config, train
from smf.train.distributed import World
from smf.train.loop import cosine_schedule
from smf.train.recipes import ROW_OPTIMIZERS, build_setup
from smf.vocabulary import ROW_OPTIMIZERS as ROW_OPTIMIZER_NAMES
from smf_kernels.sparse import RowSparseAdamW, RowSparseSGD
from test_cli_reliability import one_line_error
from test_cli_smf import run_main
from test_train_ddp import write_adapter_and_background

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = {"preset": "tiny", "n_examples": 8, "global_batch_size": 4, "micro_batch_size": 2, "epochs": 1,
          "lr": 1e-2, "warmup_steps": 1, "save_every": 1, "protocol": "clean"}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for mode in ("additive+s", "additive"):
        write_adapter_and_background(root / mode, mode)
    return root


def sparse_config(output_dir, adapter, **options):
    options = {**COMMON, "output_dir": str(output_dir), "recipe": "sparse", "adapter": str(adapter),
               "background": str(adapter), **options}
    return build_config("train", {}, options).resolved("sparse")


def test_sgd_and_alpha_lr_make_a_row_sparse_sgd_with_alpha_in_its_own_scheduled_group(tmp_path, adapters):
    setup = build_setup(sparse_config(tmp_path, adapters / "additive+s", row_optimizer="sgd", alpha_lr=5e-4),
                        World(0, 1, torch.device("cpu")))
    optimizer = setup.optimizer
    assert type(optimizer) is RowSparseSGD
    rows_group, alpha_group = optimizer.param_groups
    names = {id(p): name for name, p in setup.model.named_parameters()}
    assert all(names[id(p)].endswith("values") for p in rows_group["params"]) and rows_group["lr"] == 1e-2
    assert len(alpha_group["params"]) == 3 and all(names[id(p)].endswith("alpha") for p in alpha_group["params"])
    assert alpha_group["lr"] == 5e-4
    schedule = cosine_schedule(optimizer, warmup_steps=2, total_steps=10)
    for _ in range(4):  # warm-up, peak, decay
        schedule.step()
        assert abs(rows_group["lr"] / alpha_group["lr"] - 20) < 1e-9  # scaled alike
    assert rows_group["lr"] < 1e-2
    default = build_setup(sparse_config(tmp_path, adapters / "additive+s"), World(0, 1, torch.device("cpu")))
    assert type(default.optimizer) is RowSparseAdamW and len(default.optimizer.param_groups) == 1
    assert tuple(ROW_OPTIMIZERS) == ROW_OPTIMIZER_NAMES  # the flag's choices (no torch in smf.vocabulary)


def test_a_row_sparse_sgd_run_moves_values_and_alpha_and_resumes_bit_identical(tmp_path, adapters):
    adapter = adapters / "additive+s"
    options = {"row_optimizer": "sgd", "alpha_lr": 3e-2, "lr": 3.0}
    train(sparse_config(tmp_path / "whole", adapter, **options))
    train(sparse_config(tmp_path / "broken", adapter, max_steps=1, **options))
    train(sparse_config(tmp_path / "broken", adapter, resume=True, **options))
    start = load_file(str(adapter / ADAPTER_WEIGHTS))
    whole, resumed = (load_file(str(tmp_path / run / "final" / ADAPTER_WEIGHTS)) for run in ("whole", "broken"))
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)
    for kind in ("values", "alpha"):
        assert any(not torch.equal(start[n], whole[n]) for n in start if n.endswith(kind)), kind
    train(sparse_config(tmp_path / "switched", adapter, max_steps=1))  # AdamW
    with pytest.raises(ConfigError, match="saved by another optimizer"):  # not a silent switch of optimizer
        train(sparse_config(tmp_path / "switched", adapter, resume=True, row_optimizer="sgd"))


@pytest.mark.parametrize("argv, message", [
    (["train", "--recipe", "lora", "--alpha-lr", "1e-3"], "--alpha-lr is not used by this run: --recipe lora trains "
                                                          "no memory"),
    (["retrofit", "--mode", "replacement", "--alpha-lr", "1e-3"], "--alpha-lr is not used by this run: --mode "
                                                                  "replacement has no alpha"),
    (["train", "--recipe", "sparse", "--alpha-lr", "1e-3", "--adapter", "{additive}", "--background", "{additive}"],
     "--alpha-lr is not used by this run: --recipe sparse in mode additive keeps alpha frozen"),
    (["train", "--recipe", "sparse", "--update", "authors", "--row-optimizer", "sgd", "--adapter", "{additive}",
      "--background", "{additive}"], "--row-optimizer is not used by this run: --update authors steps torch AdamW"),
    (["train", "--recipe", "full", "--row-optimizer", "sgd"], "--row-optimizer is not used by this run: only "
                                                              "--recipe sparse uses it"),
    (["train", "--recipe", "sparse", "--row-optimizer", "momentum", "--adapter", "{additive}", "--background",
      "{additive}"], "--row-optimizer"),
    (["train", "--recipe", "sparse", "--alpha-lr", "-1", "--adapter", "{additive}", "--background", "{additive}"],
     "--alpha-lr"),
])
def test_a_flag_the_run_would_ignore_or_cannot_take_is_one_line(tmp_path, capsys, adapters, argv, message):
    argv = [arg.replace("{additive}", str(adapters / "additive")) for arg in argv]
    code, err = run_main([*argv, "--preset", "tiny", "--output-dir", str(tmp_path / "run")], capsys)
    one_line_error(code, err, message)
    assert not (tmp_path / "run").exists()


def test_in_a_config_file_they_serve_the_runs_that_use_them(tmp_path, adapters, caplog):
    """One file for several runs (a suite's ``train:``): where alpha is frozen --alpha-lr is logged, not refused."""
    config = build_config("train", {"alpha_lr": 5e-4, "row_optimizer": "sgd"},
                          {**COMMON, "output_dir": str(tmp_path), "recipe": "sparse",
                           "adapter": str(adapters / "additive"), "background": str(adapters / "additive")})
    setup = build_setup(config.resolved("sparse"), World(0, 1, torch.device("cpu")))
    assert type(setup.optimizer) is RowSparseSGD and len(setup.optimizer.param_groups) == 1
    assert "alpha_lr 0.0005 sets nothing: this run trains no alpha" in caplog.text


def test_suite_fingerprints_do_not_change_at_the_defaults():
    old = hashlib.sha256(json.dumps({"lr": 0.1}, sort_keys=True).encode()).hexdigest()[:16]
    assert options_fingerprint({"lr": 0.1, "row_optimizer": "adamw", "alpha_lr": None}) == old
    assert options_fingerprint({"lr": 0.1, "row_optimizer": "sgd"}) != old
    assert options_fingerprint({"lr": 0.1, "alpha_lr": 5e-4}) != old
