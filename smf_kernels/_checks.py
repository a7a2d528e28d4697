"""Argument validation shared by the public ops: clear errors, nothing clamped."""
from __future__ import annotations

import numbers

import torch

from smf_kernels._precision import accumulation_dtype

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, t: object, *, ndim: int, dtypes: tuple[torch.dtype, ...], shape_doc: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape_doc}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have shape {shape_doc} ({ndim} dims), got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")


def check_scalar(name: str, value: object) -> None:
    """TypeError / ValueError naming ``name`` unless ``value`` is a real number (not a bool) or a one-element
    floating tensor, as torch.optim takes hyper-parameters; their range is each optimizer's check."""
    expected = f"{name} must be a real number or a 0-d floating tensor"
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{expected}, got a tensor of dtype {str(value.dtype).replace('torch.', '')}")
        if value.numel() != 1:
            raise ValueError(f"{expected}, got a tensor of shape {tuple(value.shape)}")
        if value.device.type == "meta":
            raise ValueError(f"{expected} holding a value, got a meta tensor")
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{expected}, got {type(value).__name__}")
    else:
        try:
            float(value)
        except OverflowError:
            raise ValueError(f"{name} must be a finite number >= 0, got an int too large for a float") from None


def check_same_device(reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            raise ValueError(
                f"{name} is on {t.device} but {reference_name} is on {reference.device}; "
                "all tensors of an op must be on the same device"
            )


def check_index_range(name: str, indices: torch.Tensor, upper: int) -> None:
    """Every entry of ``indices`` must lie in [0, upper).

    On CPU this raises IndexError at once. On an accelerator it is a device-side
    assertion (torch._assert_async) so the forward never syncs with the host;
    a violation aborts the next synchronising call with the message below.
    Called inside the custom ops' bodies (:func:`check_gather_values`), which run as they are
    under torch.compile too, so a compiled model checks its indices as an eager one does.
    """
    if indices.numel() == 0:
        return
    if indices.device.type == "cpu":
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= upper:
            raise IndexError(f"{name} must lie in [0, {upper}), got values in [{low}, {high}]")
    else:
        ok = (indices.min() >= 0) & (indices.max() < upper)
        torch._assert_async(ok, f"{name} must lie in [0, {upper})")


def check_distinct(name: str, rows: torch.Tensor) -> None:
    """Entries of the 1-D tensor ``rows``, sorted ascending, must be pairwise distinct."""
    if rows.numel() < 2:
        return
    repeated = rows[1:] == rows[:-1]
    if rows.device.type == "cpu":
        if bool(repeated.any()):
            first = int(rows[1:][repeated][0])
            raise ValueError(f"{name} must hold distinct rows; row {first} appears more than once")
    else:
        torch._assert_async(~repeated.any(), f"{name} must hold distinct rows")


def check_non_negative(name: str, values: torch.Tensor) -> None:
    """Entries of ``values`` must be >= 0 (CPU: ValueError at once; an accelerator: a device-side assertion)."""
    negative = (values < 0).any()
    if values.device.type == "cpu":
        if bool(negative):
            raise ValueError(f"{name} must be non-negative, got {int(values.min())}")
    else:
        torch._assert_async(~negative, f"{name} must be non-negative")


def check_ascending(name: str, rows: torch.Tensor) -> None:
    """Entries of the 1-D tensor ``rows`` must be strictly ascending (sorted and distinct)."""
    if rows.numel() < 2:
        return
    out_of_order = rows[1:] <= rows[:-1]
    if rows.device.type == "cpu":
        if bool(out_of_order.any()):
            raise ValueError(f"{name} must be strictly ascending (sorted, distinct row ids)")
    else:
        torch._assert_async(~out_of_order.any(), f"{name} must be strictly ascending (sorted, distinct row ids)")


def check_topk_args(query: torch.Tensor, keys: torch.Tensor, topk: int) -> None:
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES, shape_doc="(N, heads, key_dim)")
    check_tensor("keys", keys, ndim=4, dtypes=FLOAT_DTYPES, shape_doc="(heads, 2, n_keys, key_dim // 2)")
    _, heads, key_dim = query.shape
    if key_dim % 2:
        raise ValueError(f"query's last dim (key_dim) must be even to split into two halves, got {key_dim}")
    expected = (heads, 2, keys.shape[2], key_dim // 2)
    if tuple(keys.shape) != expected:
        raise ValueError(
            f"keys must have shape (heads, 2, n_keys, key_dim // 2) = {expected} for query of shape "
            f"{tuple(query.shape)}, got {tuple(keys.shape)}"
        )
    if keys.dtype != query.dtype:
        raise TypeError(f"query and keys must share a dtype, got {query.dtype} and {keys.dtype}")
    check_same_device("query", query, keys=keys)
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise TypeError(f"topk must be an int, got {type(topk).__name__}")
    if not 1 <= topk <= keys.shape[2]:
        raise ValueError(f"topk must lie in [1, n_keys={keys.shape[2]}], got {topk}")


def check_gather_args(
    values: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    counts: torch.Tensor | None,
    valid: torch.Tensor | None,
    update_rows: torch.Tensor | None,
) -> None:
    """Types, shapes and devices of the gather's arguments (what torch.compile can check while tracing);
    their values are checked by :func:`check_gather_values` inside the op."""
    check_tensor("values", values, ndim=2, dtypes=FLOAT_DTYPES, shape_doc="(M, D)")
    check_tensor("indices", indices, ndim=2, dtypes=(torch.int64,), shape_doc="(N, L)")
    check_tensor("weights", weights, ndim=2, dtypes=FLOAT_DTYPES, shape_doc="(N, L)")
    if weights.shape != indices.shape:
        raise ValueError(
            f"weights must have the shape of indices (N, L) = {tuple(indices.shape)}, got {tuple(weights.shape)}"
        )
    num_rows, num_tokens = values.shape[0], indices.shape[0]
    if counts is not None:
        check_tensor("counts", counts, ndim=1, dtypes=(torch.int64,), shape_doc="(M,)")
        if counts.numel() != num_rows:
            raise ValueError(f"counts must have shape (M,) = ({num_rows},), got {tuple(counts.shape)}")
    if valid is not None:
        check_tensor("valid", valid, ndim=1, dtypes=(torch.bool,), shape_doc="(N,)")
        if valid.numel() != num_tokens:
            raise ValueError(f"valid must have shape (N,) = ({num_tokens},), got {tuple(valid.shape)}")
        if counts is None:
            raise ValueError("valid only selects which tokens are counted; pass counts too")
    if update_rows is not None:
        check_tensor("update_rows", update_rows, ndim=1, dtypes=(torch.int64,), shape_doc="(T,)")
    check_same_device("values", values, indices=indices, weights=weights, counts=counts, valid=valid,
                      update_rows=update_rows)


def check_gather_values(num_rows: int, indices: torch.Tensor | None = None,
                        update_rows: torch.Tensor | None = None) -> None:
    """indices (N, L) and update_rows (T,), sorted ascending, in [0, num_rows); update_rows distinct.

    Data-dependent, so it runs inside the custom ops' bodies: eagerly and in compiled graphs alike
    (torch.compile does not trace a custom op's body, it calls it).
    """
    if indices is not None:
        check_index_range("indices", indices, num_rows)
    if update_rows is not None:
        check_index_range("update_rows", update_rows, num_rows)
        check_distinct("update_rows", update_rows)


def check_row_gradient(param: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, grad_scale, valid) -> None:
    """The arguments of a row update (row AdamW, row SGD) besides the table and its state: ``rows`` (T,) int64,
    ``grad`` (T, D) in the table's accumulation dtype, ``valid`` None or (T,) bool, ``grad_scale`` None or a
    one-element tensor; ValueError / TypeError naming the first that is not."""
    check_tensor("rows", rows, ndim=1, dtypes=(torch.int64,), shape_doc="(T,)")
    dtype = accumulation_dtype(param.dtype)
    check_tensor("grad", grad, ndim=2, dtypes=(dtype,), shape_doc=f"(T, D) {str(dtype).replace('torch.', '')}")
    if grad.shape != (rows.shape[0], param.shape[1]):
        raise ValueError(f"grad must have shape (T, D) = {(rows.shape[0], param.shape[1])}, got {tuple(grad.shape)}")
    if valid is not None:
        check_tensor("valid", valid, ndim=1, dtypes=(torch.bool,), shape_doc="(T,)")
        if valid.shape != rows.shape:
            raise ValueError(f"valid must have shape (T,) = {tuple(rows.shape)}, got {tuple(valid.shape)}")
    if grad_scale is not None and (not isinstance(grad_scale, torch.Tensor) or grad_scale.numel() != 1):
        raise ValueError("grad_scale must be a one-element tensor or None")
