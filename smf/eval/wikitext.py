"""WikiText perplexity (docs/method.md#evaluation): sliding-window NLL over the concatenated test split.

The protocol's lines (:func:`smf.data.eval_sets.wikitext_lines`) are joined with ``"\\n\\n"`` and
tokenised once (without special tokens in the ``authors`` protocol, as their eval_tasks.py:127). Windows of ``window``
tokens start every ``stride`` tokens; the first window scores all of its tokens (except token 0,
which nothing predicts), each later window only the tokens after the previous window's end. So
every token after the first is predicted exactly once, with at least ``window - stride`` tokens
of context once the text is long enough (the recipe of the HF perplexity guide). ``clean``:
perplexity = exp(total NLL / tokens scored). ``authors``: each window's mean NLL weighted by
``end - previous end``, i.e. the first window's mean counts ``end`` times though it scores
``end - 1`` tokens (their eval_tasks.py:136-148); later windows are the same in both.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from smf.data.eval_sets import wikitext_lines
from smf.data.protocol import DEFAULT_PROTOCOL, Protocol, get_protocol
from smf.eval.common import batched, evaluating, model_device, pad_batch, pad_token_id, write_jsonl

logger = logging.getLogger(__name__)


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """The windows over a text of ``num_tokens`` tokens as (begin, end, first_target) triples.

    A window feeds tokens ``[begin, end)`` to the model and scores the tokens
    ``[first_target, end)``. Requires ``0 < stride < window`` (with ``stride == window`` the
    first token of each window would never be predicted) and ``num_tokens >= 2``.
    """
    for name, value in (("num_tokens", num_tokens), ("window", window), ("stride", stride)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if not 0 < stride < window:
        raise ValueError(f"need 0 < stride < window, got stride={stride}, window={window}")
    if num_tokens < 2:
        raise ValueError(f"num_tokens must be >= 2 (token 0 is never predicted), got {num_tokens}")
    windows, previous_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        windows.append((begin, end, max(previous_end, begin + 1)))
        previous_end = end
        if end == num_tokens:
            break
    return windows


def window_nll_sums(model: nn.Module, token_ids: torch.Tensor, windows: Sequence[tuple[int, int, int]],
                    pad_id: int) -> torch.Tensor:
    """Summed NLL (nats) of each window's scored tokens, the windows run as one right-padded batch.

    token_ids: (num_tokens,) int64. Returns (len(windows),) float64 on the CPU.
    """
    device = model_device(model)
    input_ids, attention_mask = pad_batch([token_ids[begin:end].tolist() for begin, end, _ in windows],
                                          pad_id, left=False)
    is_target = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, (begin, end, first_target) in enumerate(windows):
        is_target[row, first_target - begin:end - begin] = True
    input_ids, attention_mask, is_target = input_ids.to(device), attention_mask.to(device), is_target.to(device)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, L, V)
    predicts_target = is_target[:, 1:]
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1][predicts_target].float(), input_ids[:, 1:][predicts_target], reduction="none"
    )
    window_of_token = torch.arange(len(windows), device=device)[:, None].expand_as(predicts_target)[predicts_target]
    sums = torch.zeros(len(windows), dtype=torch.float64, device=device)
    return sums.index_add_(0, window_of_token, nll.double()).cpu()


def evaluate_wikitext(
    model: nn.Module,
    tokenizer,
    rows: Iterable[dict],
    *,
    window: int = 1024,
    stride: int = 512,
    windows_per_batch: int = 8,
    output_path: str | Path | None = None,
    protocol: str | Protocol = DEFAULT_PROTOCOL,
    name: str = "WikiText",
) -> float:
    """Perplexity of the protocol's lines of ``rows`` (WikiText schema; a list of dicts or a
    ``datasets.Dataset``), see the module docstring. ``name`` titles the progress bar and the log line (an
    own-data role: heldout).

    With ``output_path``, writes one JSON line per window: window, begin, end, scored (number
    of tokens scored), nll_sum.
    """
    protocol = get_protocol(protocol)
    texts = wikitext_lines(rows, protocol)
    if not texts:
        raise ValueError("rows must hold at least one {'text': ...} row (non-empty in the authors' protocol)")
    text = "\n\n".join(texts)
    # verbose=False: the whole text is longer than the model's maximum length on purpose (it is cut into windows
    # below), so the tokenizer's warning about it would be noise
    token_ids = torch.as_tensor(tokenizer(text, add_special_tokens=protocol.wikitext_special_tokens,
                                          verbose=False)["input_ids"], dtype=torch.int64)
    windows = sliding_windows(len(token_ids), window, stride)
    pad_id = pad_token_id(tokenizer)
    nll_sums = []
    with evaluating(model):
        for batch in tqdm(list(batched(windows, windows_per_batch)), desc=name, unit="batch"):
            nll_sums.append(window_nll_sums(model, token_ids, batch, pad_id))
    nll_sums = torch.cat(nll_sums)
    scored = sum(end - first_target for _, end, first_target in windows)  # == len(token_ids) - 1
    if protocol.wikitext_length_weighted_first_window:
        begin, end, first_target = windows[0]
        first_weight = end / (end - first_target)  # the authors' loss x target_len, target_len = end
        perplexity = math.exp((nll_sums.sum().item() + (first_weight - 1) * nll_sums[0].item()) / len(token_ids))
    else:
        perplexity = math.exp(nll_sums.sum().item() / scored)
    logger.info("%s perplexity %.4f over %d scored tokens in %d windows", name, perplexity, scored, len(windows))
    if output_path is not None:
        write_jsonl(output_path, ({"window": i, "begin": begin, "end": end, "scored": end - first_target,
                                   "nll_sum": nll_sum} for i, ((begin, end, first_target), nll_sum)
                                  in enumerate(zip(windows, nll_sums.tolist()))))
    return perplexity
