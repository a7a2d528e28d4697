"""Issue 50, the six classes: a refused finishing step moves nothing and stays finishable; suite directory names
that cannot collide (and the old ones kept) and a key given twice in a config file refused; one line for a bad
``threads`` and a damaged shipped record; messages naming the real cause; ``smf suite --dry-run`` over pretrained
bases; the protocol's edges (an unapplied step, a rows-first step of several micro-batches without a counting
forward). Each test failed on the code before this round (211a22b)."""
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

import smf.suite.plan as plan
import smf.train.pretrain as pretrain
from smf.errors import ConfigError
from smf.suite.config import load_suite_config, parse_suite_config, seed_config
from smf.suite.dry_run import dry_run_lines
from smf.suite.plan import SuiteLayout, plan_runs, sparse_stage_dirs
from smf_kernels.sparse import (FillPlan, RowSparseAdamW, RowSparseSGD, SparseMemoryController, StepMisuseError)
from helpers import MemoryLM, random_background
from test_cli_smf import run_main
from test_science import SMALL_PRETRAIN, SMALL_WORLD

VOCAB, WIDTH, SEQ = 40, 16, 5
CONFIGS = Path(pretrain.__file__).resolve().parents[1] / "configs"


# ----------------------------------------------------------------------------- the step (classes 1, 4, 6)
def setup(seed=0):
    torch.manual_seed(seed)
    model = MemoryLM(VOCAB, WIDTH, n_keys=6, heads=2, topk=3, key_dim=8)
    controller = SparseMemoryController(model, rows_per_step=5, background=random_background(model, 4, 1))
    return model, controller


def loss_of(model, seed):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    logits = model(tokens, torch.ones(2, SEQ, dtype=torch.bool))
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def ended_step(model, controller, seed=1):
    """begin, one micro-batch's forward and backward, end: the step's RowGradients."""
    controller.begin_step()
    loss_of(model, seed).backward()
    return controller.end_step()


def state_of(model, optimizer):
    return (model.memory.values.detach().clone(), model.alpha.detach().clone(),
            {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for p, s in optimizer.state.items()})


def assert_same(before, after):
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert before[2].keys() == after[2].keys()
    for key, entries in before[2].items():
        for name, value in entries.items():
            assert torch.equal(torch.as_tensor(after[2][key][name]), torch.as_tensor(value))


def finished_twin(seed=0, step_seed=1):
    """Values and alpha after the same step finished straight away (what a refused-then-finished step must give)."""
    model, controller = setup(seed)
    optimizer = RowSparseAdamW([model.memory.values, model.alpha], lr=1e-2)
    ended_step(model, controller, step_seed).apply(optimizer, max_grad_norm=1.0)
    return model.memory.values.detach().clone(), model.alpha.detach().clone()


def test_torch_adamw_is_refused_in_one_line_and_the_step_stays_finishable():
    model, controller = setup()
    gradients = ended_step(model, controller)
    alpha_grad = model.alpha.grad.clone()
    wrong = torch.optim.AdamW([model.memory.values, model.alpha], lr=1e-2)
    before = state_of(model, wrong)
    with pytest.raises(TypeError, match=r"^the sparse update needs an optimizer with step_rows \(RowSparseAdamW or "
                                        r"RowSparseSGD\), got AdamW; nothing was changed") as refused:
        gradients.apply(wrong, max_grad_norm=1.0)
    assert "\n" not in str(refused.value)
    assert_same(before, state_of(model, wrong))
    assert torch.equal(model.alpha.grad, alpha_grad) and not gradients.applied
    right = RowSparseAdamW([model.memory.values, model.alpha], lr=1e-2)
    gradients.apply(right, max_grad_norm=1.0)
    values, alpha = finished_twin()
    assert torch.equal(model.memory.values.detach(), values) and torch.equal(model.alpha.detach(), alpha)


def test_an_optimizer_without_the_value_table_is_refused_before_alpha_moves():
    model, controller = setup()
    gradients = ended_step(model, controller)
    partial = RowSparseAdamW([model.alpha], lr=1e-2)
    before = state_of(model, partial)
    with pytest.raises(ValueError, match=r"^the optimizer does not hold memory\.values; nothing was changed"):
        gradients.apply(partial)
    assert_same(before, state_of(model, partial))
    gradients.apply(RowSparseAdamW([model.memory.values, model.alpha], lr=1e-2), max_grad_norm=1.0)
    assert torch.equal(model.memory.values.detach(), finished_twin()[0])


BAD_GROUPS = [({"lr": math.nan}, "lr must be a finite number >= 0"), ({"lr": -1e-3}, "lr must be a finite number"),
              ({"lr": "fast"}, "lr must be a real number"), ({"betas": (1.0, 0.999)}, "betas must lie in"),
              ({"betas": (0.9,)}, "betas must be two numbers"), ({"eps": -1.0}, "eps must be a finite number"),
              ({"weight_decay": math.inf}, "weight_decay must be a finite number")]


@pytest.mark.parametrize("bad, message", BAD_GROUPS)
@pytest.mark.parametrize("how", ["apply", "finish_step"])
def test_a_values_group_out_of_range_is_refused_before_anything_moves(bad, message, how):
    """alpha in group 0 (fine), the values in group 1 (changed, as a scheduler could): nothing moves, the step
    is finished afterwards by the same optimizer once the group is right, as if nothing had happened."""
    model, controller = setup()
    optimizer = RowSparseAdamW([{"params": [model.alpha]}, {"params": [model.memory.values]}], lr=1e-2)
    right = dict(optimizer.param_groups[1])
    optimizer.param_groups[1].update(bad)
    before = state_of(model, optimizer)
    if how == "apply":
        gradients = ended_step(model, controller)
        with pytest.raises((TypeError, ValueError), match=rf"^RowSparseAdamW param group 1: {message}"):
            gradients.apply(optimizer, max_grad_norm=1.0)
    else:
        controller.begin_step()
        loss_of(model, 1).backward()
        with pytest.raises((TypeError, ValueError), match=rf"^RowSparseAdamW param group 1: {message}"):
            controller.finish_step(optimizer, max_grad_norm=1.0)
        assert controller.in_step  # the step goes on: nothing was ended
    assert_same(before, state_of(model, optimizer))
    optimizer.param_groups[1].update(right)
    if how == "apply":
        gradients.apply(optimizer, max_grad_norm=1.0)
    else:
        controller.finish_step(optimizer, max_grad_norm=1.0)
    values, alpha = finished_twin()
    assert torch.equal(model.memory.values.detach(), values) and torch.equal(model.alpha.detach(), alpha)


@pytest.mark.parametrize("kind", [RowSparseAdamW, RowSparseSGD])
def test_each_row_optimizers_own_step_checks_every_group_before_moving_any(kind):
    first, second = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    optimizer = kind([{"params": [first]}, {"params": [second]}], lr=1e-2)
    optimizer.param_groups[1]["lr"] = math.nan
    first.grad, second.grad = torch.randn(3), torch.randn(3)
    kept = first.detach().clone()
    with pytest.raises(ValueError, match=rf"^{kind.__name__} param group 1: lr must be a finite number >= 0"):
        optimizer.step()
    assert torch.equal(first.detach(), kept) and not optimizer.state.get(first)


def test_an_unknown_fill_plan_is_named_with_the_known_ones():
    model, controller = setup()
    with pytest.raises(ValueError, match=r"^fill must be one of \('rows_first', 'reads_kept'\), got 'bogus'$"):
        controller.begin_step(FillPlan("bogus"))
    assert not controller.in_step


def test_a_step_begun_before_the_last_ones_gradients_were_applied_is_refused():
    """Decided (docs/method.md): refused, nothing changed; apply() then finishes the first step as if in order,
    or abort_step() drops its gradients (alpha's .grad is the caller's to zero) and a later apply() is refused."""
    model, controller = setup()
    optimizer = RowSparseAdamW([model.memory.values, model.alpha], lr=1e-2)
    gradients = ended_step(model, controller)
    alpha_grad = model.alpha.grad.clone()
    with pytest.raises(StepMisuseError, match=r"^begin_step\(\) before the last step's gradients were applied"):
        controller.begin_step()
    assert not controller.in_step and torch.equal(model.alpha.grad, alpha_grad)
    gradients.apply(optimizer, max_grad_norm=1.0)
    assert torch.equal(model.memory.values.detach(), finished_twin()[0])
    second = ended_step(model, controller, seed=2)  # the next step begins now
    controller.abort_step()
    optimizer.zero_grad(set_to_none=True)
    with pytest.raises(StepMisuseError, match=r"^these RowGradients were discarded by abort_step\(\)"):
        second.apply(optimizer)
    controller.begin_step()  # and the one after
    controller.abort_step()


def two_micro_batches_rows_first(model, controller, how):
    """A rows-first step of two micro-batches without a counting forward: the second forward is refused."""
    if how == "after_forward":
        controller.begin_step(FillPlan("rows_first", select_after_forward=True))
    else:
        controller.begin_step("rows_first")
    loss = loss_of(model, 1)
    if how == "after_forward":
        controller.after_forward()
    elif how == "select_rows":
        controller.select_rows()
    loss.backward()  # "chooser": this backward chooses the rows from the first micro-batch's counts
    with pytest.raises(StepMisuseError, match=r"^a forward after this rows_first step's rows were chosen from its "
                                              r"first 1 micro-batch\(es\)"):
        loss_of(model, 2)


@pytest.mark.parametrize("how", ["chooser", "select_rows", "after_forward"])
def test_a_rows_first_step_refuses_a_micro_batch_its_rows_were_not_chosen_from(how):
    model, controller = setup()
    optimizer = RowSparseAdamW([model.memory.values, model.alpha], lr=1e-2)
    before = state_of(model, optimizer)
    two_micro_batches_rows_first(model, controller, how)
    assert_same(before, state_of(model, optimizer))
    controller.abort_step()
    optimizer.zero_grad(set_to_none=True)
    controller.begin_step()  # the step done right (reads kept) runs
    loss_of(model, 1).backward()
    loss_of(model, 2).backward()
    controller.finish_step(optimizer, max_grad_norm=1.0)
    assert not torch.equal(model.memory.values.detach(), before[0])


def test_a_planned_rows_first_step_of_several_micro_batches_still_runs():
    model, controller = setup()
    optimizer = RowSparseAdamW([model.memory.values, model.alpha], lr=1e-2)
    plan = controller.plan(2, compiled=True, world=1)
    assert plan.counting_forward
    controller.begin_step(plan)
    with torch.no_grad():
        loss_of(model, 1), loss_of(model, 2)
    controller.select_rows()
    loss_of(model, 1).backward()
    loss_of(model, 2).backward()
    assert all(rows.numel() for rows in controller.finish_step(optimizer, max_grad_norm=1.0).values())


# --------------------------------------------------------------------------------- suite names (class 2)
def _parse(tmp_path, **overrides):
    raw = {"name": "v", "output_dir": str(tmp_path / "suite"), "seeds": [0], "device": "cpu",
           "conditions": ["base", "additive-tfidf", "lora"], "world": SMALL_WORLD, "pretrain": SMALL_PRETRAIN,
           "train": {"n_keys": 8, "rows_per_step": 4}, "lr_sweep": {"sparse": [1e-2, 1e-1], "lora": [1e-3, 1e-2]},
           **overrides}
    return parse_suite_config(raw, tmp_path, check_paths=False)


def test_rates_that_print_alike_get_runs_of_their_own(tmp_path):
    config = _parse(tmp_path, lr_sweep={"sparse": [0.1, 0.1000001], "lora": [2e-4, 2.0000001e-4]})
    names = [run.name for run in plan_runs(config)]
    assert len(set(names)) == len(names)
    assert {"additive-tfidf-lr0.1-seed0", "additive-tfidf-lr0.1000001-seed0", "lora-lr0.0002-seed0",
            "lora-lr0.00020000001-seed0"} <= set(names)


def test_variants_whose_retrofits_differ_slightly_get_retrofits_of_their_own(tmp_path):
    config = _parse(tmp_path, variants={"a": {"alpha_init": 0.5, "lr_sweep": [1e-2, 1e-1]},
                                        "b": {"alpha_init": 0.5000001, "lr_sweep": [1e-2, 1e-1]}},
                     lr_sweep={"lora": [1e-3, 1e-2]})
    layout = SuiteLayout(config.output_dir)
    dirs = {run.variant: tuple(p.name for p in sparse_stage_dirs(layout, run, config))
            for run in plan_runs(config) if run.recipe == "sparse"}
    assert dirs == {"a": ("additive-alphainit0.5-seed0", "additive-alphainit0.5-seed0"),
                    "b": ("additive-alphainit0.5000001-seed0", "additive-alphainit0.5000001-seed0")}


def _names_and_dirs(config) -> list[tuple[str, ...]]:
    layout = SuiteLayout(config.output_dir)
    return [(run.name, *(p.name for p in (sparse_stage_dirs(layout, run, config) if run.recipe == "sparse" else ())))
            for run in plan_runs(config)]


@pytest.mark.parametrize("name", ["science", "locality", "paper", "tiny"])
def test_the_shipped_suites_keep_every_directory_name(name, tmp_path, monkeypatch):
    """Suite directories written before this round are still found: every run and stage directory is named as
    when names printed every float with ``:g``."""
    monkeypatch.chdir(tmp_path)
    config = load_suite_config(name)
    names = _names_and_dirs(config)
    monkeypatch.setattr(plan, "number_label", lambda value: f"{value:g}")
    assert names == _names_and_dirs(config)
    if name == "science":  # the rates of its sweep, each printed as it was (epochs other than the stage's: -epE)
        configured = config.stages["full"]["epochs"]
        assert {run.name for run in plan_runs(config) if run.condition == "full" and run.seed == 0} == {
            f"full{'' if epochs in (None, configured) else f'-ep{epochs}'}-lr{rate:g}-seed0"
            for epochs, rate in config.configurations("full")}


DUPLICATED = """name: t
variants:
  a: {rows_per_step: 2, lr_sweep: [0.01]}
  a: {rows_per_step: 4, lr_sweep: [0.01]}
"""


def test_a_suite_with_a_variant_named_twice_is_refused_by_name_and_line(tmp_path, capsys):
    path = tmp_path / "suite.yaml"
    path.write_text(DUPLICATED)
    code, err = run_main(["suite", "--config", str(path), "--dry-run"], capsys)
    err = err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "duplicate key 'a' at line 4 (first at line 3)" in err and err.startswith("smf suite: error:")


@pytest.mark.parametrize("suffix, text, message", [
    (".yaml", "recipe: lora\nlr: 0.1\nlr: 0.2\n", "duplicate key 'lr' at line 3 (first at line 2)"),
    (".json", '{"recipe": "lora", "lr": 0.1, "lr": 0.2}', "duplicate key 'lr'")])
def test_a_training_config_with_a_key_twice_is_refused(tmp_path, capsys, suffix, text, message):
    path = tmp_path / f"config{suffix}"
    path.write_text(text)
    code, err = run_main(["train", "--config", str(path), "--output-dir", str(tmp_path / "out")], capsys)
    err = err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err and err.startswith("smf train: error:")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------- threads, shipped records (classes 3, 4)
@pytest.mark.parametrize("threads, message", [(-1, "greater than 0, got -1"), ("two", "valid integer"),
                                              (1.5, "fractional part"), (0, "greater than 0, got 0")])
def test_pretrains_threads_is_checked_as_the_suites(tmp_path, capsys, threads, message):
    raw = yaml.safe_load((CONFIGS / "suite_science.yaml").read_text())
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({**raw, "threads": threads}))
    with pytest.raises(SystemExit) as exited:
        pretrain.main(["--config", str(path), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and err.startswith("error: threads: ") and message in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match=rf"^threads: .*{message}"):
        load_suite_config(str(path))  # the suite says the same


@pytest.fixture
def shipped_copy(tmp_path, monkeypatch):
    """The shipped bases, copied where a test may damage them."""
    copy = tmp_path / "science"
    shutil.copytree(pretrain.SHIPPED, copy)
    monkeypatch.setattr(pretrain, "SHIPPED", copy)
    return copy


@pytest.mark.parametrize("damage", ["truncated", "missing", "not an object"])
def test_one_damaged_shipped_record_is_named_by_every_lookup(shipped_copy, damage):
    record = shipped_copy / "base-seed1" / pretrain.MARKER
    if damage == "truncated":
        record.write_text(record.read_text()[:40])
    elif damage == "missing":
        record.unlink()
    else:
        record.write_text("[1, 2]")
    seed0 = json.loads((shipped_copy / "base-seed0" / pretrain.MARKER).read_text())["fingerprint"]
    for lookup in (lambda: pretrain._shipped(seed0), lambda: pretrain._shipped("0" * 16),
                   lambda: pretrain._copy_shipped(shipped_copy / "base-seed1", shipped_copy.parent / "out")):
        with pytest.raises(ConfigError, match=r"a damaged install\?\); reinstall") as refused:
            lookup()
        assert str(record) in str(refused.value) and "\n" not in str(refused.value)


def test_a_shipped_file_missing_is_named_as_a_damaged_install(shipped_copy, tmp_path):
    (shipped_copy / "base-seed0" / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"base-seed0: config\.json missing \(a damaged install\?\)"):
        pretrain._copy_shipped(shipped_copy / "base-seed0", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_stray_file_in_the_output_folder_is_named_not_the_install(tmp_path):
    output = tmp_path / "out"
    (output / pretrain.FINAL).mkdir(parents=True)
    (output / pretrain.FINAL / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError) as refused:
        pretrain._copy_shipped(pretrain.SHIPPED / "base-seed0", output)
    message = str(refused.value)
    assert "notes.txt" in message and str(output) in message and "damaged" not in message
    assert not (output / pretrain.MARKER).exists() and (output / pretrain.FINAL / "notes.txt").read_text() == "mine"


# -------------------------------------------------------------------------------- dry run (class 5)
def test_the_dry_run_of_a_suite_with_its_shared_base_pretrained(tmp_path):
    config = _parse(tmp_path)
    marker = config.output_dir / "pretrain" / pretrain.MARKER
    marker.parent.mkdir(parents=True)
    marker.write_text(json.dumps({"fingerprint": "0" * 16, "seconds": 3}))
    assert "pretrain/): refused: it holds a model pretrained with other world or pretrain options" in \
        dry_run_lines(config)[1]
    fingerprint = pretrain.base_fingerprint(pretrain.WorldOptions.from_dict(config.world),
                                            pretrain.PretrainOptions.from_dict(config.pretrain))
    marker.write_text(json.dumps({"fingerprint": fingerprint, "seconds": 3}))
    assert dry_run_lines(config)[1].endswith("pretrain/): done (3 s)")


def test_the_dry_run_lists_each_seeds_base(tmp_path, monkeypatch):
    """The science suite's base of seed 0 in place (its shipped record: the fingerprint pretraining wrote), seed 1's
    not: one line each."""
    monkeypatch.chdir(tmp_path)
    config = load_suite_config("science", {"seeds": [0, 1]})
    own = seed_config(config, 0)
    assert own.model.endswith("bases/seed0/pretrain/final")
    directory = config.output_dir / "bases" / "seed0" / "pretrain"
    directory.mkdir(parents=True)
    shutil.copyfile(pretrain.SHIPPED / "base-seed0" / pretrain.MARKER, directory / pretrain.MARKER)
    lines = dry_run_lines(config)
    assert lines[1].startswith("before the runs of seed 0: ") and lines[1].endswith(")") and ": done (" in lines[1]
    assert lines[2] == "before the runs of seed 1: its world and the model pretrained on it (bases/seed1/): to do"


def test_a_trainer_step_refused_at_its_finish_moves_nothing_and_training_starts_again(tmp_path):
    """A scheduler (here a callback) leaving a NaN rate: the Trainer's finish is refused naming the group, no
    parameter moved, the step dropped; once the rate is right, train() runs again."""
    from transformers import TrainerCallback

    from test_hf_trainer import _model_and_controller, _state, _trainer

    class NaNRate(TrainerCallback):
        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            for group in optimizer.param_groups:
                group["lr"] = math.nan

    model, controller = _model_and_controller()
    trainer, checker = _trainer(model, controller, tmp_path / "run")
    trainer.add_callback(NaNRate())
    before = _state(model)
    with pytest.raises(ValueError, match=r"^RowSparseAdamW param group 0: lr must be a finite number >= 0, got nan"):
        trainer.train()
    assert all(torch.equal(before[name], value) for name, value in _state(model).items())
    assert not controller.in_step
    trainer.remove_callback(NaNRate)
    trainer.args.max_steps = 1
    trainer.train()
    assert checker.steps_checked == 1
