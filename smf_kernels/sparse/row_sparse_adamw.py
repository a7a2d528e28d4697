"""Row-sparse ("lazy") AdamW: only the rows a step updates move (docs/method.md#what-sparse-means).

A step updates the rows R of a table from a compact (T, D) gradient of those rows
(:meth:`RowSparseAdamW.step_rows`, what the sparse update calls), with AdamW run on each row's own sequence of
updates (the update :func:`smf_kernels.ops.row_adamw_` makes; per-row step counts and decoupled weight decay). Rows outside R keep their values, moments and step
count bit-identical: no momentum or weight decay leaks into them, as embedding libraries do for sparse tables.

State of a row-updated (M, D) parameter, in one of two forms that give the same bits:

* ``state="compact"`` (the default): moments and step counts only for the rows ever updated, by slot
  (:mod:`smf_kernels.sparse.compact_row_state`: the K rows with state ``held_rows`` (K,) ascending and their
  ``held_slots`` (K,), ``slot_step`` (C,), ``exp_avg`` / ``exp_avg_sq`` (C, D) with C at most 6.25% or 32 slots
  above K). A 512-row step of a 1M-row table holds 512 rows of state, not 1M.
* ``state="dense"``: ``exp_avg`` and ``exp_avg_sq`` (M, D) allocated on the first step (zeros) and ``row_step``
  an (M,) int64 per-row step count. A column-sharded table (:mod:`smf_kernels.sharded`) or a DTensor (FSDP2)
  keeps this form whatever ``state`` says: their checkpoints split the state tensors of the table's shape.

:meth:`RowSparseAdamW.row_state` gives any row's dense-equivalent state in either form, :meth:`touched_rows` the
rows with state; ``load_state_dict`` takes either form and converts it to the optimizer's. Parameters with dense
gradients (e.g. a trainable scale) get exactly torch.optim.AdamW's single-tensor update. Hyper-parameters are read
from ``param_groups`` every step, so LR schedulers work unchanged.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from smf_kernels._checks import check_ascending, check_index_range, check_scalar, check_tensor
from smf_kernels.ops.row_adamw import check_hyper_parameters, row_adamw_
from smf_kernels.sharded.placement import placement_of
from smf_kernels.sparse import compact_row_state as compact

STATE_FORMS = ("compact", "dense")


class RowSparseAdamW(torch.optim.Optimizer):
    """AdamW that updates only the rows a step updates (see module docstring).

    Args:
        params: parameters or param groups, as for torch.optim.AdamW. Parameters updated by rows
            (:meth:`step_rows`) must be 2-D (M, D).
        lr, betas, eps, weight_decay: as torch.optim.AdamW (same defaults).
        state: "compact" (state only for the rows updated) or "dense" (state for every row): see the module
            docstring.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, state: str = "compact") -> None:
        check_hyper_parameters(lr, betas[0], betas[1], eps, weight_decay)
        if state not in STATE_FORMS:
            raise ValueError(f"state must be one of {STATE_FORMS}, got {state!r}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.state_form = state

    def __getstate__(self) -> dict:  # pickling and copy.deepcopy keep the form
        return {**super().__getstate__(), "state_form": self.state_form}

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim.Optimizer.load_state_dict, after checking that every parameter's saved state has one of
        the layouts for that parameter (ValueError naming the parameter and the entry otherwise; nothing loaded).
        A table's state loads into the form this optimizer keeps for it (a dense state saved before the compact
        form existed becomes compact, bit for bit)."""
        self._check_state(state_dict)
        indices = [index for group in state_dict["param_groups"] for index in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        converted = {}
        for index, param in zip(indices, params):
            saved = state_dict["state"].get(index)
            if saved and ("row_step" in saved or compact.is_compact(saved)):
                converted[index] = self._in_form(param, saved)
        super().load_state_dict({**state_dict, "state": {**state_dict["state"], **converted}})
        # The base class casts every state tensor to a floating parameter's dtype, and an integer that went
        # through bf16 would round (bf16 holds integers exactly only up to 256): restore the originals, the
        # moments cast as the base class casts them (a state saved from an fp32 table loads into a bf16 one).
        for index, param in zip(indices, params):
            if index in converted:
                self.state[param] = {key: _on_param(value, param) for key, value in converted[index].items()}

    def _in_form(self, param: torch.Tensor, saved: dict) -> dict:
        """A table's saved row state in the form this optimizer keeps for ``param``."""
        if self._compact(param) == compact.is_compact(saved):
            return dict(saved)
        if compact.is_compact(saved):
            return compact.dense_from_compact(saved, param.shape[0])
        return compact.compact_from_dense(saved["row_step"], saved["exp_avg"], saved["exp_avg_sq"])

    def _compact(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s row state is held in the compact form (see the module docstring)."""
        return self.state_form == "compact" and placement_of(param).whole_rows

    def _check_state(self, state_dict: dict) -> None:
        """Each saved parameter state: ``row_step`` (M,) >= 0 with ``exp_avg`` and ``exp_avg_sq`` (M, D) (row
        updates, dense form), the compact form of row updates (:func:`compact_row_state.check_compact_state`), or
        ``step`` >= 0 with both moments of the parameter's shape (dense updates); ``exp_avg_sq`` >= 0.
        Group and parameter counts are the base class's check (a mismatch there is left to it)."""
        saved_groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(saved_groups, list) or not isinstance(state_dict.get("state"), dict):
            raise ValueError("state_dict must be a dict with 'state' (a dict) and 'param_groups' (a list), as "
                             "state_dict() returns")
        for index, saved in enumerate(saved_groups):
            missing = [key for key in ("betas", "eps") if not isinstance(saved, dict) or key not in saved]
            if missing:
                raise ValueError(f"param group {index} of this state lacks {', '.join(missing)}: it was saved by "
                                 "another optimizer (RowSparseSGD?); resume with the optimizer that wrote it")
        if len(saved_groups) != len(self.param_groups) or any(
                len(saved.get("params", ())) != len(group["params"])
                for saved, group in zip(saved_groups, self.param_groups)):
            return
        for group_index, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            for position, (index, param) in enumerate(zip(saved["params"], group["params"])):
                state = state_dict["state"].get(index)
                if state:
                    self._check_param_state(state, param, f"parameter {position} of group {group_index} "
                                                          f"({tuple(param.shape)})")

    @staticmethod
    def _check_param_state(state: dict, param: torch.Tensor, where: str) -> None:
        if compact.is_compact(state):
            other = [key for key in ("row_step", "step") if key in state]
            if other:
                raise ValueError(f"RowSparseAdamW state of {where} holds both held_rows and {other[0]}")
            if param.dim() != 2:
                raise ValueError(f"RowSparseAdamW state of {where}: a compact row state needs a 2-D table")
            compact.check_compact_state(state, tuple(param.shape), where)
            return
        sparse = "row_step" in state
        expected = {"row_step": (param.shape[0],)} if sparse else {"step": ()}
        expected.update(exp_avg=tuple(param.shape), exp_avg_sq=tuple(param.shape))
        if sparse and "step" in state:
            raise ValueError(f"RowSparseAdamW state of {where} holds both row_step and step")
        for key, shape in expected.items():
            if key not in state:
                raise ValueError(f"RowSparseAdamW state of {where} lacks {key}")
            value = state[key]
            if key == "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = torch.tensor(value)
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"RowSparseAdamW state of {where}: {key} must be a tensor of shape {shape}, got "
                                 f"{type(value).__name__}")
            if tuple(value.shape) != shape:
                raise ValueError(f"RowSparseAdamW state of {where}: {key} has shape {tuple(value.shape)} but must "
                                 f"have {shape} for this parameter (state saved for another model?)")
            if key != "exp_avg" and bool((value < 0).any()):
                raise ValueError(f"RowSparseAdamW state of {where}: {key} holds negative values")

    def check_groups(self) -> None:
        """TypeError / ValueError naming the first param group and hyper-parameter not as the constructor takes
        it (``lr``, ``eps``, ``weight_decay`` finite and >= 0, ``betas`` two numbers in [0, 1)): a scheduler or a
        caller may have changed them since. A learning rate held in an accelerator's tensor is checked in the op."""
        for index, group in enumerate(self.param_groups):
            try:
                for name in ("lr", "eps", "weight_decay"):
                    check_scalar(name, group[name])
                betas = group["betas"]
                if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                    raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
                for beta in betas:
                    check_scalar("betas", beta)
                check_hyper_parameters(group["lr"], float(betas[0]), float(betas[1]), float(group["eps"]),
                                       float(group["weight_decay"]))
            except (TypeError, ValueError) as err:
                raise type(err)(f"RowSparseAdamW param group {index}: {err}") from None

    @torch.no_grad()
    def step(self, closure=None):
        """torch.optim.AdamW's update of every parameter with a dense ``.grad``; a table's rows go through
        :meth:`step_rows`. Every group's hyper-parameters (:meth:`check_groups`) and a sparse ``.grad`` are
        checked before any parameter moves."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.check_groups()
        if any(p.grad is not None and p.grad.is_sparse for group in self.param_groups for p in group["params"]):
            raise ValueError("RowSparseAdamW takes a table's rows through step_rows(), not a sparse .grad (sparse COO "
                             "gradients were removed: docs/method.md#what-sparse-means)")
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._dense_step(param, group)
        return loss

    @torch.no_grad()
    def step_rows(self, param: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, *,
                  grad_scale: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> None:
        """Row-sparse AdamW from a compact gradient: rows ``rows`` of ``param`` (one of this optimizer's
        parameters) and their state move, nothing else does.

        Args:
            param: an (M, D) parameter of this optimizer (its ``.grad`` is not read).
            rows: (T,) int64 strictly ascending row ids.
            grad: (T, D) float32 (float64 for a float64 table) gradient of those rows.
            grad_scale: optional 0-d tensor multiplying ``grad`` first (a clipping coefficient).
            valid: optional (T,) bool; rows with ``valid[t] == False`` are left alone.
        """
        group = self._group_of(param)
        self.check_groups()  # before a compact state grows for new rows
        state = self._row_state(param)
        hyper = dict(lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                     grad_scale=grad_scale, valid=valid)
        if not compact.is_compact(state):
            row_adamw_(param, state["exp_avg"], state["exp_avg_sq"], state["row_step"], rows, grad, **hyper)
            return
        # the rows are looked up in the index before the op sees them: checked here first
        check_tensor("rows", rows, ndim=1, dtypes=(torch.int64,), shape_doc="(T,)")
        check_index_range("rows", rows, param.shape[0])
        if valid is not None:
            check_tensor("valid", valid, ndim=1, dtypes=(torch.bool,), shape_doc="(T,)")
            if valid.shape != rows.shape:
                raise ValueError(f"valid must have shape (T,) = {tuple(rows.shape)}, got {tuple(valid.shape)}")
        check_ascending("rows", rows)
        slots, claim = compact.assign_slots(state, rows, valid, param.shape[0])
        row_adamw_(param, state["exp_avg"], state["exp_avg_sq"], state["slot_step"], rows, grad, **hyper,
                   state_slots=slots)
        compact.commit_slots(state, rows, slots, claim)

    def _group_of(self, param: torch.Tensor) -> dict:
        group = next((g for g in self.param_groups if any(p is param for p in g["params"])), None)
        if group is None:
            raise ValueError("param is not a parameter of this optimizer")
        return group

    def row_state(self, param: torch.Tensor, rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The dense-equivalent state of rows ``rows`` (R,) int64 in [0, M) of a table (every row when None),
        whatever form holds it: ``exp_avg`` and ``exp_avg_sq`` (R, D), ``row_step`` (R,) int64; zeros for a row
        never updated. New tensors (for tests and comparisons)."""
        self._group_of(param)
        state = self.state.get(param, {})
        if "step" in state:
            raise ValueError("this parameter is updated with dense gradients, not by rows")
        if rows is None:
            rows = torch.arange(param.shape[0], device=param.device)
        check_tensor("rows", rows, ndim=1, dtypes=(torch.int64,), shape_doc="(R,)")
        check_index_range("rows", rows, param.shape[0])
        if not state:
            return {"exp_avg": param.new_zeros(rows.numel(), param.shape[1]),
                    "exp_avg_sq": param.new_zeros(rows.numel(), param.shape[1]),
                    "row_step": torch.zeros(rows.numel(), dtype=torch.int64, device=param.device)}
        if compact.is_compact(state):
            return compact.dense_rows(state, rows)
        return {key: state[key].index_select(0, rows) for key in ("exp_avg", "exp_avg_sq", "row_step")}

    @torch.no_grad()
    def set_row_state(self, param: torch.Tensor, rows: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Write the dense-equivalent state of rows ``rows`` (R,) int64 strictly ascending of a table, in whatever
        form this optimizer keeps it (a row without state gets a slot): ``state`` as :meth:`row_state` returns it,
        ``exp_avg`` and ``exp_avg_sq`` (R, D) of the table's dtype, ``row_step`` (R,) int64 >= 0. What a knowledge
        patch's optimizer rows are put back with (:meth:`smf_kernels.patch.MemoryPatch.load_optimizer_rows`).
        Everything is checked before anything is written."""
        self._group_of(param)
        if "step" in self.state.get(param, {}):
            raise ValueError("this parameter is updated with dense gradients, not by rows")
        check_tensor("rows", rows, ndim=1, dtypes=(torch.int64,), shape_doc="(R,)")
        check_index_range("rows", rows, param.shape[0])
        check_ascending("rows", rows)
        expected = {"exp_avg": ((rows.numel(), param.shape[1]), param.dtype),
                    "exp_avg_sq": ((rows.numel(), param.shape[1]), param.dtype),
                    "row_step": ((rows.numel(),), torch.int64)}
        if set(state) != set(expected):
            raise ValueError(f"state must hold exactly {sorted(expected)}, got {sorted(state)}")
        for key, (shape, dtype) in expected.items():
            value = state[key]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or value.dtype != dtype:
                raise ValueError(f"state[{key!r}] must be a {dtype} tensor of shape {shape}, got "
                                 f"{getattr(value, 'dtype', type(value).__name__)} {tuple(getattr(value, 'shape', ()))}")
            if key != "exp_avg" and bool((value < 0).any()):
                raise ValueError(f"state[{key!r}] holds negative values")
        table_state = self._row_state(param)
        values = {key: value.to(param.device) for key, value in state.items()}
        if not compact.is_compact(table_state):
            for key, value in values.items():
                table_state[key].index_copy_(0, rows, value)
            return
        slots, claim = compact.assign_slots(table_state, rows, None, param.shape[0])
        for key, value in (("slot_step", values["row_step"]), ("exp_avg", values["exp_avg"]),
                           ("exp_avg_sq", values["exp_avg_sq"])):
            table_state[key].index_copy_(0, slots, value)
        compact.commit_slots(table_state, rows, slots, claim)

    def touched_rows(self, param: torch.Tensor) -> torch.Tensor:
        """(K,) int64 ascending: the rows of table ``param`` that have optimizer state (updated at least once;
        in the dense form, the rows with a step count above zero)."""
        self._group_of(param)
        state = self.state.get(param, {})
        if "step" in state:
            raise ValueError("this parameter is updated with dense gradients, not by rows")
        if not state:
            return torch.zeros(0, dtype=torch.int64, device=param.device)
        if compact.is_compact(state):
            return compact.rows_with_state(state)
        return (state["row_step"] > 0).nonzero().squeeze(1)

    def init_state(self, row_params: Iterable[torch.Tensor]) -> None:
        """Give each parameter of this optimizer that has no state the (zero) state its first update creates: for
        the tables in ``row_params``, an update by rows; for the others, a dense one. What
        ``torch.distributed.checkpoint`` needs before it loads a saved state (accelerate's FSDP2 resume):
        ``set_optimizer_state_dict`` fills an optimizer without state by a step with dense zero gradients (every
        table would become a dense-updated one, its ``step`` beside the saved ``row_step``), and a sharded load
        reads only the entries the optimizer's state already has (a DTensor table keeps the dense form, whose
        entries have the saved shapes; a plain table's compact state loads whole, through ``load_state_dict``)."""
        rows = {id(param) for param in row_params}
        params = [param for group in self.param_groups for param in group["params"]]
        if rows - {id(param) for param in params}:
            raise ValueError("row_params holds a tensor that is not a parameter of this optimizer")
        for param in params:  # checked before any state is made
            if id(param) in rows and (param.dim() != 2 or "step" in self.state.get(param, {})):
                raise ValueError(f"a table of row_params ({tuple(param.shape)}) must be 2-D and without a dense "
                                 "update's state")
            held = self.state.get(param, {})
            if id(param) not in rows and ("row_step" in held or compact.is_compact(held)):
                raise ValueError(f"parameter {tuple(param.shape)} holds a row update's state but is not in row_params")
        for param in params:
            (self._row_state if id(param) in rows else self._dense_state)(param)

    def _row_state(self, param: torch.Tensor) -> dict:
        if param.dim() != 2:
            raise ValueError(f"a parameter updated by rows must be 2-D (M, D), got shape {tuple(param.shape)}")
        state = self.state[param]
        if "step" in state:
            raise ValueError("this parameter was updated with dense gradients before; it cannot switch to rows")
        if not state and self._compact(param):
            state.update(compact.new_compact_state(param))
        elif not state:
            state["row_step"] = torch.zeros(param.shape[0], dtype=torch.int64, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _dense_state(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if "row_step" in state or compact.is_compact(state):
            raise ValueError("this parameter was updated by rows before; it cannot switch to dense")
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _dense_step(self, param: torch.Tensor, group: dict) -> None:
        """torch.optim.AdamW's single-tensor update, operation for operation."""
        state = self._dense_state(param)
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        grad, exp_avg, exp_avg_sq = param.grad, state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        step = float(state["step"])
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1 ** step)
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


def _on_param(value, param: torch.Tensor):
    """A loaded state entry on ``param``'s device; a floating one in ``param``'s dtype (as torch.optim casts it)."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(device=param.device, dtype=param.dtype if value.is_floating_point() else value.dtype)
