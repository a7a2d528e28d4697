"""Issue 57's hostile pass over what issue 56 built (memories at the scale continual learning needs): knowledge
patches, the row selection, ``benchmarks/bench_scale.py``, the compact optimizer state and the key-layout cache.
Each case is one a hostile user would try; each asserts the reference's answer, or a one-line error naming the
argument with nothing changed. The cases marked "was:" failed before this pass (the fix named beside them)."""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import smf_kernels.patch as patch_module
from smf.model import save_patch
from smf_kernels import ProductKeyMemory
from smf_kernels.patch import PATCH_CONFIG, PATCH_WEIGHTS, MemoryPatch, fingerprint
from smf_kernels.sparse import BackgroundStats, RowSparseAdamW, SparseMemoryController
from smf_kernels.sparse.selection import (background_weights, default_rows_per_step, select_read_rows_padded,
                                          select_rows_padded, weighted_scores)
from test_patches import _finetuned, _inputs, _rewrite, _same, _state

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
D_MODEL, VALUE_DIM = 40, 72  # awkward sizes: 13 ** 2 = 169 slots


def _memory(dtype=torch.float32, seed=0, n_keys=13):
    torch.manual_seed(seed)
    return ProductKeyMemory(D_MODEL, n_keys=n_keys, heads=2, topk=3, key_dim=10, value_dim=VALUE_DIM).to(dtype)


def _one_line(err) -> str:
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    return message


# ============================================================================================ knowledge patches
def test_a_patch_of_a_model_without_memories_is_refused():
    """was: a plain module's trainable weights silently became a "knowledge patch" (fix: between() refuses)."""
    linear = nn.Linear(6, 5)
    finetuned = copy.deepcopy(linear)
    with torch.no_grad():
        finetuned.weight += 1
    with pytest.raises(ValueError) as err:
        MemoryPatch.between(finetuned, linear)
    assert "model: a Linear without memories" in _one_line(err)


def test_a_patch_with_nan_rows_is_refused_before_anything_is_written(tmp_path):
    """was: save() wrote a patch that load() then refused (fix: save() checks finiteness first)."""
    base = _memory()
    model = _finetuned(base, [2, 40])
    with torch.no_grad():
        model.values[40, 3] = float("nan")
    patch = MemoryPatch.between(model, base)  # the bitwise comparison still finds the rows
    assert patch.entries["values"].indices.tolist() == [2, 40]
    with pytest.raises(ValueError) as err:
        patch.save(tmp_path / "patch")
    assert "patch entry values holds non-finite values" in _one_line(err)
    assert not (tmp_path / "patch").exists()


def test_a_patch_with_nan_optimizer_rows_is_refused_before_anything_is_written(tmp_path):
    base = _memory()
    patch = MemoryPatch.between(_finetuned(base, [2, 40]), base)
    entry = patch.entries["values"]
    entry.moments = {"row_step": torch.ones(2, dtype=torch.int64), "exp_avg": torch.zeros(2, VALUE_DIM),
                     "exp_avg_sq": torch.full((2, VALUE_DIM), float("inf"))}
    with pytest.raises(ValueError, match="non-finite"):
        patch.save(tmp_path / "patch")
    assert not (tmp_path / "patch").exists()


def test_a_patch_folder_that_is_a_file_is_named(tmp_path):
    """was: FileExistsError '[Errno 17] File exists' (fix: NotADirectoryError saying it is a file)."""
    base = _memory()
    (tmp_path / "patch").write_text("not a folder")
    with pytest.raises(NotADirectoryError) as err:
        MemoryPatch.between(_finetuned(base, [1]), base).save(tmp_path / "patch")
    assert "is a file, not a folder" in _one_line(err)
    assert (tmp_path / "patch").read_text() == "not a folder"


def test_a_patch_of_no_changed_rows_saves_loads_and_merges_as_nothing(tmp_path):
    base = _memory()
    patch = MemoryPatch.between(copy.deepcopy(base), base)
    assert patch.entries == {}
    patch.save(tmp_path / "patch")
    loaded, model = MemoryPatch.load(tmp_path / "patch"), copy.deepcopy(base)
    loaded.merge(model)
    assert _same(_state(model), _state(base))
    loaded.unmerge(model)
    assert _same(_state(model), _state(base))


@pytest.mark.parametrize("other", ["bf16 after the patch", "other n_keys", "other seed"])
def test_a_patch_merged_onto_another_table_is_refused_with_nothing_changed(tmp_path, other):
    base = _memory()
    save_patch(_finetuned(base, [3, 77]), base, tmp_path / "patch")
    target = {"bf16 after the patch": copy.deepcopy(base).to(torch.bfloat16), "other n_keys": _memory(n_keys=12),
              "other seed": _memory(seed=9)}[other]
    before = _state(target)
    with pytest.raises(ValueError) as err:
        MemoryPatch.load(tmp_path / "patch").merge(target)
    assert "patch entry" in _one_line(err)
    assert _same(_state(target), before)


def test_a_base_of_other_n_keys_is_refused_by_between():
    with pytest.raises(ValueError, match=r"base: keys is \(2, 2, 12, 5\) in the base but \(2, 2, 13, 5\)"):
        MemoryPatch.between(_finetuned(_memory(), [1]), _memory(n_keys=12))


def test_a_save_interrupted_between_its_two_renames_is_refused_not_mixed(tmp_path, monkeypatch):
    """The new weights under the old JSON: load() refuses the pair (their checksum), never merges a mix."""
    base = _memory()
    MemoryPatch.between(_finetuned(base, [1, 2]), base).save(tmp_path / "patch")
    real = patch_module._write_atomic

    def killed_before_the_json(path, data):
        if path.name == PATCH_CONFIG:
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(patch_module, "_write_atomic", killed_before_the_json)
    with pytest.raises(KeyboardInterrupt):
        MemoryPatch.between(_finetuned(base, [1, 2, 100], seed=4), base).save(tmp_path / "patch")
    assert sorted(os.listdir(tmp_path / "patch")) == [PATCH_CONFIG, PATCH_WEIGHTS]  # no temporary left
    model, before = copy.deepcopy(base), _state(base)
    with pytest.raises(ValueError, match="sha256 differs"):
        MemoryPatch.load(tmp_path / "patch").merge(model)
    assert _same(_state(model), before)


def test_saving_into_the_folder_of_another_patch_replaces_it_whole(tmp_path):
    base = _memory()
    MemoryPatch.between(_finetuned(base, [1, 2, 3, 4, 5]), base).save(tmp_path / "patch")
    second = _finetuned(base, [150], seed=7)
    MemoryPatch.between(second, base).save(tmp_path / "patch")
    model = copy.deepcopy(base)
    MemoryPatch.load(tmp_path / "patch").merge(model)
    assert _same(_state(model), _state(second))


def test_a_symlinked_patch_folder_and_files_load_as_the_patch(tmp_path):
    base = _memory()
    finetuned = _finetuned(base, [8, 9])
    MemoryPatch.between(finetuned, base).save(tmp_path / "real")
    (tmp_path / "linked").symlink_to(tmp_path / "real")
    (tmp_path / "files").mkdir()
    for name in (PATCH_CONFIG, PATCH_WEIGHTS):
        (tmp_path / "files" / name).symlink_to(tmp_path / "real" / name)
    for folder in ("linked", "files"):
        model = copy.deepcopy(base)
        MemoryPatch.load(tmp_path / folder).merge(model)
        assert _same(_state(model), _state(finetuned))


def test_two_patches_of_the_same_rows_unmerged_out_of_order_are_refused():
    base = _memory()
    first = _finetuned(base, [10, 11])
    second = _finetuned(first, [10, 11], seed=3)
    one, two = MemoryPatch.between(first, base), MemoryPatch.between(second, first)
    model = copy.deepcopy(base)
    one.merge(model)
    two.merge(model)
    stacked = _state(model)
    with pytest.raises(ValueError, match="unmerge later patches first"):
        one.unmerge(model)
    assert _same(_state(model), stacked)
    two.unmerge(model)
    one.unmerge(model)
    assert _same(_state(model), _state(base))


def test_unmerge_without_merge_and_a_second_merge_are_refused():
    base = _memory()
    patch = MemoryPatch.between(_finetuned(base, [4]), base)
    with pytest.raises(ValueError, match="this patch is not merged"):
        patch.unmerge(copy.deepcopy(base))
    model = copy.deepcopy(base)
    patch.merge(model)
    with pytest.raises(ValueError, match="merged already"):
        patch.merge(copy.deepcopy(base))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "enable_grad"])
def test_a_merge_under_any_grad_mode_gives_the_finetuned_forward(mode):
    base = _memory()
    finetuned = _finetuned(base, [0, 168])
    patch = MemoryPatch.between(finetuned, base)
    model = copy.deepcopy(base)
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "enable_grad": torch.enable_grad}
    with context[mode]():
        patch.merge(model)
    x = _inputs()
    assert torch.equal(model(x), finetuned(x))
    assert model.values.requires_grad and model.values.grad_fn is None  # still a leaf that trains
    model(x).sum().backward()
    assert model.values.grad is not None
    patch.unmerge(model)
    assert _same(_state(model), _state(base))


def test_a_huge_row_index_in_the_file_is_refused(tmp_path):
    base = _memory()
    save_patch(_finetuned(base, [5, 6]), base, tmp_path / "patch")
    _rewrite(tmp_path / "patch", tensors=lambda t: {**t, "values:indices": torch.tensor([5, 2**31 - 1],
                                                                                        dtype=torch.int32)})
    with pytest.raises(ValueError) as err:
        MemoryPatch.load(tmp_path / "patch")
    assert "outside [0, 169)" in _one_line(err)


@pytest.mark.parametrize("rows, stored, ok", [(2**31, torch.int32, True), (2**31, torch.int64, False),
                                              (2**31 + 1, torch.int64, True), (2**31 + 1, torch.int32, False)])
def test_the_index_dtype_follows_the_table_size_at_the_int32_boundary(tmp_path, rows, stored, ok):
    """A table of 2**31 rows stores int32 indices (its last row, 2**31 - 1, fits); one row more needs int64. The
    JSON's shape is edited (no table that large is made); the loader then reads the index dtype against it."""
    base = _memory()
    save_patch(_finetuned(base, [5, 6]), base, tmp_path / "patch")
    _rewrite(tmp_path / "patch",
             tensors=lambda t: {**t, "values:indices": torch.tensor([5, min(rows, 2**31) - 1], dtype=stored)},
             config=lambda spec: spec["entries"][0].update(shape=[rows, VALUE_DIM]))
    if ok:
        entry = MemoryPatch.load(tmp_path / "patch").entries["values"]
        assert entry.indices.dtype == torch.int64 and entry.indices.tolist() == [5, min(rows, 2**31) - 1]
    else:
        with pytest.raises(ValueError, match=f"indices must be {'torch.int32' if stored == torch.int64 else ''}"):
            MemoryPatch.load(tmp_path / "patch")


def test_a_patch_loads_onto_the_cpu_and_merges_into_a_table_on_any_device(tmp_path):
    """No device is recorded: the files load on the host (a machine without CUDA reads a patch saved on one) and
    each entry moves to its table's device when merged."""
    base = _memory()
    save_patch(_finetuned(base, [12]), base, tmp_path / "patch")
    entry = MemoryPatch.load(tmp_path / "patch").entries["values"]
    assert entry.data.device.type == "cpu" and entry.indices.device.type == "cpu"
    assert "device" not in (tmp_path / "patch" / PATCH_CONFIG).read_text()


def test_the_fingerprint_covers_dtype_shape_and_config_not_the_device_or_strides():
    table = torch.randn(13, 7)
    assert fingerprint(table) == fingerprint(table.t().contiguous().t().contiguous())
    assert fingerprint(table) != fingerprint(table.to(torch.float64))
    assert fingerprint(table) != fingerprint(table.reshape(7, 13))
    assert fingerprint(table) != fingerprint(table, {"n_keys": 13})
    assert fingerprint(table.t()) == fingerprint(table.t().contiguous())  # C order of what it shows


def test_a_model_on_the_meta_device_is_refused_by_name_with_nothing_changed():
    """was: NotImplementedError 'Cannot copy out of meta tensor' / 'aten::equal ... Meta tensors' (fix: merge()
    and between() name the tensor that holds no values)."""
    base = _memory()
    patch = MemoryPatch.between(_finetuned(base, [1]), base)
    unloaded = copy.deepcopy(base).to("meta")
    with pytest.raises(ValueError) as err:
        patch.merge(unloaded)
    assert "patch entry values: the model's tensor is a meta tensor" in _one_line(err)
    assert patch._replaced is None  # not merged: it still merges into a real model
    with pytest.raises(ValueError) as err:
        MemoryPatch.between(unloaded, base)
    assert "model: keys is a meta tensor" in _one_line(err)
    with pytest.raises(ValueError, match="base: keys is a meta tensor"):
        MemoryPatch.between(base, unloaded)


# ================================================================================================ row selection
def _stable_top(scores, counts, num_rows):
    """The oracle: a stable descending sort of the masked scores (NaN first), its first min(T, M) ascending."""
    masked = scores.masked_fill(counts == 0, float("-inf"))
    order = torch.sort(masked, descending=True, stable=True).indices
    rows = order[:min(num_rows, counts.numel())].sort().values
    return rows, counts[rows] > 0


def test_nan_and_inf_scores_select_what_a_stable_sort_selects():
    generator = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 3, (97,), generator=generator)
    scores = torch.randn(97, generator=generator, dtype=torch.float64)
    scores[[4, 9, 50]] = float("nan")
    scores[[5, 60]] = float("inf")
    scores[[6, 61, 62]] = float("-inf")
    for num_rows in (0, 1, 3, 11, 96, 97, 200):
        rows, valid = select_rows_padded(scores, counts, num_rows)
        expected_rows, expected_valid = _stable_top(scores, counts, num_rows)
        assert torch.equal(rows, expected_rows) and torch.equal(valid, expected_valid), num_rows


@pytest.mark.parametrize("rule", ["tfidf", "kl"])
def test_nan_and_inf_weights_give_the_padded_selections_answer(rule):
    generator = torch.Generator().manual_seed(4)
    counts = torch.randint(0, 4, (83,), generator=generator)
    counts[:5] = 0
    weights = torch.rand(83, generator=generator, dtype=torch.float64) + 0.1
    weights[[1, 7, 30]] = float("nan")
    weights[[2, 31]] = float("inf")
    for num_rows in (0, 5, 40, 83, 500):
        got = select_read_rows_padded(rule, counts, weights, num_rows)
        expected = select_rows_padded(weighted_scores(rule, counts, weights), counts, num_rows)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), num_rows


def test_no_slots_and_no_reads_select_nothing_valid():
    empty = torch.zeros(0, dtype=torch.int64)
    for rows, valid in (select_rows_padded(torch.zeros(0, dtype=torch.float64), empty, 7),
                        select_read_rows_padded("kl", empty, torch.zeros(0, dtype=torch.float64), 7)):
        assert rows.numel() == 0 and valid.numel() == 0
    counts = torch.zeros(29, dtype=torch.int64)
    rows, valid = select_read_rows_padded("tfidf", counts, torch.ones(29, dtype=torch.float64), 9)
    assert rows.tolist() == list(range(9)) and not valid.any()


def test_negative_counts_are_refused_by_name():
    """was: a slot read -2 times was scored (a negative batch share) and its row could be selected."""
    counts = torch.tensor([1, 0, -2, 3])
    with pytest.raises(ValueError) as err:
        select_read_rows_padded("tfidf", counts, torch.ones(4, dtype=torch.float64), 3)
    assert "counts must be non-negative, got -2" in _one_line(err)


@pytest.mark.parametrize("doc_freq, reads, num_batches, message", [
    ([-1, 0, 2, 2], [0, 0, 2, 2], 3, "doc_freq holds negative counts"),
    ([0, 0, 1, 1], [-1, 0, 1, 1], 3, "reads holds negative counts"),
    ([5, 0, 1, 1], [5, 0, 1, 1], 3, "doc_freq values up to 5 exceed num_batches 3"),
    ([0, 1, 1, 1], [0, 0, 1, 1], 3, "reads are fewer than doc_freq"),
    ([0, 0, 0, 0], [0, 0, 0, 0], -1, "num_batches must be a non-negative int, got -1"),
    ([0, 0, 0, 0], [0, 0, 0, 0], 2.0, "num_batches must be a non-negative int, got 2.0"),
])
@pytest.mark.parametrize("rule", ["tfidf", "kl"])
def test_background_weights_refuse_counts_no_counting_makes(rule, doc_freq, reads, num_batches, message):
    """was: NaN, inf or negative weights (an IDF of a negative doc_freq; q = 0 of reads -1) silently."""
    with pytest.raises(ValueError) as err:
        background_weights(rule, torch.tensor(doc_freq), torch.tensor(reads), num_batches)
    assert message in _one_line(err)


@pytest.mark.parametrize("scores, counts, num_rows, error, message", [
    (torch.tensor([3, 1, 2, 0]), torch.ones(4, dtype=torch.int64), 2, TypeError, "scores must be a floating tensor"),
    (torch.zeros(4, 1, dtype=torch.float64), torch.ones(4, dtype=torch.int64), 2, ValueError, "scores must be"),
    (torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.int32), 2, TypeError, "counts must have dtype"),
    (torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.int64), -1, ValueError, "num_rows must be"),
    (torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.int64), 2.0, ValueError, "num_rows must be"),
])
def test_select_rows_padded_refuses_wrong_types_by_name(scores, counts, num_rows, error, message):
    """was (integer scores): RuntimeError 'value cannot be converted to type int64_t without overflow'."""
    with pytest.raises(error) as err:
        select_rows_padded(scores, counts, num_rows)
    assert message in _one_line(err)


@pytest.mark.parametrize("slots", [0, -256, 1.5e4, True, "16384"])
def test_default_rows_per_step_refuses_a_slot_count_that_is_not_a_positive_int(slots):
    """was: 0 and -256 gave 1, 1.5e4 gave the float 468.0."""
    with pytest.raises(ValueError) as err:
        default_rows_per_step(slots)
    assert "num_slots must be a positive int" in _one_line(err)


def test_default_rows_per_step_is_the_papers_share_capped_at_512():
    assert [default_rows_per_step(n) for n in (1, 31, 32, 441, 16_384, 16_385, 2**40)] == [1, 1, 1, 13, 512, 512,
                                                                                          512]


def _selected(controller, memory, optimizer, x):
    controller.begin(1)
    memory(x).square().mean().backward()
    controller.after_forward()
    return controller.finish(optimizer).selected[""]


@pytest.mark.parametrize("edit", ["add_batch", "index_put", "copy_", "data", "new tensor", "num_batches"])
def test_a_background_changed_in_place_between_steps_is_used_not_a_stale_copy(edit):
    """The selection weights are made once per background: an edit between steps (each one that changes the rows
    the next step selects) must remake them; the rows are a fresh controller's on the edited statistics."""
    rule = "kl" if edit in ("add_batch", "copy_", "data") else "tfidf"  # tfidf reads doc_freq only, kl reads only
    memory = _memory()
    memory.requires_grad_(False)
    memory.values.requires_grad_(True)
    generator = torch.Generator().manual_seed(2)
    background = BackgroundStats.for_memories({"": memory})
    for _ in range(3):
        background.add_batch("", torch.randint(0, 3, (169,), generator=generator))
    controller = SparseMemoryController(memory, rule=rule, rows_per_step=6, background=background)
    optimizer = RowSparseAdamW([memory.values], lr=1e-3)
    x = _inputs()
    _selected(controller, memory, optimizer, x)
    heavy = torch.randint(0, 2, (169,), generator=generator) * 1000
    if edit == "add_batch":
        background.add_batch("", heavy)
    elif edit == "index_put":
        background.doc_freq[""][heavy > 0] = 0
    elif edit == "copy_":
        background.reads[""].copy_(background.reads[""] + heavy)
    elif edit == "data":  # bumps no version counter: set_background again, as docs/method.md says
        background.reads[""].data.add_(heavy)
        controller.set_background(background)
    elif edit == "new tensor":
        background.doc_freq[""] = torch.zeros(169, dtype=torch.int64)
    else:
        background.num_batches[""] += 50
    fresh, state = copy.deepcopy(memory), copy.deepcopy(optimizer.state_dict())
    got = _selected(controller, memory, optimizer, x)
    fresh_optimizer = RowSparseAdamW([fresh.values], lr=1e-3)
    fresh_optimizer.load_state_dict(state)
    fresh_controller = SparseMemoryController(fresh, rule=rule, rows_per_step=6, background=copy.deepcopy(background))
    assert torch.equal(got, _selected(fresh_controller, fresh, fresh_optimizer, x))


# ===================================================================================== benchmarks/bench_scale.py
def _bench(*argv):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_scale.py"), *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "abc"], "argument --sizes: expected comma-separated slot counts, got 'abc'"),
    (["--sizes", ""], "argument --sizes: expected comma-separated slot counts, got ''"),
    (["--sizes", "0"], "argument --sizes: each size must be n_keys ** 2 with n_keys >= 16 (top-16), got 0"),
    (["--sizes", "256,300"], "each size must be n_keys ** 2 with n_keys >= 16 (top-16), got 300"),
    (["--sizes", "256", "--model-slots", "1000"], "argument --model-slots: must be n_keys ** 2"),
    (["--sizes", "256", "--json", "/proc/no/such/folder/x.json"], "argument --json: cannot write"),
    (["--sizes", "256", "--json", "."], "argument --json: cannot write '.'"),
])
def test_bench_scale_refuses_bad_arguments_before_any_size_runs(argv, message):
    """was (--json): the sizes ran, then a FileNotFoundError / IsADirectoryError traceback lost the table."""
    proc = _bench(*argv)
    assert proc.returncode == 2 and message in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert proc.stdout == "" and "slots: step" not in proc.stderr  # nothing measured


def test_bench_scale_a_size_killed_for_memory_is_a_failed_row_not_a_lost_table(tmp_path):
    """A child killed by SIGKILL (as the OOM killer does): its row says so, the other size is measured, exit 1; and
    the layer's held bytes are read from what the controller holds today (was: AttributeError on a renamed field
    made every size 'failed')."""
    sitecustomize = tmp_path / "sitecustomize.py"
    sitecustomize.write_text("import os, signal, sys\n"
                             "if '--child' in sys.argv and sys.argv[sys.argv.index('--slots') + 1] == '400':\n"
                             "    os.kill(os.getpid(), signal.SIGKILL)\n")
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_scale.py"), "--sizes", "256,400",
                           "--tokens", "16", "--rows", "8", "--warmup", "0", "--repeats", "1", "--pairs", "1",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1"))
    assert proc.returncode == 1, proc.stderr[-2000:]
    rows = {r["slots"]: r for r in json.loads(out.read_text())["results"]}
    assert "failed" not in rows[256] and rows[256]["held_bytes"]["background"] > 0
    assert rows[400]["failed"] == "killed (out of memory?)" and "400 slots failed" in proc.stderr


# ======================================================================== compact optimizer state (RowSparseAdamW)
M_ROWS, WIDTH = 37, 6


def _table(form="compact", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    param = nn.Parameter(torch.randn(M_ROWS, WIDTH).to(dtype))
    return param, RowSparseAdamW([param], lr=0.1, state=form)


def _row_steps(param, optimizer, steps, seed=0):
    """``steps`` row updates of 5 random rows each (the same for the same ``seed``)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = torch.randperm(M_ROWS, generator=generator)[:5].sort().values
        optimizer.step_rows(param, rows, torch.randn(5, WIDTH, generator=generator))


def _compact_state_dict():
    param, optimizer = _table()
    _row_steps(param, optimizer, 3)
    return optimizer.state_dict()


COMPACT_DAMAGES = {
    "held_rows unsorted": (lambda s: s.update(held_rows=s["held_rows"].flip(0)),
                           "held_rows must be strictly ascending"),
    "held_rows duplicated": (lambda s: s["held_rows"].__setitem__(1, s["held_rows"][0]),
                             "held_rows must be strictly ascending"),
    "held_rows out of range": (lambda s: s["held_rows"].__setitem__(-1, M_ROWS), "rows in [0, 37)"),
    "held_rows negative": (lambda s: s["held_rows"].__setitem__(0, -1), "rows in [0, 37)"),
    "held_rows wrong length": (lambda s: s.update(held_rows=s["held_rows"][:-1]),
                               "held_rows and held_slots must have one entry per row"),
    "held_rows int32": (lambda s: s.update(held_rows=s["held_rows"].int()), "held_rows must be a 1-D int64 tensor"),
    "held_slots repeated": (lambda s: s["held_slots"].__setitem__(0, s["held_slots"][1]),
                            "held_slots must give slots 0..13 to one row each"),
    "both forms": (lambda s: s.update(row_step=torch.zeros(M_ROWS, dtype=torch.int64)), "holds both held_rows and"),
    "moments of another width": (lambda s: s.update(exp_avg=s["exp_avg"][:, :-1]), "exp_avg must be a floating"),
}


@pytest.mark.parametrize("damage", list(COMPACT_DAMAGES))
def test_a_damaged_compact_state_dict_is_refused_with_nothing_loaded(damage):
    saved = _compact_state_dict()
    spoil, message = COMPACT_DAMAGES[damage]
    spoil(saved["state"][0])
    param, optimizer = _table()
    with pytest.raises(ValueError) as err:
        optimizer.load_state_dict(saved)
    assert message in _one_line(err) and "parameter 0 of group 0 ((37, 6))" in str(err.value)
    assert optimizer.state == {} or not optimizer.state[param]


@pytest.mark.parametrize("saved_form, loaded_form", [("dense", "compact"), ("compact", "dense")])
def test_a_state_saved_in_one_form_continues_bit_identically_in_the_other(saved_form, loaded_form):
    reference, reference_optimizer = _table(saved_form)
    _row_steps(reference, reference_optimizer, 3)
    param, optimizer = _table(loaded_form)
    with torch.no_grad():
        param.copy_(reference)
    optimizer.load_state_dict(copy.deepcopy(reference_optimizer.state_dict()))
    assert ("held_rows" in optimizer.state[param]) == (loaded_form == "compact")
    _row_steps(reference, reference_optimizer, 4, seed=5)
    _row_steps(param, optimizer, 4, seed=5)
    assert torch.equal(param, reference)
    ours, theirs = optimizer.row_state(param), reference_optimizer.row_state(reference)
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)
    assert torch.equal(optimizer.touched_rows(param), reference_optimizer.touched_rows(reference))


@pytest.mark.parametrize("form", ["compact", "dense"])
def test_a_state_saved_from_an_fp32_table_loads_into_a_bf16_one_as_torch_casts_it(form):
    """was: the moments stayed fp32 and the next step failed ('exp_avg must have dtype in (bfloat16)'); torch's
    AdamW (and this optimizer before the compact form) cast them to the table's dtype (fix: load_state_dict)."""
    fp32, fp32_optimizer = _table(form)
    _row_steps(fp32, fp32_optimizer, 2)
    bf16, optimizer = _table(form, torch.bfloat16)
    optimizer.load_state_dict(fp32_optimizer.state_dict())
    state = optimizer.state[bf16]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    steps = state["slot_step" if form == "compact" else "row_step"]
    assert steps.dtype == torch.int64
    expected = fp32_optimizer.row_state(fp32)
    loaded = optimizer.row_state(bf16)
    assert torch.equal(loaded["exp_avg"], expected["exp_avg"].to(torch.bfloat16))
    assert torch.equal(loaded["row_step"], expected["row_step"])
    _row_steps(bf16, optimizer, 1, seed=3)  # steps
    assert torch.isfinite(bf16).all()


def test_masked_clipped_steps_give_the_same_bits_in_both_forms():
    """30 steps of 9 rows each, a random third of them masked out (``valid``), the gradient scaled: the compact
    form's table, moments, counts and touched rows are the dense form's, bit for bit."""
    compact_table, compact_optimizer = _table("compact")
    dense_table, dense_optimizer = _table("dense")
    generator = torch.Generator().manual_seed(1)
    for _ in range(30):
        rows = torch.randperm(M_ROWS, generator=generator)[:9].sort().values
        grad, valid = torch.randn(9, WIDTH, generator=generator), torch.rand(9, generator=generator) > 0.4
        for table, optimizer in ((compact_table, compact_optimizer), (dense_table, dense_optimizer)):
            optimizer.step_rows(table, rows, grad, valid=valid, grad_scale=torch.tensor(0.7))
    assert torch.equal(compact_table, dense_table)
    ours, theirs = compact_optimizer.row_state(compact_table), dense_optimizer.row_state(dense_table)
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)
    assert torch.equal(compact_optimizer.touched_rows(compact_table), dense_optimizer.touched_rows(dense_table))


def test_a_compact_state_dict_survives_torch_save_with_weights_only(tmp_path):
    param, optimizer = _table()
    _row_steps(param, optimizer, 3)
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    resumed, resumed_optimizer = _table()
    with torch.no_grad():
        resumed.copy_(param)
    resumed_optimizer.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    _row_steps(param, optimizer, 2, seed=4)
    _row_steps(resumed, resumed_optimizer, 2, seed=4)
    assert torch.equal(resumed, param)


@pytest.mark.parametrize("form", ["compact", "dense"])
def test_touched_rows_and_row_state_of_a_table_never_stepped_are_empty_and_zero(form):
    param, optimizer = _table(form)
    assert optimizer.touched_rows(param).tolist() == []
    state = optimizer.row_state(param, torch.tensor([0, 36]))
    assert not state["exp_avg"].any() and state["row_step"].tolist() == [0, 0]
    assert optimizer.state_dict()["state"] == {}


@pytest.mark.parametrize("form", ["compact", "dense"])
@pytest.mark.parametrize("rows, error, message", [
    (torch.tensor([M_ROWS + 3]), IndexError, "rows must lie in [0, 37)"),
    (torch.tensor([-1]), IndexError, "rows must lie in [0, 37)"),
    (torch.tensor([1], dtype=torch.int32), TypeError, "rows must have dtype in (int64)"),
])
def test_row_state_refuses_rows_outside_the_table_in_both_forms(form, rows, error, message):
    """was (compact): rows outside the table, negative or int32 read as 'no state' (zeros), where the dense form
    raised an IndexError without naming the argument (fix: row_state checks its rows)."""
    param, optimizer = _table(form)
    _row_steps(param, optimizer, 2)
    with pytest.raises(error) as err:
        optimizer.row_state(param, rows)
    assert message in _one_line(err)


def test_a_failed_step_rows_leaves_the_compact_state_as_it_was():
    param, optimizer = _table()
    _row_steps(param, optimizer, 2)
    before, table = copy.deepcopy(optimizer.state_dict()), param.detach().clone()
    for rows in (torch.tensor([1, 1]), torch.tensor([3, M_ROWS])):
        with pytest.raises((ValueError, IndexError)):
            optimizer.step_rows(param, rows, torch.ones(2, WIDTH))
    after = optimizer.state_dict()
    assert all(torch.equal(after["state"][0][key], before["state"][0][key]) for key in before["state"][0])
    assert torch.equal(param, table)


def test_a_patch_with_optimizer_rows_continues_in_a_dense_form_optimizer_as_in_a_compact_one(tmp_path):
    """The patch's optimizer rows, saved from a compact state, put back into a fresh optimizer of either form:
    the next steps give the same table as the run that saved it."""
    base = _memory()
    model = copy.deepcopy(base)
    model.requires_grad_(False)
    model.values.requires_grad_(True)
    optimizer = RowSparseAdamW([model.values], lr=1e-2)

    def steps(memory, opt, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(3):
            rows = torch.randperm(169, generator=g)[:11].sort().values
            opt.step_rows(memory.values, rows, torch.randn(11, VALUE_DIM, generator=g))

    steps(model, optimizer, 1)
    save_patch(model, base, tmp_path / "patch", optimizer=optimizer)
    steps(model, optimizer, 2)
    for form in ("compact", "dense"):
        resumed = copy.deepcopy(base)
        resumed.requires_grad_(False)
        resumed.values.requires_grad_(True)
        resumed_optimizer = RowSparseAdamW([resumed.values], lr=1e-2, state=form)
        patch = MemoryPatch.load(tmp_path / "patch")
        patch.merge(resumed)
        patch.load_optimizer_rows(resumed, resumed_optimizer)
        steps(resumed, resumed_optimizer, 2)
        assert torch.equal(resumed.values, model.values), form


# ==================================================================================== key-layout cache, decoding
def _decoder_memory(dtype=torch.bfloat16, seed=0):
    """A memory whose torch-backend top-k reads a layout of its keys (float32 copies of 16-bit keys)."""
    torch.manual_seed(seed)
    return ProductKeyMemory(D_MODEL, n_keys=13, heads=2, topk=3, key_dim=10, value_dim=VALUE_DIM,
                            backend="torch").to(dtype)


def _per_call(memory):
    """A copy of ``memory`` that lays its keys out on every call (the reference)."""
    twin = copy.deepcopy(memory)
    twin.key_layouts = None
    return twin


def _decode(memory, tokens=1, seed=8):
    return memory(torch.randn(tokens, D_MODEL, generator=torch.Generator().manual_seed(seed)).to(memory.keys.dtype))


def _edit_no_grad(memory):
    with torch.no_grad():
        memory.keys.mul_(-1.5)


def _edit_inference_mode(memory):
    with torch.inference_mode():
        memory.keys.mul_(-1.0)


def _edit_vector_to_parameters(memory):
    vector = nn.utils.parameters_to_vector(memory.parameters())
    nn.utils.vector_to_parameters(vector * -1.0, memory.parameters())


def _edit_adamw_step(memory):
    optimizer = torch.optim.AdamW(memory.parameters(), lr=0.5)
    _decode(memory, tokens=3).float().square().sum().backward()
    optimizer.step()


def _edit_data_then_new_cache(memory):
    from smf_kernels.ops import KeyLayoutCache
    memory.keys.data.mul_(-1.0)  # bumps no version: the documented remedy is a new cache
    memory.key_layouts = KeyLayoutCache()


KEY_EDITS = {
    "in place under no_grad": _edit_no_grad,
    "in place under inference_mode": _edit_inference_mode,
    "load_state_dict": lambda m: m.load_state_dict({**m.state_dict(), "keys": -m.keys.detach().clone()}),
    "a .data swap": lambda m: setattr(m.keys, "data", torch.flip(m.keys.detach(), [2]).clone()),
    "vector_to_parameters": _edit_vector_to_parameters,
    "an AdamW step": _edit_adamw_step,
    ".data write, then a new cache": _edit_data_then_new_cache,
}


@pytest.mark.parametrize("edit", list(KEY_EDITS))
def test_keys_edited_between_decodes_are_looked_up_as_they_are_now(edit):
    memory = _decoder_memory()
    before = _decode(memory)
    KEY_EDITS[edit](memory)
    after = _decode(memory)
    assert torch.equal(after, _decode(_per_call(memory)))
    assert not torch.equal(after, before)  # the edit changed the answer: a stale layout would show


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_grad_decoding_then_training_gives_the_per_call_gradients(dtype):
    memory = _decoder_memory(dtype)
    with torch.no_grad():
        _decode(memory, tokens=2)  # the cache is made here, outside autograd
    twin = _per_call(memory)
    for module in (memory, twin):
        _decode(module, tokens=5, seed=3).float().square().sum().backward()
    for name, param in memory.named_parameters():
        assert torch.equal(param.grad, dict(twin.named_parameters())[name].grad), name
    assert not memory.keys.grad.eq(0).all()


def test_a_deep_copy_with_edited_keys_leaves_the_original_lookup_alone():
    memory = _decoder_memory()
    original = _decode(memory)
    copied = copy.deepcopy(memory)
    with torch.no_grad():
        copied.keys.mul_(-1.0)
    assert torch.equal(_decode(copied), _decode(_per_call(copied)))
    assert torch.equal(_decode(memory), original)


def test_one_cache_alternating_between_two_keys_tensors_stays_right():
    from smf_kernels.ops import KeyLayoutCache, product_key_topk
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(4, 2, 10, generator=generator).bfloat16()
    first, second = (torch.randn(2, 2, 13, 5, generator=generator).bfloat16() for _ in range(2))
    cache = KeyLayoutCache()
    for keys in (first, second, first, second[:, :, :, :]):
        got, expected = product_key_topk(query, keys, 3, key_layouts=cache), product_key_topk(query, keys, 3)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("cache", [torch.zeros(3), {}, "cache"])
def test_a_key_layouts_that_is_not_a_cache_is_refused_by_name(cache):
    """was: TypeError "'torch.layout' object is not callable" or AttributeError (fix: product_key_topk checks)."""
    from smf_kernels.ops import product_key_topk
    with pytest.raises(TypeError) as err:
        product_key_topk(torch.randn(3, 2, 10), torch.randn(2, 2, 13, 5), 3, key_layouts=cache)
    assert f"key_layouts must be a KeyLayoutCache or None, got {type(cache).__name__}" in _one_line(err)


def test_a_memory_made_under_inference_mode_decodes_as_one_made_outside():
    with torch.inference_mode():
        inside = _decoder_memory()
        got = _decode(inside)
    outside = _decoder_memory()
    with torch.no_grad():
        assert torch.equal(got, _decode(outside))


# ======================================================================= save_patch against a memory adapter
def _tiny_with_memories(layers, mode="additive", **overrides):
    from smf.model import attach_memories
    from smf.tiny import TINY_MEMORY_KWARGS, tiny_model
    model = tiny_model()
    attach_memories(model, layers, mode, **{**TINY_MEMORY_KWARGS, **overrides})
    return model


def _move_values(model, row=3):
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("memory.values"):
                param[row] += 1


@pytest.mark.parametrize("model_layers", [(2,), (1, 2)])
def test_a_patch_against_an_adapter_of_other_layers_is_refused_not_empty(tmp_path, model_layers):
    """was: the model's memories the adapter lacks were left out without a word (an empty patch for (2,))
    (fix: between() refuses a base without one of the model's values tables)."""
    from smf.model import save_memory_adapter
    save_memory_adapter(_tiny_with_memories((1,)), tmp_path / "adapter")
    model = _tiny_with_memories(model_layers)
    _move_values(model)
    with pytest.raises(ValueError) as err:
        save_patch(model, tmp_path / "adapter", tmp_path / "patch")
    assert "base: lacks the model's values table(s) ['model.layers.2.mlp.memory.values']" in _one_line(err)
    assert not (tmp_path / "patch").exists()


def test_a_patch_against_its_own_adapter_holds_only_the_moved_rows(tmp_path):
    from smf.model import save_memory_adapter
    model = _tiny_with_memories((1, 2))
    save_memory_adapter(model, tmp_path / "adapter")
    _move_values(model, row=7)
    patch = save_patch(model, tmp_path / "adapter", tmp_path / "patch")
    assert {name: entry.indices.tolist() for name, entry in patch.entries.items()} == {
        "model.layers.1.mlp.memory.values": [7], "model.layers.2.mlp.memory.values": [7]}


@pytest.mark.parametrize("other, message", [
    ({"n_keys": 15}, r"base: model.layers.1.mlp.memory.keys is \(2, 2, 16, 16\) in the base but \(2, 2, 15, 16\)"),
    ({"mode": "replacement"}, "base: 'model.layers.1.mlp.alpha' is not a tensor of the model"),
])
def test_a_patch_against_an_adapter_of_another_shape_or_mode_is_refused(tmp_path, other, message):
    from smf.model import save_memory_adapter
    save_memory_adapter(_tiny_with_memories((1,)), tmp_path / "adapter")
    mode = other.pop("mode", "additive")
    model = _tiny_with_memories((1,), mode, **other)
    with pytest.raises(ValueError, match=message):
        save_patch(model, tmp_path / "adapter", tmp_path / "patch")
    assert not (tmp_path / "patch").exists()
