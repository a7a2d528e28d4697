"""SMF at large memories (issue 56): one sparse step of a ProductKeyMemory at 16k, 262k and 1M slots.

SMF's use is continual learning with large memories (~1M slots, Lin et al. 2025); the step's cost should grow
with the rows it touches, not with the table. Each size runs in its own process (so that peak resident memory is
that size's): a ProductKeyMemory(896) with ``n_keys`` = sqrt(slots), 4 heads, top-16, key_dim 256, only the values
training (stage 2), T rows per step passed explicitly, RowSparseAdamW, background statistics from random counts.
A step is the real step path, a :class:`~smf_kernels.sparse.SparseMemoryController`'s ``begin`` /
``after_forward`` / ``finish`` (one micro-batch of ``--tokens`` tokens: rows first, selected
after the forward). Reported per size:

  phases      medians of the timed steps (wall): begin, forward, selection (after_forward), backward, optimizer
              (finish: the step's end, clipping, RowSparseAdamW.step_rows) and the whole step; and the whole
              step's thread CPU time (one torch thread: the step's own work, which other jobs on a shared machine
              disturb far less than its wall time)
  floor       a lower bound of the step on this core (:func:`step_floor`): its matmul FLOPs at the measured
              one-thread sgemm rate plus the table rows it must read at the random-row read bandwidth measured on
              the layer's own table (the faster of benchmarks/row_read_probe.c, built with the C compiler at hand,
              and the layer's own gather of the same rows)
  ratio       the size's step over the smallest size's, from interleaved pairs (the two layers stepped
              alternately in one process, the order alternating; the median of the per-pair ratios of the
              thread CPU time, the wall-time ratio beside it)
  first step  the first step's time and its optimizer phase (state made on first use)
  held bytes  tensors the layer and its step hold, deduplicated by storage: the layer's parameters and buffers,
              the background statistics, the optimizer's state, and the step's gradient sinks (after the backward)
  peak RSS    the process's resident-set high-water mark after the timed steps (ru_maxrss)
  checkpoint  bytes torch.save writes for the trainable parameters and the optimizer state (smf train's
              checkpoint.pt holds these two, :func:`smf.train.checkpoint.save_checkpoint`)
  patch       bytes of the knowledge patch (smf_kernels.patch) of the rows the steps changed, and their count

The targets, printed beside the measurements at the largest size: its step <= 1.25x the smallest's (interleaved,
CPU time; with the best ratio the floor allows: the smallest's step plus the floor's extra work at the largest);
selection <= 5% of its step; held bytes <= table + 1.1 x (touched rows' state + gradient) for a T-row step (table:
the layer's own tensors and the background statistics; touched: T rows of both AdamW moments, the gradient and
the step count); the first step's optimizer phase <= 2x its steady median. ``--model`` also steps a
Qwen-2.5-0.5B-shaped random model (nothing downloaded) with memories of ``--model-slots`` at the paper's layers 6, 12,
18 in mode additive+s (the sparse stage trains the values and alpha), fp32 (and bf16 weights with ``--bf16``,
every parameter cast as the authors' protocol casts them; the memories built in bf16, ``attach_memories(dtype=)``:
the same values as fp32 memories cast, without holding the tables in fp32), background from random counts, two steps
of one micro-batch of ``--model-tokens`` tokens; target: the steps' peak RSS (the high-water mark restarted once the
model is built, which it builds in fp32 first) <= 16 GiB fp32 / 9 GiB bf16.

    python benchmarks/bench_scale.py                                  # 16k, 262k, 1M slots, one thread
    python benchmarks/bench_scale.py --sizes 16384,1048576 --json scale.json
    python benchmarks/bench_scale.py --sizes 16384 --model --bf16     # and the 0.5B model with 1M-slot memories
    python benchmarks/bench_scale.py --sizes 16384,1048576 --huge-pages   # both tables on huge pages
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from smf_kernels.backends import BACKENDS, resolve_backend  # noqa: E402
from smf_kernels.huge_pages import transparent_huge_pages  # noqa: E402

logger = logging.getLogger("bench_scale")
D_MODEL, LAYER_KWARGS = 896, dict(heads=4, topk=16, key_dim=256)
PAPER_LAYERS = (6, 12, 18)
MIB, GIB = 2 ** 20, 2 ** 30
PHASES = ("begin", "forward", "selection", "backward", "optimizer", "step")
# target bounds (issue 56)
STEP_RATIO_MAX, SELECTION_SHARE_MAX, STATE_SLACK, FIRST_OPTIMIZER_MAX = 1.25, 0.05, 1.1, 2.0
MODEL_RSS_MAX_GIB = {"fp32": 16.0, "bf16": 9.0}


# ----------------------------------------------------------------------------------------------- one layer
def build_layer(slots: int, args: argparse.Namespace, seed: int) -> dict:
    """A ProductKeyMemory(896) of ``slots`` slots (values training only), its controller with background
    statistics from four random count vectors, RowSparseAdamW, and a step's (tokens, 896) input and
    target."""
    from smf_kernels import ProductKeyMemory
    from smf_kernels.sparse import BackgroundStats, RowSparseAdamW, SparseMemoryController

    torch.manual_seed(seed)
    memory = ProductKeyMemory(D_MODEL, n_keys=math.isqrt(slots), backend=args.backend, huge_pages=args.huge_pages,
                              **LAYER_KWARGS)
    memory.requires_grad_(False)
    memory.values.requires_grad_(True)
    controller = SparseMemoryController(memory, rule=args.rule, rows_per_step=args.rows)
    background = BackgroundStats.for_memories(controller.memories)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(4):
        background.add_batch("", torch.randint(0, 3, (slots,), generator=generator))
    controller.set_background(background)
    return dict(memory=memory, seed=seed, controller=controller,
                optimizer=RowSparseAdamW([memory.values], lr=5e-4),
                inputs=torch.randn(args.tokens, D_MODEL), target=torch.randn(args.tokens, D_MODEL))


def _clock() -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds): with one torch thread the step's work runs on this thread, and
    its CPU time is that work whatever else the machine runs (the wall time also counts waits for a core)."""
    return time.perf_counter(), time.thread_time()


def timed_step(layer: dict, held: dict | None = None) -> dict:
    """One SMF step of ``layer``; seconds of each phase of :data:`PHASES`, wall (by phase name) and the thread's
    CPU time (``cpu_`` + phase name). ``held``: filled with the step's held bytes by part (:func:`held_bytes`, the
    sinks read after the backward, outside the timed phases)."""
    memory, step = layer["memory"], layer["controller"]
    t = [_clock()]
    step.begin(1)
    t.append(_clock())
    loss = (memory(layer["inputs"]) - layer["target"]).square().mean()
    t.append(_clock())
    step.after_forward()
    t.append(_clock())
    loss.backward()
    t.append(_clock())
    if held is not None:
        held.update(held_bytes(layer))
    t.append(_clock())
    step.finish(layer["optimizer"], max_grad_norm=1.0)
    t.append(_clock())
    seconds = {}
    for clock, prefix in ((0, ""), (1, "cpu_")):
        spans = [t[i + 1][clock] - t[i][clock] for i in range(len(t) - 1)]
        seconds.update({prefix + phase: span for phase, span in zip(PHASES[:4], spans)})
        seconds[prefix + "optimizer"] = spans[5]
        seconds[prefix + "step"] = sum(spans[:4]) + spans[5]
    return seconds


def _tensors(obj, depth: int = 0):
    """Every tensor reachable from ``obj`` through containers and plain objects' attributes (six levels deep)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 6 and isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value, depth + 1)
    elif depth < 6 and isinstance(obj, (list, tuple, set)):
        for value in obj:
            yield from _tensors(value, depth + 1)
    elif depth < 6 and not isinstance(obj, (torch.nn.Module, type)):
        slots = [name for cls in type(obj).__mro__ for name in getattr(cls, "__slots__", ())]
        fields = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
        fields.update((name, getattr(obj, name)) for name in slots if hasattr(obj, name))
        yield from _tensors(fields, depth + 1)


def held_bytes(layer: dict) -> dict:
    """Bytes of the tensors the layer and its step hold, by part, each storage counted once (in the first part
    that holds it): ``layer`` (parameters and buffers), ``background`` (the controller's statistics and the
    selection weights made from them), ``optimizer`` (its state), ``sinks`` (the step's gradient sinks: call after
    the backward)."""
    controller = layer["controller"]
    parts = {"layer": list(layer["memory"].parameters()) + list(layer["memory"].buffers()),
             "background": list(_tensors(vars(controller.background))) + list(_tensors(controller._weights)),
             "optimizer": list(_tensors(layer["optimizer"].state)),
             "sinks": list(_tensors(controller.sinks))}
    seen, sizes = set(), {}
    for part, tensors in parts.items():
        sizes[part] = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                sizes[part] += storage.nbytes()
    return sizes


def checkpoint_bytes(layer: dict) -> int:
    """Bytes torch.save writes for the layer's trainable parameters and the optimizer's state dict (what
    ``smf train``'s checkpoint.pt holds of them), to a temporary directory."""
    trainable = {name: p.detach() for name, p in layer["memory"].named_parameters() if p.requires_grad}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "checkpoint.pt")
        torch.save({"trainable": trainable, "optimizer": layer["optimizer"].state_dict()}, path)
        return os.path.getsize(path)


def patch_bytes(layer: dict) -> tuple[int | None, str]:
    """(bytes of the knowledge patch of the rows the layer's steps changed, note): a
    :class:`smf_kernels.patch.MemoryPatch` against the layer's initial table (rebuilt from its seed), written to a
    temporary directory."""
    from smf_kernels import ProductKeyMemory
    from smf_kernels.patch import MemoryPatch

    memory = layer["memory"]
    torch.manual_seed(layer["seed"])
    base = ProductKeyMemory(D_MODEL, n_keys=memory.n_keys, **LAYER_KWARGS)
    patch = MemoryPatch.between(memory, base)
    del base
    changed = sum(0 if entry.indices is None else entry.indices.numel() for entry in patch.entries.values())
    with tempfile.TemporaryDirectory() as tmp:
        patch.save(tmp)
        size = sum(os.path.getsize(os.path.join(tmp, name)) for name in os.listdir(tmp))
    return size, f"{changed:,} rows"


def touched_bytes(layer: dict) -> int:
    """What a T-row step must hold for its rows: both AdamW moments and the gradient of T rows, and their step
    counts."""
    values = layer["memory"].values
    rows = min(layer["controller"].layer_rows[""], values.shape[0])
    return rows * (values.shape[1] * (2 * values.element_size() + 4) + 8)


def rss_gib() -> float:
    """This process's resident-set high-water mark (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def reset_peak_rss() -> bool:
    """Restart this process's resident-set high-water mark from its current size (Linux: clear_refs 5); False
    where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def measure_layer(slots: int, base: int, args: argparse.Namespace) -> dict:
    """Everything of the module docstring for one size (run in its own process)."""
    tag = f"[{slots:,} slots]"
    start = time.perf_counter()
    layer = build_layer(slots, args, seed=0)
    logger.info("%s built in %.1f s; first step ...", tag, time.perf_counter() - start)
    first = timed_step(layer)
    logger.info("%s first step %.2f s (optimizer phase %.2f s)", tag, first["step"], first["optimizer"])
    steps, held = [], {}
    for index in range(args.warmup + args.repeats):
        seconds = timed_step(layer, held if index == args.warmup + args.repeats - 1 else None)
        if index >= args.warmup:
            steps.append(seconds)
        logger.info("%s step %d of %d: %.3f s", tag, index + 1, args.warmup + args.repeats, seconds["step"])
    result = dict(slots=slots, n_keys=math.isqrt(slots), tokens=args.tokens, rows=args.rows,
                  huge_pages=layer["memory"].huge_pages,
                  backend=resolve_backend(args.backend, torch.device("cpu"), torch.float32),
                  phases_ms={phase: 1e3 * statistics.median(s[phase] for s in steps) for phase in PHASES},
                  cpu_phases_ms={phase: 1e3 * statistics.median(s["cpu_" + phase] for s in steps)
                                 for phase in PHASES},
                  first_step_ms=1e3 * first["step"], first_optimizer_ms=1e3 * first["optimizer"],
                  held_bytes=held, held_total_bytes=sum(held.values()), touched_bytes=touched_bytes(layer),
                  peak_rss_gib=rss_gib())
    result["floor"] = step_floor(layer, args)
    logger.info("%s floor %.1f ms (%.2f GFLOP at %.1f GFLOP/s + %.0f MB of rows at %.2f GB/s)", tag,
                result["floor"]["ms"], result["floor"]["gflop"], result["floor"]["gflops"], result["floor"]["mb"],
                result["floor"]["gbs"])
    result["ratio_to_base"], result["pair_ratios"] = 1.0, []
    result["cpu_ratio_to_base"], result["cpu_pair_ratios"] = 1.0, []
    if slots != base:
        pairs = interleaved_ratios(layer, base, args, tag)
        result.update(pairs)
        result["ratio_to_base"] = statistics.median(result["pair_ratios"])
        result["cpu_ratio_to_base"] = statistics.median(result["cpu_pair_ratios"])
    result["checkpoint_bytes"] = checkpoint_bytes(layer)
    result["patch_bytes"], result["patch_note"] = patch_bytes(layer)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["cpu_s"], result["wall_s"] = usage.ru_utime + usage.ru_stime, time.perf_counter() - start
    return result


def interleaved_ratios(layer: dict, base: int, args: argparse.Namespace, tag: str) -> dict:
    """Per-pair ratios of ``layer``'s step over a ``base``-slot layer's, the two stepped alternately (the order
    alternating between pairs): ``pair_ratios`` (wall) and ``cpu_pair_ratios`` (the thread's CPU time), the base
    layer's median step CPU ms in the pairs (``base_cpu_step_ms``) and its floor (``base_floor``, this process)."""
    small = build_layer(base, args, seed=1)
    timed_step(small)  # its first step (state made), untimed
    out = dict(pair_ratios=[], cpu_pair_ratios=[], base_cpu_steps_ms=[])
    for index in range(args.pairs):
        if index % 2:
            big, small_s = timed_step(layer), timed_step(small)
        else:
            small_s, big = timed_step(small), timed_step(layer)
        out["pair_ratios"].append(big["step"] / small_s["step"])
        out["cpu_pair_ratios"].append(big["cpu_step"] / small_s["cpu_step"])
        out["base_cpu_steps_ms"].append(1e3 * small_s["cpu_step"])
        logger.info("%s pair %d of %d: %.3f s / %.3f s = %.2fx (CPU %.3f s / %.3f s = %.2fx)", tag, index + 1,
                    args.pairs, big["step"], small_s["step"], out["pair_ratios"][-1], big["cpu_step"],
                    small_s["cpu_step"], out["cpu_pair_ratios"][-1])
    out["base_cpu_step_ms"] = statistics.median(out.pop("base_cpu_steps_ms"))
    out["base_floor"] = step_floor(small, args)
    return out


# ------------------------------------------------------------------------------------------------ the floor
# The ext gather's choice of columns per pass (csrc/cpu_gather.cpp): slices of a 16 MB cache budget, whole rows
# once a 112-column slice exceeds 4 MB.
GATHER_TILE, GATHER_BUDGET, GATHER_WHOLE_ROWS_ABOVE = 112, 16 * MIB, 4 * MIB


def _row_read_probe():
    """benchmarks/row_read_probe.c built with the C compiler at hand (``$CC`` or ``cc``) and loaded; None (with a
    warning) where that fails."""
    import ctypes

    folder = tempfile.mkdtemp(prefix="bench_scale_probe_")
    library = os.path.join(folder, "row_read_probe.so")
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "row_read_probe.c")
    try:
        subprocess.run([os.environ.get("CC", "cc"), "-O3", "-march=native", "-shared", "-fPIC", "-o", library,
                        source], check=True, capture_output=True)
        probe = ctypes.CDLL(library).read_rows
    except (OSError, subprocess.CalledProcessError) as error:
        logger.warning("no floor: the row-read probe did not build (%s)", error)
        return None
    probe.restype = ctypes.c_double
    probe.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                      ctypes.c_void_p]
    return probe


def step_floor(layer: dict, args: argparse.Namespace) -> dict | None:
    """A lower bound of the step's time on this core: the FLOPs of its matmuls (the query, gate and output
    projections and the sub-key scores forward, the output projection's input gradient backward) at the measured
    one-thread sgemm rate, plus the table bytes it must read (the forward's N x L random value rows, and T rows of
    the parameter, both moments (read and written) and the gradient in the optimizer) at the measured random-row
    read bandwidth of this table: the faster of row_read_probe.c (over the layer's own values, columns per pass as
    the ext gather takes them) and the layer's own gather of the same rows. Activations, the selection and
    elementwise work are left out. None without the probe."""
    memory = layer["memory"]
    values = memory.values.detach()
    from smf_kernels.ops import weighted_gather

    probe = _row_read_probe() if values.dtype == torch.float32 else None  # the probe reads float32 rows
    if probe is None:
        return None
    rows, dim = values.shape
    tokens, reads = args.tokens, args.tokens * memory.heads * memory.topk
    slice_bytes = rows * values.element_size() * GATHER_TILE
    cols = dim if slice_bytes > GATHER_WHOLE_ROWS_ABOVE else max(1, GATHER_BUDGET // slice_bytes) * GATHER_TILE
    ids = torch.randint(0, rows, (reads,), generator=torch.Generator().manual_seed(0))
    out, weights = torch.zeros(dim), torch.full((tokens, reads // tokens), 1.0 / (reads // tokens))
    read_s = []
    for _ in range(3):  # the probe, and the layer's own gather of the same rows: the faster read counts
        read_s.append(probe(values.data_ptr(), dim, ids.data_ptr(), reads, cols, out.data_ptr()))
        start = time.thread_time()
        with torch.no_grad():
            weighted_gather(values, ids.view(tokens, -1), weights, backend=memory.resolved_backend(values.device))
        read_s.append(time.thread_time() - start)
    read_s = min(read_s)
    gbs = reads * dim * values.element_size() / read_s / 1e9
    a, w = torch.randn(tokens, D_MODEL), torch.randn(D_MODEL, D_MODEL)
    gemm_s = []
    for _ in range(5):
        start = time.thread_time()
        torch.mm(a, w)
        gemm_s.append(time.thread_time() - start)
    gflops = 2 * tokens * D_MODEL * D_MODEL / min(gemm_s) / 1e9
    d_model, value_dim, query_dim = memory.d_model, memory.value_dim, memory.heads * memory.key_dim
    flop = 2 * tokens * (d_model * query_dim + d_model * value_dim + value_dim * d_model  # projections
                         + memory.heads * memory.n_keys * memory.key_dim  # sub-key scores: 2 halves of key_dim / 2
                         + value_dim * d_model)  # the output projection's input gradient
    step_rows = min(args.rows, rows)
    table_bytes = (reads + 7 * step_rows) * dim * values.element_size()
    ms = 1e3 * (flop / (gflops * 1e9) + table_bytes / (gbs * 1e9))
    return dict(ms=ms, gflop=flop / 1e9, gflops=gflops, mb=table_bytes / 1e6, gbs=gbs, cols=cols)


# ----------------------------------------------------------------------------------------------- the model
def build_model_step(args: argparse.Namespace, bf16: bool):
    """(model, StepSetup, StepSettings) of the model run: Qwen-2.5-0.5B-shaped (or the tiny preset's with
    ``--model-tiny``) with memories of ``--model-slots`` at the paper's layers (the tiny preset's), mode
    additive+s, trained as ``smf train``'s sparse recipe trains it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench_train_step import LR, QWEN25_05B, StepSettings, StepSetup
    from smf.model import attach_memories, configure_trainable
    from smf.model.precision import cast_like_the_authors
    from smf.train.steps import MemoryUpdateStep, bf16_autocast
    from smf_kernels.sparse import BackgroundStats, RowSparseAdamW, SparseMemoryController

    torch.manual_seed(0)
    if args.model_tiny:
        from smf.tiny import tiny_config
        from smf.vocabulary import TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS

        model, layers, sizes = Qwen2ForCausalLM(tiny_config()), TINY_MEMORY_LAYERS, dict(TINY_MEMORY_KWARGS)
    else:
        fields = dict(QWEN25_05B)
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
        model, layers, sizes = Qwen2ForCausalLM(Qwen2Config(**fields)), PAPER_LAYERS, dict(LAYER_KWARGS)
    sizes["n_keys"] = math.isqrt(args.model_slots)
    attach_memories(model, list(layers), "additive+s", alpha_init=0.01, backend=args.backend,
                    dtype=torch.bfloat16 if bf16 else None, **sizes)  # bf16: no fp32 copy of the tables
    configure_trainable(model, "sparse")
    if bf16:
        cast_like_the_authors(model)  # every parameter in bf16 (the memories already are), alpha included
    model.train()
    settings = StepSettings(recipe="sparse", bf16="off")
    controller = SparseMemoryController(model, rule=args.rule, rows_per_step=args.rows)
    background = BackgroundStats.for_memories(controller.memories)
    generator = torch.Generator().manual_seed(0)
    for name, module in controller.memories.items():
        for _ in range(4):
            background.add_batch(name, torch.randint(0, 3, (module.num_slots,), generator=generator))
    controller.set_background(background)
    step = MemoryUpdateStep(controller, bf16_autocast(settings.bf16, torch.device("cpu")))
    optimizer = RowSparseAdamW([p for p in model.parameters() if p.requires_grad], lr=LR["sparse"])
    return model, StepSetup(model, optimizer, step), settings


def measure_model(args: argparse.Namespace, bf16: bool) -> dict:
    """Two SMF steps of the model run (one micro-batch of ``--model-tokens`` random tokens each); their times, the
    peak RSS of the build and of the steps (run in its own process)."""
    from bench_train_step import cosine_schedule, micro_batches, train_step

    dtype = "bf16" if bf16 else "fp32"
    start = time.perf_counter()
    model, setup, settings = build_model_step(args, bf16)
    build_peak = rss_gib()  # the base model is made in fp32 and cast: a bf16 build peaks above its final size
    gc.collect()
    steps_alone = reset_peak_rss()
    logger.info("[model %s] built in %.1f s (peak RSS %.2f GiB); stepping ...", dtype, time.perf_counter() - start,
                build_peak)
    scheduler = cosine_schedule(setup.optimizer, warmup_steps=0, total_steps=4)
    times = []
    for seed in range(2):
        batches = micro_batches(model.config.vocab_size, 1, 1, args.model_tokens, torch.device("cpu"), seed=seed)
        tokens = sum(int(b["attention_mask"].sum()) for b in batches)
        begin = time.perf_counter()
        train_step(model, setup, scheduler, batches, tokens, settings, torch.device("cpu"))
        times.append(time.perf_counter() - begin)
        logger.info("[model %s] step %d: %.1f s, peak RSS %.2f GiB", dtype, seed + 1, times[-1], rss_gib())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return dict(dtype=dtype, slots=args.model_slots, tiny=args.model_tiny, tokens=args.model_tokens,
                first_step_s=times[0], step_s=times[1], build_peak_rss_gib=build_peak,
                steps_peak_rss_gib=rss_gib() if steps_alone else max(build_peak, rss_gib()),
                rss_target_gib=MODEL_RSS_MAX_GIB[dtype], cpu_s=usage.ru_utime + usage.ru_stime,
                wall_s=time.perf_counter() - start)


# ------------------------------------------------------------------------------------------------ processes
def run_child(job: list[str], args: argparse.Namespace, label: str) -> dict:
    """Run ``job`` (child arguments) in a fresh process with ``--threads`` torch threads; a progress line every
    10 s while it runs; its result, or ``{"failed": why}`` when it exited with an error (killed for memory, say)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        threads = str(args.threads)
        env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        command = [sys.executable, os.path.abspath(__file__), *job, "--child-out", out, *common_options(args)]
        start = time.perf_counter()
        proc = subprocess.Popen(command, env=env)
        while True:
            try:
                proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                logger.info("  ... %s still running (%.0f s)", label, time.perf_counter() - start)
        if proc.returncode != 0:
            why = "killed (out of memory?)" if proc.returncode == -9 else f"exit status {proc.returncode}"
            logger.error("%s failed: %s", label, why)
            return {"failed": why}
        with open(out) as handle:
            return json.load(handle)


def common_options(args: argparse.Namespace) -> list[str]:
    """The options a child process takes from the parent's command line."""
    options = ["--tokens", str(args.tokens), "--rows", str(args.rows), "--rule", args.rule,
               "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--pairs", str(args.pairs),
               "--threads", str(args.threads), "--model-slots", str(args.model_slots),
               "--model-tokens", str(args.model_tokens)]
    if args.backend:
        options += ["--backend", args.backend]
    if args.model_tiny:
        options.append("--model-tiny")
    if args.huge_pages is not None:
        options.append("--huge-pages" if args.huge_pages else "--no-huge-pages")
    return options


def machine() -> str:
    """The CPU's model name, torch threads per process and the load averages now."""
    name = "CPU"
    try:
        with open("/proc/cpuinfo") as handle:
            name = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), name)
    except OSError:
        pass
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    return f"{name} ({os.cpu_count()} CPUs), load {load}"


# ------------------------------------------------------------------------------------------------- the table
def verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def targets(results: list[dict]) -> list[dict]:
    """The issue's targets at the largest size measured (its ratio against the smallest); none when no size ran."""
    results = [r for r in results if "failed" not in r]
    if not results:
        return []
    big = max(results, key=lambda r: r["slots"])
    step = big["phases_ms"]["step"]
    table = big["held_bytes"]["layer"] + big["held_bytes"]["background"]
    budget = table + STATE_SLACK * big["touched_bytes"]
    steady = big["phases_ms"]["optimizer"]
    base = min(r["slots"] for r in results)
    rows = [dict(target=f"step at {big['slots']:,} <= {STEP_RATIO_MAX}x {base:,} (interleaved, thread CPU time)",
                 measured=f"{big['cpu_ratio_to_base']:.2f}x (wall {big['ratio_to_base']:.2f}x)",
                 ok=big["cpu_ratio_to_base"] <= STEP_RATIO_MAX)
            ] if big["slots"] != base else []  # one size: no ratio
    reachable = floor_ratio(big, next(r for r in results if r["slots"] == base))
    if reachable is not None:
        rows.append(dict(target=f"the floor allows <= {STEP_RATIO_MAX}x (best ratio: {base:,}'s step + the floor's "
                                f"extra work at {big['slots']:,})",
                         measured=f"{reachable:.2f}x", ok=reachable <= STEP_RATIO_MAX))
    rows += [dict(target=f"selection <= {SELECTION_SHARE_MAX:.0%} of the step at {big['slots']:,}",
                  measured=f"{big['phases_ms']['selection'] / step:.1%}",
                  ok=big["phases_ms"]["selection"] <= SELECTION_SHARE_MAX * step),
             dict(target=f"held at {big['slots']:,} <= table + {STATE_SLACK} x touched ({budget / MIB:,.1f} MiB)",
                  measured=f"{big['held_total_bytes'] / MIB:,.1f} MiB", ok=big["held_total_bytes"] <= budget),
             dict(target=f"first optimizer phase at {big['slots']:,} <= {FIRST_OPTIMIZER_MAX}x steady "
                         f"({FIRST_OPTIMIZER_MAX * steady:,.1f} ms)",
                  measured=f"{big['first_optimizer_ms']:,.1f} ms",
                  ok=big["first_optimizer_ms"] <= FIRST_OPTIMIZER_MAX * steady)]
    for row in rows:
        row["verdict"] = verdict(row["ok"])
    return rows


def floor_ratio(result: dict, base: dict | None = None) -> float | None:
    """The best step ratio the floor allows a size against the pairs' base: (the base's step CPU time in the pairs
    + this size's floor - the base's floor) / the base's step CPU time; None without floors or pairs. Both floors
    take the fastest sgemm rate measured in the run, and the base's the fastest read of its table (its floor in this
    process, ``base_floor``, and in its own, ``base``'s): a rate measured slow under load would otherwise make the
    base's floor the larger one."""
    if not result.get("floor") or not result.get("base_floor"):
        return None
    base_floors = [result["base_floor"]] + ([base["floor"]] if base and base.get("floor") else [])
    gflops = max(floor["gflops"] for floor in (result["floor"], *base_floors))

    def floor_ms(floor: dict, gbs: float) -> float:  # GFLOP / (GFLOP/s) in ms, plus MB / (GB/s), which is ms
        return 1e3 * floor["gflop"] / gflops + floor["mb"] / gbs

    extra = (floor_ms(result["floor"], result["floor"]["gbs"])
             - floor_ms(result["base_floor"], max(floor["gbs"] for floor in base_floors)))
    return (result["base_cpu_step_ms"] + extra) / result["base_cpu_step_ms"]


def format_table(results: list[dict]) -> str:
    """Markdown: a row per size, then the targets."""
    lines = ["| slots | " + " | ".join(f"{p} ms" for p in PHASES) + " | step CPU ms | floor ms (GFLOP at GFLOP/s "
             "+ MB of rows at GB/s) | step / smallest, CPU (wall), pairs | first step ms "
             "| first optimizer ms | held MiB (layer + background + optimizer + sinks) | peak RSS GiB "
             "| checkpoint MiB | patch | CPU s / wall s |",
             "|---:|" + "---:|" * len(PHASES) + "---:|---|---:|---:|---:|---|---:|---:|---|---:|"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['slots']:,} | failed: {r['failed']} |" + " - |" * (len(PHASES) + 9))
            continue
        floor = r.get("floor")
        floor_text = (f"{floor['ms']:,.1f} ({floor['gflop']:.2f} at {floor['gflops']:.1f} + {floor['mb']:,.0f} at "
                      f"{floor['gbs']:.2f})" if floor else "n/a (no probe)")
        held = r["held_bytes"]
        parts = " + ".join(f"{held[part] / MIB:,.1f}" for part in ("layer", "background", "optimizer", "sinks"))
        patch = f"{r['patch_bytes'] / MIB:,.2f} MiB ({r['patch_note']})"
        pairs = (f"{r['cpu_ratio_to_base']:.2f}x ({r['ratio_to_base']:.2f}x), {len(r['pair_ratios'])}"
                 if r["pair_ratios"] else "1.00x")
        lines.append(f"| {r['slots']:,} | " + " | ".join(f"{r['phases_ms'][p]:,.1f}" for p in PHASES)
                     + f" | {r['cpu_phases_ms']['step']:,.1f} | {floor_text} | {pairs} "
                     f"| {r['first_step_ms']:,.1f} | {r['first_optimizer_ms']:,.1f} "
                     f"| {r['held_total_bytes'] / MIB:,.1f} = {parts} | {r['peak_rss_gib']:.2f} "
                     f"| {r['checkpoint_bytes'] / MIB:,.1f} | {patch} | {r['cpu_s']:.0f} / {r['wall_s']:.0f} |")
    checks = targets(results)
    if checks:
        lines += ["", "| target | measured | verdict |", "|---|---:|---|"]
        lines += [f"| {t['target']} | {t['measured']} | {t['verdict']} |" for t in checks]
    return "\n".join(lines)


def format_model_table(runs: list[dict]) -> str:
    lines = ["| model run | slots per memory | tokens | first step s | step s | peak RSS GiB: build / steps "
             "| target GiB (steps) | verdict |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in runs:
        if "failed" in r:
            lines.append(f"| {r['dtype']} | failed: {r['failed']} | - | - | - | - | - | - |")
            continue
        name = ("tiny" if r["tiny"] else "Qwen-2.5-0.5B-shaped") + f" {r['dtype']}"
        lines.append(f"| {name} | {r['slots']:,} | {r['tokens']} | {r['first_step_s']:.1f} | {r['step_s']:.1f} "
                     f"| {r['build_peak_rss_gib']:.2f} / {r['steps_peak_rss_gib']:.2f} | <= {r['rss_target_gib']:.0f} "
                     f"| {verdict(r['steps_peak_rss_gib'] <= r['rss_target_gib'])} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- main
def slot_counts(text: str) -> list[int]:
    """``--sizes``: comma-separated slot counts, each a square of an n_keys >= 16 (top-16)."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated slot counts, got {text!r}") from None
    for size in sizes:
        if size < 256 or math.isqrt(size) ** 2 != size:
            raise argparse.ArgumentTypeError(f"each size must be n_keys ** 2 with n_keys >= 16 (top-16), got {size}")
    return sorted(set(sizes))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", type=slot_counts, default=[16384, 262144, 1048576],
                   help="slot counts (n_keys ** 2), comma-separated; ratios are against the smallest")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per step (one micro-batch)")
    p.add_argument("--rows", type=int, default=512, help="T, rows selected per step (passed explicitly)")
    p.add_argument("--rule", default="tfidf", choices=("tfidf", "kl"), help="the selection's scoring rule")
    p.add_argument("--backend", default=None, choices=BACKENDS, help="kernel backend; None picks automatically")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the first")
    p.add_argument("--repeats", type=int, default=5, help="timed steps (medians are reported)")
    p.add_argument("--pairs", type=int, default=5, help="interleaved pairs per size (the median ratio is reported)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each measuring process")
    p.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=None,
                   help="the layers' value tables on transparent huge pages (ProductKeyMemory(huge_pages=True)) or "
                        "not (--no-huge-pages); neither: the layer's default, huge pages for tables of at least "
                        "512 MiB")
    p.add_argument("--model", action="store_true", help="also step the 0.5B-shaped model with large memories")
    p.add_argument("--bf16", action="store_true", help="the model run in bf16 weights too")
    p.add_argument("--model-slots", type=int, default=1048576, help="slots of each of the model's memories")
    p.add_argument("--model-tokens", type=int, default=512, help="tokens of the model run's step")
    p.add_argument("--model-tiny", action="store_true", help="the tiny preset's model instead of 0.5B (a test)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--child", choices=("layer", "model-fp32", "model-bf16"), help=argparse.SUPPRESS)
    p.add_argument("--slots", type=int, help=argparse.SUPPRESS)
    p.add_argument("--base", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("tokens", "rows", "repeats", "pairs", "threads", "model_tokens", "warmup"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            p.error(f"argument --{name.replace('_', '-')}: must be >= {0 if name == 'warmup' else 1}, got "
                    f"{getattr(args, name)}")
    if args.model_slots < 256 or math.isqrt(args.model_slots) ** 2 != args.model_slots:
        p.error(f"argument --model-slots: must be n_keys ** 2 with n_keys >= 16, got {args.model_slots}")
    folder = os.path.dirname(os.path.abspath(args.json)) if args.json else None
    if args.json and (os.path.isdir(args.json) or not os.path.isdir(folder) or not os.access(folder, os.W_OK)):
        p.error(f"argument --json: cannot write {args.json!r} (a folder, or in a folder that is missing or not "
                "writable); checked before any size runs")
    return args


def child_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    if args.child == "layer":
        result = measure_layer(args.slots, args.base, args)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_train_step
        result = measure_model(args, bf16=args.child == "model-bf16")
    with open(args.child_out, "w") as handle:
        json.dump(result, handle)
    return 0


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    where = machine()
    logger.info("%s; %d size(s), one process each, %d torch thread(s)", where, len(args.sizes), args.threads)
    results, base = [], args.sizes[0]
    for slots in args.sizes:
        r = run_child(["--child", "layer", "--slots", str(slots), "--base", str(base)], args, f"{slots:,} slots")
        results.append(dict(r, slots=slots))
        if "failed" in r:
            continue
        logger.info("%s slots: step %.1f ms (selection %.1f, optimizer %.1f), %.2fx the smallest, held %.1f MiB, "
                    "peak RSS %.2f GiB, first step %.1f ms (optimizer %.1f), %.0f CPU s / %.0f s", f"{slots:,}",
                    r["phases_ms"]["step"], r["phases_ms"]["selection"], r["phases_ms"]["optimizer"],
                    r["ratio_to_base"], r["held_total_bytes"] / MIB, r["peak_rss_gib"], r["first_step_ms"],
                    r["first_optimizer_ms"], r["cpu_s"], r["wall_s"])
    models = []
    if args.model:
        for dtype in ("fp32", "bf16") if args.bf16 else ("fp32",):
            models.append(dict(run_child(["--child", f"model-{dtype}"], args, f"model run {dtype}"), dtype=dtype))
    backends = sorted({r["backend"] for r in results if "backend" in r})
    print(f"one SMF step of ProductKeyMemory({D_MODEL}, heads 4, top-16, key_dim 256): {args.tokens} tokens, "
          f"T = {args.rows}, RowSparseAdamW, rule {args.rule}, backend {', '.join(backends) or '-'}, "
          f"{args.threads} torch thread(s), medians of {args.repeats}; {where}\n")
    print(format_table(results))
    huge = [f"{r['slots']:,}" for r in results if r.get("huge_pages")]
    print(f"\nvalue tables on transparent huge pages (THP {transparent_huge_pages()}): {', '.join(huge) or 'none'}"
          + (" (the layers' default: tables of at least 512 MiB)" if args.huge_pages is None else ""))
    if models:
        print()
        print(format_model_table(models))
    if args.json:
        payload = dict(machine=where, args={k: v for k, v in vars(args).items() if not k.startswith("child")},
                       results=results, targets=targets(results), model=models)
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)
    return 1 if any("failed" in r for r in results + models) else 0


if __name__ == "__main__":
    sys.exit(main())
