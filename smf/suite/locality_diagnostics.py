"""``locality.md`` / ``.json``: how local each sparse run's update was, and whether the old facts whose reads fell on
the rows it rewrote are the ones it forgot (issue 39, the update-locality experiment; docs/science.md).

For every sparse run of a suite (before: its retrofit's memories; after: its final model), per memory layer and over
all layers together:

- **rows changed**: the fraction of value rows that differ in any element after the run;
- **median growth**: the median over the changed rows of ||v_after - v_before|| / ||v_before||;
- **read share**: for each old-fact question (the ``eval_retain`` prompts, as the evaluation asks them), the share of
  its read weight that falls on changed rows: the memory's softmax read weights of every prompt token and head in the
  *retrofit* model (what the old facts relied on), summed over the changed rows, over their sum over all rows (over
  all layers: the sums of every layer). The table gives the mean over the questions; the **answer read share** is the
  same over each question's last token alone (the position whose next token is the answer);
- **by quartile**: the questions split into four equal groups by their read share (lowest first), each with the
  range of its shares, the retrofit's old-fact accuracy on them, the run's (its ``eval/{run}/retain.jsonl``,
  recomputed when missing) and kept: of the questions the retrofit answered, the fraction the run still answers.

- **read overlap** (issue 48, a property of the retrofit and the world, the same for every run of that retrofit): the
  share of the old questions' read weight that falls on slots the *new* questions (the ``eval_learn`` prompts, as the
  evaluation asks them) also read, in the retrofit model: over all tokens (slots any token of any new question reads),
  and at the answer position (each old question's last token, against the slots the new questions' last tokens
  read); mean over the old questions, per layer and over all layers (:func:`read_overlap`). Near 1, the new facts can
  only be taught on rows the old ones read: row-disjoint locality cannot be tested on that world.

Cost: one forward of each retrofit model over the old and the new questions (shared by the runs of that retrofit) and a
load of
each run's final model. Measurements are cached in the JSON by run name and results hash, so re-drawing a report
recomputes nothing. Full finetuning and LoRA runs have no rows and are left out.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import statistics
from collections.abc import Iterator
from pathlib import Path

import torch

from smf.data.eval_sets import triviaqa_prompt
from smf.data.own_data import as_triviaqa_rows, load_own
from smf.eval.common import model_device, pad_batch, pad_token_id
from smf.eval.triviaqa import evaluate_triviaqa
from smf.model.attach import memory_blocks
from smf.model.loading import load_model
from smf.report.paper_results import display_name, metric_title
from smf.suite.config import seed_config
from smf.suite.plan import Run, SuiteLayout, sparse_stage_dirs, start_name
from smf.train.distributed import pick_device

logger = logging.getLogger(__name__)

LOCALITY_JSON, LOCALITY_MD = "locality.json", "locality.md"
CACHE_VERSION = 3  # bumped when a run's measurements gain or change a field: older caches are measured again
QUARTILES = 4
OVERLAPS = ("read_overlap", "answer_read_overlap")  # the keys of read_overlap()'s shares


@dataclasses.dataclass(frozen=True)
class Reads:
    """Read weights of one memory layer over a set of questions: flat over every (question, token, head, k) read,
    ``question`` (E,) int64 the question each read belongs to, ``slot`` (E,) int64 the row read, ``weight`` (E,)
    float64 its softmax weight, ``last`` (E,) bool whether it is a read of the question's last token (whose next
    token is the answer); ``questions`` the number of questions."""

    question: torch.Tensor
    slot: torch.Tensor
    weight: torch.Tensor
    last: torch.Tensor
    questions: int


def changed_rows(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """(M,) bool: the rows of value tables ``before`` / ``after`` (M, D) that differ in any element."""
    if before.shape != after.shape:
        raise ValueError(f"before and after must have the same shape, got {tuple(before.shape)} and "
                         f"{tuple(after.shape)}")
    return (before != after).any(dim=-1)


def row_growth(before: torch.Tensor, after: torch.Tensor, changed: torch.Tensor) -> torch.Tensor:
    """(changed rows,) float64 ||after - before|| / ||before|| of the rows where ``changed`` (M,) bool."""
    before, after = before[changed].double(), after[changed].double()
    return (after - before).norm(dim=-1) / before.norm(dim=-1)


def weight_on(reads: Reads, changed: torch.Tensor, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight on the ``changed`` (M,) bool rows, all weight), each (questions,) float64 summed per question over
    every read, or with ``last_only`` over the reads of each question's last token."""
    weight = reads.weight * reads.last.double() if last_only else reads.weight
    on = torch.bincount(reads.question, weights=weight * changed[reads.slot].double(), minlength=reads.questions)
    return on, torch.bincount(reads.question, weights=weight, minlength=reads.questions)


def read_overlap(old: dict[int, Reads], new: dict[int, Reads], slots: dict[int, int]) -> dict:
    """The read overlap of the module docstring: per layer (``old`` / ``new``: the reads of the old and the new
    questions, ``slots``: the layer's slot count) and over all layers (the sums of every layer's weight on shared
    slots over their total), ``{"layers": {layer: {"read_overlap", "answer_read_overlap"}}, "overall": {same}}``, the
    layers keyed by their index as a string; each a mean over the old questions of the share of their read weight (all
    tokens; last token) on the slots any new question reads (any token; last token)."""
    if set(old) != set(new) or set(old) != set(slots):
        raise ValueError(f"old, new and slots must cover the same layers, got {sorted(old)}, {sorted(new)} and "
                         f"{sorted(slots)}")
    layers, sums = {}, {"all": [0, 0], "answer": [0, 0]}
    for layer in sorted(old):
        read_by_new = torch.zeros(slots[layer], dtype=torch.bool)
        read_by_new[new[layer].slot] = True
        at_answer = torch.zeros(slots[layer], dtype=torch.bool)
        at_answer[new[layer].slot[new[layer].last]] = True
        shares = {}
        for key, shared, last_only in (("all", read_by_new, False), ("answer", at_answer, True)):
            on, total = weight_on(old[layer], shared, last_only)
            shares[key] = float((on / total).mean())
            sums[key] = [sums[key][0] + on, sums[key][1] + total]
        layers[str(layer)] = {"read_overlap": shares["all"], "answer_read_overlap": shares["answer"]}
    return {"layers": layers, "overall": {"read_overlap": float((sums["all"][0] / sums["all"][1]).mean()),
                                          "answer_read_overlap": float((sums["answer"][0] / sums["answer"][1]).mean())}}


def _median(values: torch.Tensor) -> float | None:
    """The median of ``values`` (1-D; the mean of the middle two for an even count), None when empty."""
    return None if values.numel() == 0 else statistics.median(values.tolist())


def quartile_rows(share: torch.Tensor, correct_before: list[bool], correct_after: list[bool]) -> list[dict]:
    """The questions in :data:`QUARTILES` groups of (nearly) equal size by ``share`` (questions,) (lowest first;
    ties in question order): per group its share range, size, accuracy before and after, and kept (of the questions
    answered before, the fraction answered after; None if none was)."""
    if not len(correct_before) == len(correct_after) == share.numel():
        raise ValueError(f"share, correct_before and correct_after must have one entry per question, got "
                         f"{share.numel()}, {len(correct_before)} and {len(correct_after)}")
    order = sorted(range(share.numel()), key=lambda q: (float(share[q]), q))
    rows = []
    for group in torch.tensor_split(torch.tensor(order, dtype=torch.int64), QUARTILES):
        members = group.tolist()
        known = [q for q in members if correct_before[q]]
        rows.append({"share_low": float(share[group].min()) if members else None,
                     "share_high": float(share[group].max()) if members else None, "questions": len(members),
                     "acc_before": statistics.fmean(correct_before[q] for q in members) if members else None,
                     "acc_after": statistics.fmean(correct_after[q] for q in members) if members else None,
                     "kept": statistics.fmean(correct_after[q] for q in known) if known else None})
    return rows


def run_locality(before: dict[int, torch.Tensor], after: dict[int, torch.Tensor], reads: dict[int, Reads],
                 correct_before: list[bool], correct_after: list[bool]) -> dict:
    """The measurements of the module docstring for one run: ``before`` / ``after`` the value table (M, D) of each
    memory layer (by layer index) in the retrofit and after the run, ``reads`` the retrofit's reads of the old
    questions per layer, ``correct_before`` / ``correct_after`` per question. Returns ``{"layers": {layer: {slots,
    rows_changed, rows_changed_fraction, median_growth, read_share, answer_read_share}}, "overall": {same},
    "quartiles": [...]}`` (``answer_read_share``: the read share of the questions' last tokens alone), the layers
    keyed by their index as a string (as JSON keeps them)."""
    if set(before) != set(after) or set(before) != set(reads):
        raise ValueError(f"before, after and reads must cover the same layers, got {sorted(before)}, "
                         f"{sorted(after)} and {sorted(reads)}")
    layers, growths, on_all, total_all, last_on_all, last_total_all = {}, [], 0, 0, 0, 0
    for layer in sorted(before):
        changed = changed_rows(before[layer], after[layer])
        growth = row_growth(before[layer], after[layer], changed)
        on, total = weight_on(reads[layer], changed)
        last_on, last_total = weight_on(reads[layer], changed, last_only=True)
        layers[str(layer)] = {"slots": changed.numel(), "rows_changed": int(changed.sum()),
                              "rows_changed_fraction": float(changed.double().mean()),
                              "median_growth": _median(growth), "read_share": float((on / total).mean()),
                              "answer_read_share": float((last_on / last_total).mean())}
        growths.append(growth)
        on_all, total_all = on_all + on, total_all + total
        last_on_all, last_total_all = last_on_all + last_on, last_total_all + last_total
    slots = sum(entry["slots"] for entry in layers.values())
    changed_total = sum(entry["rows_changed"] for entry in layers.values())
    share = on_all / total_all
    return {"layers": layers,
            "overall": {"slots": slots, "rows_changed": changed_total, "rows_changed_fraction": changed_total / slots,
                        "median_growth": _median(torch.cat(growths)), "read_share": float(share.mean()),
                        "answer_read_share": float((last_on_all / last_total_all).mean())},
            "quartiles": quartile_rows(share, correct_before, correct_after)}


@contextlib.contextmanager
def _kept_reads(blocks) -> Iterator[dict[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """While active, each memory's lookup also appends its (scores, slot ids), each (N, heads, topk), to the yielded
    lists (by layer index)."""
    kept: dict[int, list] = {block.layer_index: [] for block in blocks}

    def keeping(layer: int, lookup):
        def lookup_and_keep(x: torch.Tensor, backend: str | None = None):  # ProductKeyMemory.lookup's signature
            scores, indices = lookup(x, backend)
            kept[layer].append((scores, indices))
            return scores, indices
        return lookup_and_keep

    for block in blocks:
        block.memory.lookup = keeping(block.layer_index, block.memory.lookup)  # shadows the method
    try:
        yield kept
    finally:
        for block in blocks:
            del block.memory.lookup


@torch.no_grad()
def question_reads(model, tokenizer, prompts: list[str], batch_size: int = 64) -> dict[int, Reads]:
    """The reads of every memory layer of ``model`` (with its ``tokenizer``) over ``prompts``, each tokenized as the
    evaluation does; batches right-padded, padding left out."""
    blocks = memory_blocks(model)
    device = model_device(model)
    parts: dict[int, list[tuple]] = {block.layer_index: [] for block in blocks}
    for start in range(0, len(prompts), batch_size):
        encoded = [tokenizer(prompt)["input_ids"] for prompt in prompts[start:start + batch_size]]
        input_ids, mask = pad_batch(encoded, pad_token_id(tokenizer), left=False)
        with _kept_reads(blocks) as kept:
            model(input_ids=input_ids.to(device), attention_mask=mask.to(device))
        valid = mask.bool().reshape(-1)
        questions = torch.arange(start, start + len(encoded)).repeat_interleave(mask.shape[1])[valid]
        lengths = torch.tensor([len(ids) for ids in encoded])
        last = (torch.arange(mask.shape[1]) == (lengths - 1).unsqueeze(1)).reshape(-1)[valid]
        for layer, ((scores, indices),) in kept.items():
            weights = torch.softmax(scores.double(), dim=-1).cpu()[valid].reshape(len(questions), -1)
            slots = indices.cpu()[valid].reshape(len(questions), -1)
            per_token = slots.shape[1]
            parts[layer].append((questions.repeat_interleave(per_token), slots.reshape(-1), weights.reshape(-1),
                                 last.repeat_interleave(per_token)))
    return {layer: Reads(*(torch.cat([part[i] for part in layer_parts]) for i in range(4)), questions=len(prompts))
            for layer, layer_parts in parts.items()}


def _values(model) -> dict[int, torch.Tensor]:
    return {block.layer_index: block.memory.values.detach().cpu().clone() for block in memory_blocks(model)}


def _correct(model, tokenizer, config, rows: list[dict], path: Path) -> list[bool]:
    """Per old question, whether ``model`` answers it: ``path`` (a ``retain.jsonl`` the evaluation wrote), or
    evaluated into it when missing."""
    if not path.is_file():
        evaluate_triviaqa(model, tokenizer, as_triviaqa_rows(rows), limit=None,
                          batch_size=config.eval.triviaqa_batch_size,
                          max_new_tokens=config.eval.triviaqa_max_new_tokens, output_path=path,
                          protocol=config.protocol)
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(records) != len(rows):
        raise ValueError(f"{path} holds {len(records)} answers for {len(rows)} old questions; delete it to recompute")
    return [bool(record["correct"]) for record in records]


def new_question_prompts(config) -> list[str]:
    """The new questions (``eval_learn``, a qa file) as the evaluation asks them; none for an mc file."""
    rows, schema = load_own(config.data.eval_learn, "data.eval_learn", ("qa", "mc"))
    return [triviaqa_prompt(row, config.protocol) for row in rows] if schema == "qa" else []


def retrofit_read_overlap(model, tokenizer, old_reads: dict[int, Reads], new_prompts: list[str]) -> dict | None:
    """:func:`read_overlap` of ``model`` (a retrofit) between ``old_reads`` and its reads of ``new_prompts``; None
    without new questions."""
    if not new_prompts:
        return None
    slots = {block.layer_index: block.memory.values.shape[0] for block in memory_blocks(model)}
    return read_overlap(old_reads, question_reads(model, tokenizer, new_prompts), slots)


class _Retrofits:
    """The retrofit models' values, reads, answers and read overlap, measured on first use and kept for the runs
    that share them."""

    def __init__(self, config, root: Path, device) -> None:
        self.config, self.root, self.device = config, root, device
        self.rows, _ = load_own(config.data.eval_retain, "data.eval_retain", ("qa",))
        self.prompts = [triviaqa_prompt(row, config.protocol) for row in self.rows]
        self.new_prompts = new_question_prompts(config) if config.data.eval_learn else []
        self.measured: dict[Path, tuple] = {}

    def __call__(self, retrofit_dir: Path, name: str | None = None) -> tuple[dict, dict, list[bool], dict | None]:
        """(values by layer, reads by layer, correct per question, read overlap) of the retrofit in ``retrofit_dir``
        (its answers filed under ``name``, by default the directory's: :func:`smf.suite.plan.start_name`)."""
        if retrofit_dir not in self.measured:
            model, tokenizer = load_model(self.config.model, retrofit_dir, self.device)
            reads = question_reads(model, tokenizer, self.prompts)
            self.measured[retrofit_dir] = (
                _values(model), reads,
                _correct(model, tokenizer, self.config, self.rows,
                         self.root / "eval-retrofit" / (name or retrofit_dir.name) / "retain.jsonl"),
                retrofit_read_overlap(model, tokenizer, reads, self.new_prompts))
        return self.measured[retrofit_dir]


def compute_locality(config, results: list[dict], root: Path) -> dict:
    """:func:`run_locality` of every sparse run in ``results`` (the suite's runs), by run name, reusing cached ones."""
    layout, device = SuiteLayout(root), pick_device(config.device)
    path = root / LOCALITY_JSON
    saved = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    cache = saved.get("runs", {}) if saved.get("version") == CACHE_VERSION else {}
    retrofits: dict = {}  # per world (per seed with base_per_seed)
    measured = {}
    for result in results:
        if result.get("sparse_steps") is None:
            continue
        run = Run.of_results(result)  # its epochs too (a schedule_sweep's run directory)
        cached = cache.get(run.name)
        if cached and cached.get("hash") == result["config_hash"]:
            measured[run.name] = cached
            continue
        own = seed_config(config, run.seed)
        if own.data not in retrofits:
            retrofits[own.data] = _Retrofits(own, root, device)
        before, reads, correct_before, overlap = retrofits[own.data](sparse_stage_dirs(layout, run, own)[0],
                                                                     start_name(run, own))
        model, tokenizer = load_model(own.model, layout.train_dir(run), device)
        correct_after = _correct(model, tokenizer, own, retrofits[own.data].rows, layout.eval_dir(run) / "retain.jsonl")
        measured[run.name] = {"hash": result["config_hash"], "condition": run.condition, "variant": run.variant,
                              "update": run.update, "reads": run.reads or "all", "lr": run.lr, "seed": run.seed,
                              "metrics": result["metrics"], "read_overlap": overlap,
                              **run_locality(before, _values(model), reads, correct_before, correct_after)}
        del model
    path.write_text(json.dumps({"version": CACHE_VERSION, "runs": measured}, indent=1) + "\n", encoding="utf-8")
    return measured


def _mean(values, digits: int = 3, scale: float = 1.0) -> str:
    values = [v for v in values if v is not None]
    return "—" if not values else f"{scale * statistics.fmean(values):.{digits}f}"


def write_locality(config, results: list[dict], root: Path) -> list[Path]:
    """Compute (or reuse) the locality diagnostics and write ``locality.md`` / ``.json`` into ``root``."""
    measured = compute_locality(config, results, root)
    groups: dict[tuple, list[dict]] = {}
    for entry in measured.values():
        groups.setdefault((entry["condition"], entry["variant"], entry["update"], entry["reads"], entry["lr"]),
                          []).append(entry)
    conditions = {condition: index for index, condition in enumerate(config.conditions)}
    variants = {name: index for index, name in enumerate(config.variants)}
    order = sorted(groups, key=lambda key: (conditions.get(key[0], 99), variants.get(key[1], -1), key[2], key[3],
                                            key[4] or 0))

    def method(key) -> str:
        condition, variant, update, reads, _ = key
        return (display_name(condition, config.model, variant) + (" (authors' update)" if update == "authors" else "")
                + ("" if reads == "all" else f" ({reads} reads)"))

    learn, retain = (metric_title(m, config.labels) for m in ("learn_acc", "retain_acc"))
    quartiles = " | ".join(f"Q{q + 1} retrofit → after (kept)" for q in range(QUARTILES))
    lines = ["# Update locality: which rows the sparse runs rewrote, and which old facts they forgot\n",
             "Per sparse run, over every memory layer: **rows changed**, the fraction of value rows that differ after "
             "the run; **growth**, the median of ||v_after - v_before|| / ||v_before|| over the changed rows; **read "
             "share**, per old-fact question, the share of the retrofit model's read weight (softmax weights of every "
             "prompt token and head) that falls on changed rows, averaged over the questions; **answer read share** "
             "the same over each question's last token alone (the position that predicts the answer); **read "
             "overlap**, a property of the retrofit and the world: the share of the old questions' read weight on "
             "slots the new questions also read (all tokens; answer: last tokens against the new questions' last "
             "tokens), near 1 when no row is the new facts' alone. Then the old-fact "
             "questions in quartiles of their read share (Q1 lowest): old-fact accuracy of the retrofit and after the "
             "run, and kept (of the questions the retrofit answered, the fraction still answered). Means over seeds "
             "(smf/suite/locality_diagnostics.py).\n",
             f"| Method | LR | Seeds | {learn} | {retain} | Rows changed | Growth | Read share | Answer read share | "
             f"Read overlap | Answer read overlap | {quartiles} |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
             + " | ".join("---:" for _ in range(QUARTILES)) + " |"]
    for key in order:
        entries = groups[key]
        cells = [_mean(e["metrics"].get("learn_acc") for e in entries),
                 _mean(e["metrics"].get("retain_acc") for e in entries),
                 _mean((e["overall"]["rows_changed_fraction"] for e in entries), 3),
                 _mean((e["overall"]["median_growth"] for e in entries), 3),
                 _mean((e["overall"]["read_share"] for e in entries), 3),
                 _mean((e["overall"]["answer_read_share"] for e in entries), 3),
                 *(_mean(e["read_overlap"]["overall"][share] if e["read_overlap"] else None for e in entries)
                   for share in OVERLAPS)]
        cells += [f"{_mean(e['quartiles'][q]['acc_before'] for e in entries)} → "
                  f"{_mean(e['quartiles'][q]['acc_after'] for e in entries)} "
                  f"({_mean(e['quartiles'][q]['kept'] for e in entries)})" for q in range(QUARTILES)]
        rate = "—" if key[4] is None else f"{key[4]:g}"
        lines.append(f"| {method(key)} | {rate} | {len(entries)} | " + " | ".join(cells) + " |")
    lines += ["\n## Per memory layer\n",
              "| Method | LR | Layer | Slots | Rows changed | Growth | Read share | Answer read share | Read overlap | "
              "Answer read overlap |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key in order:
        entries = groups[key]
        for layer in entries[0]["layers"]:
            per_layer = [e["layers"][layer] for e in entries]
            rate = "—" if key[4] is None else f"{key[4]:g}"
            lines.append(f"| {method(key)} | {rate} | {layer} | {per_layer[0]['slots']} | "
                         f"{_mean(p['rows_changed_fraction'] for p in per_layer)} | "
                         f"{_mean(p['median_growth'] for p in per_layer)} | {_mean(p['read_share'] for p in per_layer)} "
                         f"| {_mean(p['answer_read_share'] for p in per_layer)} | " + " | ".join(
                             _mean(e["read_overlap"]["layers"][layer][share] if e["read_overlap"] else None
                                   for e in entries) for share in OVERLAPS) + " |")
    md_path = root / LOCALITY_MD
    md_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [md_path, root / LOCALITY_JSON]
