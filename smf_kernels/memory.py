"""ProductKeyMemory: the product-key memory layer of docs/method.md#the-memory-layer as an nn.Module."""
from __future__ import annotations

import math

import torch
from torch import nn

from smf_kernels._precision import no_autocast
from smf_kernels.backends import construction_error, resolve_backend
from smf_kernels.huge_pages import HUGE_PAGES_MIN_BYTES, empty_on_huge_pages, transparent_huge_pages
from smf_kernels.ops import GradientSink, KeyLayoutCache, product_key_topk, weighted_gather
from smf_kernels.projection import MemoryProjection

PROJECTIONS = ("query_map", "gate_map", "out_map")  # the memory's MemoryProjection submodules
# Their names until 2026-11-26 (nn.Linear modules then, named like the decoder's own projections, which the usual
# LoRA target lists match): checkpoints holding them load (ProductKeyMemory._load_from_state_dict).
LEGACY_PROJECTIONS = dict(zip(("query_proj", "gate_proj", "out_proj"), PROJECTIONS, strict=True))


def rename_legacy_projections(state_dict: dict, prefix: str = "") -> dict:
    """``state_dict`` with a memory's tensors saved under the projections' former names (``{prefix}gate_proj.weight``
    ...) moved, in place, to the current ones (``{prefix}gate_map.weight``), where those are absent. Returns it."""
    for old, new in LEGACY_PROJECTIONS.items():
        for tensor in ("weight", "bias"):
            key = f"{prefix}{old}.{tensor}"
            if key in state_dict and f"{prefix}{new}.{tensor}" not in state_dict:
                state_dict[f"{prefix}{new}.{tensor}"] = state_dict.pop(key)
    return state_dict


_DRAW_ELEMENTS = 1 << 22  # values drawn per block by draw_normal_rows (16 MiB of fp32)


def draw_normal_rows(rows: int, width: int, std: float, device: torch.device | str, write,
                     dtype: torch.dtype = torch.float32) -> None:
    """Draw a (rows, width) table of normal values (mean 0, ``std``) in ``dtype`` a block of rows at a time, handing
    each block to ``write(start, stop, block)`` (``block``: rows ``[start, stop)``, (stop - start, width), reused
    for the next block). On CPU the blocks hold exactly what one ``normal_`` over the whole table draws, and the
    generator ends in the same state: torch's CPU normal_ fills 16 values per step from the stream in order, so
    blocks whose sizes are multiples of 16 values (the last one at least 16) draw the same."""
    step = max(16, _DRAW_ELEMENTS // width // 16 * 16)  # rows per block: rows * width is a multiple of 16
    block = torch.empty(min(step, rows), width, dtype=dtype, device=device)
    start = 0
    while start < rows:
        stop = min(rows, start + step)
        if 0 < (rows - stop) * width < 16:  # a last block under 16 values would be drawn differently
            stop = rows
            block = torch.empty(stop - start, width, dtype=dtype, device=device)
        drawn = block[: stop - start]
        nn.init.normal_(drawn, std=std)
        write(start, stop, drawn)
        start = stop


class ProductKeyMemory(nn.Module):
    """Product-key memory layer (Lample et al. 2019; Berges et al. 2024).

    ``mem(x) = out_map(r * silu(gate_map(x)))`` with ``r`` the softmax-weighted
    sum of the ``heads * topk`` value rows found by a product-key lookup of ``query_map(x)``.
    The three projections are :class:`~smf_kernels.projection.MemoryProjection` modules: named and typed so
    that the usual LoRA target lists and ``"all-linear"`` do not match them (docs/hf.md#lora-on-top-of-memories).

    Args:
        d_model: input and output width.
        n_keys: sub-keys per half; the memory has ``n_keys ** 2`` slots.
        heads: independent query heads.
        topk: slots read per head per token.
        key_dim: query / key width (even; split into two halves).
        value_dim: width of a value row (default ``d_model``).
        backend: kernel backend for the ops (None = automatic, see
            :mod:`smf_kernels.backends`).
        dtype: the parameters' dtype (None: torch's default). They are initialised in float32 and cast, the value
            table on CPU a block of rows at a time (never held in float32 whole). So a memory built in ``dtype``
            equals, bit for bit, one built in float32 from the same seed and cast to ``dtype`` afterwards, and
            leaves the generator in the same state.
        huge_pages: hold the value table (on CPU) in memory advised for transparent huge pages before it is first
            written (:mod:`smf_kernels.huge_pages`): the gather's random row reads miss the TLB far less, and their
            page walks read 2 MB pages' small tables instead of 4 KB pages' (1/512 of the table: 7 MiB at 1M
            slots). None (the default): for tables of at least :data:`HUGE_PAGES_MIN_BYTES` (512 MiB, where those
            4 KB page tables outgrow a core's L2), on CPU. The cost is at construction: the kernel compacts memory
            for each 2 MB page (8.5 s of system time instead of 1.3 for a 3.5 GiB table on the project's VM). The
            same values bit for bit; ``load_state_dict`` copies into the table (it stays), a copy (``.to(dtype)``,
            ``deepcopy``) is an ordinary tensor.

    Read counting: after :meth:`set_read_counting` (True), every forward adds the
    reads of its valid tokens to the ``read_counts`` buffer ``(n_keys**2,)``
    int64; :meth:`reset_read_counts` zeroes it. Value gradients go to ``values.grad``
    (dense), or, after :meth:`set_grad_sink`, into a gradient sink instead (what the sparse
    update does: :class:`~smf_kernels.sparse.RowGradSink`).
    """

    def __init__(
        self,
        d_model: int,
        n_keys: int = 128,
        heads: int = 4,
        topk: int = 16,
        key_dim: int = 256,
        value_dim: int | None = None,
        *,
        backend: str | None = None,
        dtype: torch.dtype | None = None,
        huge_pages: bool | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("n_keys", n_keys), ("heads", heads), ("topk", topk),
                            ("key_dim", key_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if key_dim % 2:
            raise ValueError(f"key_dim must be even (it is split into two halves), got {key_dim}")
        if topk > n_keys:
            raise ValueError(f"topk must be <= n_keys, got topk={topk}, n_keys={n_keys}")
        error = construction_error(backend)
        if error is not None:
            raise ValueError(f"backend: {error}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
        if huge_pages is not None and not isinstance(huge_pages, bool):
            raise ValueError(f"huge_pages must be a bool or None, got {huge_pages!r}")
        if huge_pages and torch.empty(0).device.type != "cpu":
            raise ValueError(f"huge_pages needs a CPU table, but the default device is {torch.empty(0).device}")
        value_dim = d_model if value_dim is None else value_dim
        if isinstance(value_dim, bool) or not isinstance(value_dim, int) or value_dim < 1:
            raise ValueError(f"value_dim must be a positive int or None, got {value_dim!r}")
        if huge_pages is None:
            table_bytes = n_keys * n_keys * value_dim * torch.empty(0, dtype=dtype).element_size()
            huge_pages = (table_bytes >= HUGE_PAGES_MIN_BYTES and torch.empty(0).device.type == "cpu"
                          and transparent_huge_pages() in ("always", "madvise"))
        self.d_model, self.n_keys, self.heads, self.topk = d_model, n_keys, heads, topk
        self.key_dim, self.value_dim, self.num_slots = key_dim, value_dim, n_keys * n_keys
        self.backend, self.huge_pages = backend, huge_pages

        self.query_map = MemoryProjection(d_model, heads * key_dim)
        self.keys = nn.Parameter(torch.empty(heads, 2, n_keys, key_dim // 2))
        self.values = nn.Parameter(self._empty_values() if dtype is None else self._empty_table(dtype))
        self.gate_map = MemoryProjection(d_model, value_dim)
        self.out_map = MemoryProjection(value_dim, d_model)
        self.register_buffer("read_counts", torch.zeros(self.num_slots, dtype=torch.int64), persistent=False)
        self.count_reads = False
        self.grad_sink: GradientSink | None = None
        # The backend's layout of ``keys`` for the top-k, made once and again when the keys change (an optimizer
        # step, load_state_dict, .to()): see smf_kernels.ops.KeyLayoutCache. Not state: never saved.
        self.key_layouts = KeyLayoutCache()
        self.reset_parameters()
        if dtype is not None:
            self.to(dtype)  # the small parameters, drawn in float32; the value table is already in dtype

    def config(self) -> dict:
        """Constructor arguments (without backend), e.g. for saving alongside weights."""
        return {"d_model": self.d_model, "n_keys": self.n_keys, "heads": self.heads, "topk": self.topk,
                "key_dim": self.key_dim, "value_dim": self.value_dim}

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise as docs/method.md#the-memory-layer."""
        nn.init.xavier_uniform_(self.query_map.weight)
        nn.init.zeros_(self.query_map.bias)
        bound = 1.0 / math.sqrt(self.key_dim)
        nn.init.uniform_(self.keys, -bound, bound)
        self._init_values()
        for proj in (self.gate_map, self.out_map):
            nn.init.normal_(proj.weight, std=self.d_model ** -0.5)
            nn.init.zeros_(proj.bias)

    def _empty_values(self) -> torch.Tensor:
        """The uninitialised value table this module holds, (num_slots, value_dim); a subclass may hold part of
        it (:class:`smf_kernels.sharded.ShardedProductKeyMemory`: some columns)."""
        return self._empty_table(torch.get_default_dtype())

    def _empty_table(self, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised (num_slots, value_dim) table of ``dtype``, on huge pages if :attr:`huge_pages`."""
        if self.huge_pages:
            return empty_on_huge_pages((self.num_slots, self.value_dim), dtype)
        return torch.empty(self.num_slots, self.value_dim, dtype=dtype)

    def _init_values(self) -> None:
        """Draw ``values`` as docs/method.md#the-memory-layer says (normal, std ``value_dim ** -0.5``). A table of
        another dtype than float32 is drawn in float32 and cast: on CPU a block of rows at a time
        (:func:`draw_normal_rows`, no float32 copy of the table held), elsewhere whole; either way the float32
        table's draws, cast."""
        std = self.value_dim ** -0.5
        values = self.values
        if values.dtype == torch.float32 or values.device.type == "meta":
            nn.init.normal_(values, std=std)
        elif values.device.type == "cpu":
            draw_normal_rows(self.num_slots, self.value_dim, std, values.device,
                             lambda start, stop, block: values[start:stop].copy_(block))
        else:
            values.copy_(torch.empty(values.shape, dtype=torch.float32, device=values.device).normal_(std=std))

    def set_read_counting(self, enabled: bool) -> None:
        """Turn read counting on or off for later forwards.

        While on, every forward adds 1 to ``read_counts[slot]`` for each (token, head, k) read of
        a valid token (``valid_mask`` True, or every token without a mask), in the same pass as
        the gather. Counts accumulate across forwards until :meth:`reset_read_counts`. A forward
        re-run by activation checkpointing would count its tokens again.
        """
        self.count_reads = bool(enabled)

    def reset_read_counts(self) -> None:
        """Zero the ``read_counts`` buffer (n_keys**2,) int64 in place (it keeps its device)."""
        self.read_counts.zero_()

    def set_grad_sink(self, sink: GradientSink | None) -> None:
        """Where the backwards of later forwards put the value gradient: a :class:`~smf_kernels.ops.GradientSink`
        that takes it instead of ``values.grad`` (:class:`~smf_kernels.sparse.RowGradSink`, what the sparse
        update sets), or None for a dense ``values.grad``."""
        if not (sink is None or isinstance(sink, GradientSink)):
            raise TypeError(f"sink must be a GradientSink or None, got {type(sink).__name__}")
        self.grad_sink = sink

    def lookup(self, x: torch.Tensor, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores (N, heads, topk) fp32 and slot ids (N, heads, topk) for x (N, d_model); ``backend``: the one
        :meth:`forward` resolved, or None to resolve :attr:`backend` here.

        Runs in the parameters' precision even under autocast: which slots a token reads must
        not depend on it (background statistics and training would disagree on the slots).
        """
        with no_autocast(x.device):
            query = self.query_map(x).view(x.shape[0], self.heads, self.key_dim)
            return product_key_topk(query.to(self.keys.dtype), self.keys, self.topk,
                                    backend=self.backend if backend is None else backend, key_layouts=self.key_layouts)

    def resolved_backend(self, device: torch.device) -> str:
        """The backend this memory's ops run on ``device``: :attr:`backend`, or the automatic choice
        (:func:`smf_kernels.backends.resolve_backend`) for its keys' and values' dtypes; resolved once per
        forward and handed to both ops."""
        return resolve_backend(self.backend, device, torch.promote_types(self.keys.dtype, self.values.dtype))

    def forward(self, x: torch.Tensor, valid_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: (..., d_model) -> (..., d_model).

        valid_mask: optional bool tensor of shape x.shape[:-1]; tokens where it is
        False (padding) are computed but not added to ``read_counts``.
        """
        if not x.is_floating_point():  # token ids passed by mistake would otherwise be cast to floats
            raise TypeError(f"x must be a floating-point tensor (..., d_model={self.d_model}) of hidden states, got "
                            f"dtype {str(x.dtype).replace('torch.', '')}")
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (..., d_model={self.d_model}), got {tuple(x.shape)}")
        if valid_mask is not None and valid_mask.shape != x.shape[:-1]:
            raise ValueError(
                f"valid_mask must have shape x.shape[:-1] = {tuple(x.shape[:-1])}, got {tuple(valid_mask.shape)}"
            )
        flat = x.reshape(-1, self.d_model)
        backend = self.resolved_backend(flat.device)
        scores, indices = self.lookup(flat, backend)
        weights = torch.softmax(scores, dim=-1)  # the scores' precision: fp32, or fp64 for an fp64 memory
        num_tokens, per_token = flat.shape[0], self.heads * self.topk
        gate = self.gate_map(flat)
        gated_read = self._read_values(indices.view(num_tokens, per_token), weights.view(num_tokens, per_token),
                                       None if valid_mask is None else valid_mask.reshape(-1).bool(), gate, backend)
        out = self.out_map(gated_read)
        return out.view(*x.shape[:-1], self.d_model)

    def _read_values(self, indices: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor | None,
                     gate: torch.Tensor, backend: str) -> torch.Tensor:
        """silu(gate) * r (N, value_dim) in gate's dtype: r is each token's weighted sum of the value rows it reads
        (indices, weights (N, L); valid (N,) bool or None; gate (N, value_dim)), counting reads and routing the
        value gradient as set, in the gather's op calls on ``backend`` (resolved by :meth:`forward`). A subclass may
        read the rows elsewhere (:class:`smf_kernels.sharded.ShardedProductKeyMemory`: from several ranks)."""
        counting = self.count_reads
        return weighted_gather(
            self.values, indices, weights,
            counts=self.read_counts if counting else None,
            valid=valid if counting else None,
            grad_sink=self.grad_sink,
            gate=gate,
            backend=backend,
        )

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Also accepts the projections under their former names (``query_proj`` ...: :data:`LEGACY_PROJECTIONS`),
        renamed in ``state_dict`` itself, where the projections' own loads look next."""
        rename_legacy_projections(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_keys={self.n_keys} (slots={self.num_slots}), heads={self.heads}, "
                f"topk={self.topk}, key_dim={self.key_dim}, value_dim={self.value_dim}")


def memories_of(model: nn.Module) -> dict[str, "ProductKeyMemory"]:
    """The :class:`ProductKeyMemory` modules of ``model`` by module path; ValueError when it holds none, with a hint
    when it holds the plain PyTorch memories of a saved model's own code (loaded where smf was not importable)."""
    memories = {name: module for name, module in model.named_modules() if isinstance(module, ProductKeyMemory)}
    if memories:
        return memories
    plain = sorted({type(module).__name__ for module in model.modules()
                    if type(module).__name__.endswith("ProductKeyMemory")})
    hint = (f": it holds {', '.join(plain)} from the code saved beside its weights, which is used where smf cannot be "
            "imported (or where that code is older than smf's memories); install smf-kernels[experiments] in this "
            "environment and load the model again with smf.model.from_pretrained") if plain else ""
    raise ValueError(f"model holds no ProductKeyMemory module (smf_kernels'){hint}")
