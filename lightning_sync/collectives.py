"""Rank-safe collectives: the one module of lightning_sync that talks to process groups.

Every function here:

* must be called by **every rank of the group**, in the same order, and blocks until all have;
* returns its input unchanged (or a one-element result) when ``torch.distributed`` is not
  initialised or the group has a single rank, so the same code runs in one process;
* first exchanges one small fixed-size metadata record (which function, dtype, shape, device,
  payload size) with every rank, and raises :class:`~lightning_sync.RankMismatchError` on every
  rank, naming each rank's value, when they disagree. Gloo would otherwise abort the process
  ("Received data size doesn't match expected size") or return zero-padded garbage;
* accepts ``group`` (default: the world) and works on gloo (CPU tensors) and NCCL (CPU inputs are
  moved to the current CUDA device for the exchange and the result is moved back).

``src``/``dst`` are global ranks, as in ``torch.distributed``.

Only ``torch.distributed`` is imported here, never Lightning.
"""

from __future__ import annotations

import math
import pickle
import secrets
import zlib
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sync.errors import CollectiveMismatchError, RankMismatchError, format_ranks

__all__ = [
    "all_gather_uneven",
    "all_gather_uneven_dict",
    "all_reduce",
    "broadcast_object",
    "broadcast_seed",
    "gather_objects",
    "gather_uneven",
    "is_distributed",
    "validate_seed",
    "MAX_SEED",
]

ReduceOpName = Literal["sum", "mean", "max", "min", "prod"]

#: Largest seed accepted (numpy and Lightning's ``seed_everything`` take uint32 seeds).
MAX_SEED = 2**32 - 1

_REDUCE_OPS = ("sum", "mean", "max", "min", "prod")
# Order matters: the index is the wire code. Append only.
_CALLS = ("all_reduce", "all_gather_uneven", "broadcast_object", "gather_objects", "broadcast_seed",
          "all_gather_uneven_dict", "gather_uneven")
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.uint16, torch.uint32,
    torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
)
_DEVICE_KINDS = ("cpu", "cuda")
_MAX_DIMS = 8
# Record layout (int64): magic, call, arg, dtype, device, ndim, dims[_MAX_DIMS], payload, aux.
_MAGIC = 0x4C53594E  # "LSYN"
_I_CALL, _I_ARG, _I_DTYPE, _I_DEVICE, _I_NDIM, _I_DIMS = 1, 2, 3, 4, 5, 6
_I_PAYLOAD = _I_DIMS + _MAX_DIMS
_I_AUX = _I_PAYLOAD + 1
_META_LEN = _I_AUX + 1
_NONE = -1
from lightning_sync._compat.torch_api import all_gather_single as _all_gather_single  # noqa: E402


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    """True when a process group is initialised and ``group`` has more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


# --------------------------------------------------------------------------------------------------
# metadata exchange


def _comm_device(group: dist.ProcessGroup | None, tensor: Tensor | None = None) -> torch.device:
    """The device a payload must live on for ``group``'s backend."""
    if tensor is not None and tensor.device.type == "cuda":
        return tensor.device
    backend = str(dist.get_backend(group)).lower()
    if "gloo" not in backend and "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dtype_code(dtype: torch.dtype) -> int:
    try:
        return _DTYPES.index(dtype)
    except ValueError:
        return 1000 + zlib.crc32(str(dtype).encode()) % 1000  # hash() of a str differs per process


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]).removeprefix("torch.") if 0 <= code < len(_DTYPES) else f"dtype#{code}"


def _device_code(device: torch.device) -> int:
    return _DEVICE_KINDS.index(device.type) if device.type in _DEVICE_KINDS else len(_DEVICE_KINDS)


def _device_name(code: int) -> str:
    return _DEVICE_KINDS[code] if 0 <= code < len(_DEVICE_KINDS) else "other"


def _record(call: str, *, arg: int = _NONE, tensor: Tensor | None = None, payload: int = _NONE,
            aux: int = _NONE) -> list[int]:
    rec = [_NONE] * _META_LEN
    rec[0] = _MAGIC
    rec[_I_CALL] = _CALLS.index(call)
    rec[_I_ARG] = arg
    rec[_I_PAYLOAD] = payload
    rec[_I_AUX] = aux
    if tensor is not None:
        rec[_I_DTYPE] = _dtype_code(tensor.dtype)
        rec[_I_DEVICE] = _device_code(tensor.device)
        rec[_I_NDIM] = tensor.ndim
        dims = list(tensor.shape)
        if len(dims) > _MAX_DIMS:  # fold the tail into one number so any difference still shows
            dims = dims[: _MAX_DIMS - 1] + [zlib.crc32(repr(dims[_MAX_DIMS - 1:]).encode())]
        rec[_I_DIMS:_I_DIMS + len(dims)] = dims
    return rec


#: Set by :mod:`lightning_sync.guard` while a collective guard is active: called with the collective's
#: name and group before its metadata exchange, so a rank that entered a different collective, or none,
#: is reported (with call sites) instead of hanging here. Shapes and arguments are still checked below,
#: with the more specific RankMismatchError.
_guard_hook: Any = None


def _exchange(record: list[int], group: dist.ProcessGroup | None, device: torch.device) -> list[list[int]]:
    """All-gather one fixed-size record per rank. Same size everywhere, so it can never abort gloo."""
    if _guard_hook is not None:
        _guard_hook(_CALLS[record[_I_CALL]], group)
    world = dist.get_world_size(group)
    mine = torch.tensor(record, dtype=torch.int64, device=device)
    out = torch.empty(world * _META_LEN, dtype=torch.int64, device=device)
    _all_gather_single(out, mine, group=group)
    return out.view(world, _META_LEN).tolist()


def _global_ranks(group: dist.ProcessGroup | None) -> list[int]:
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]


def _check_same_call(fn: str, records: list[list[int]], group: dist.ProcessGroup | None) -> list[int]:
    """Raise CollectiveMismatchError unless every rank entered ``fn``; return the global ranks."""
    ranks = _global_ranks(group)
    calls = [rec[_I_CALL] if rec[0] == _MAGIC else -1 for rec in records]
    if len(set(calls)) > 1:
        names = {r: (_CALLS[c] if 0 <= c < len(_CALLS) else "an unknown collective") for r, c in zip(ranks, calls)}
        raise CollectiveMismatchError(
            f"{fn}: ranks entered different collectives: {format_ranks(names)}. Every rank must call the same "
            "lightning_sync collectives in the same order; look for a collective inside a rank-dependent branch "
            "(`if rank == 0:`) or a loop whose length differs across ranks.",
            names,
        )
    return ranks


def _raise_if_differs(fn: str, what: str, values: dict[int, Any], fix: str) -> None:
    if len(set(values.values())) > 1:
        raise RankMismatchError(f"{fn}: {what} differs across ranks: {format_ranks(values)}. {fix}", values)


def _shape_of(rec: list[int]) -> tuple[int, ...]:
    return tuple(rec[_I_DIMS:_I_DIMS + min(rec[_I_NDIM], _MAX_DIMS)])


def _describe(rec: list[int]) -> str:
    shape = _shape_of(rec)
    text = "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
    return f"{text} {_dtype_name(rec[_I_DTYPE])} on {_device_name(rec[_I_DEVICE])}"


# --------------------------------------------------------------------------------------------------
# public collectives


def all_reduce(tensor: Tensor, op: ReduceOpName = "sum", group: dist.ProcessGroup | None = None) -> Tensor:
    """Reduce ``tensor`` across ranks in place and return it; every rank ends with the same value.

    All ranks of ``group`` must call it with tensors of the same shape, dtype and device kind; it
    blocks until every rank has contributed.

    Args:
        tensor: the local value. Reduced in place (a non-contiguous tensor is reduced through a copy).
        op: ``"sum"``, ``"mean"`` (sum divided by the group size, also on gloo, which has no AVG),
            ``"max"``, ``"min"`` or ``"prod"``. For bool tensors only ``"max"`` (any) and ``"min"`` (all).
        group: the process group; the world by default.

    Returns:
        ``tensor``, reduced.

    Raises:
        ValueError: ``op`` is not one of the names above.
        RankMismatchError: ranks passed different shapes, dtypes or ops (raised on every rank).
    """
    if op not in _REDUCE_OPS:
        raise ValueError(f"all_reduce: op must be one of {', '.join(_REDUCE_OPS)}; got {op!r}.")
    if not is_distributed(group):
        return tensor
    fn = "all_reduce"
    device = _comm_device(group, tensor)
    records = _exchange(_record(fn, arg=_REDUCE_OPS.index(op), tensor=tensor), group, device)
    ranks = _check_same_call(fn, records, group)
    fix = "Pass tensors of one shape and dtype on every rank"
    _raise_if_differs(fn, "op", {r: _REDUCE_OPS[rec[_I_ARG]] for r, rec in zip(ranks, records)},
                      "Every rank must pass the same op.")
    _raise_if_differs(fn, "tensor", {r: _describe(rec) for r, rec in zip(ranks, records)},
                      f"{fix} (all_reduce combines them element by element).")
    if tensor.dtype == torch.bool and op not in ("max", "min"):
        raise TypeError(f"all_reduce: op={op!r} is not defined for bool tensors; use 'max' (any) or 'min' (all).")
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"all_reduce: op='mean' needs a floating tensor, got {tensor.dtype}; cast it first "
                        "(tensor.double()) or reduce with op='sum' and divide yourself.")

    work = tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor
    staged = work if (work.is_contiguous() and work.device == device) else work.contiguous().to(device)
    torch_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}[op]
    dist.all_reduce(staged, op=torch_op, group=group)
    if op == "mean":
        staged.div_(dist.get_world_size(group))
    if staged is not work:
        work.copy_(staged)
    return tensor


def all_gather_uneven(tensor: Tensor, group: dist.ProcessGroup | None = None) -> tuple[Tensor, list[int]]:
    """Gather tensors whose first dimension differs across ranks; every rank receives all rows.

    All ranks of ``group`` must call it; it blocks. Ranks may pass any number of rows, zero
    included; dtype (any, bool and int64 too), trailing shape and device kind must match. Costs one
    small metadata exchange and one all-gather of the raw bytes (nothing is pickled).

    Args:
        tensor: at least one dimension; dim 0 is the row dimension.
        group: the process group; the world by default.

    Returns:
        ``(rows, counts)``: every rank's rows concatenated in rank order along dim 0 (on
        ``tensor``'s device, detached) and each rank's row count. Not distributed:
        ``(tensor, [len(tensor)])``.

    Raises:
        RankMismatchError: dtype, number of dimensions, trailing shape or device kind differ.
    """
    rows, counts = _gather_rows("all_gather_uneven", {"": tensor}, group)
    return rows[""], counts


def all_gather_uneven_dict(tensors: Mapping[str, Tensor], group: dist.ProcessGroup | None = None
                           ) -> tuple[dict[str, Tensor], list[int]]:
    """:func:`all_gather_uneven` for several tensors that share their row dimension, in one exchange.

    All ranks of ``group`` must call it with the same keys; it blocks. On each rank every tensor has
    the same number of rows (that rank's count); dtypes and trailing shapes may differ between keys
    but not between ranks. However many tensors, it costs one metadata exchange and one all-gather.

    Returns:
        ``(rows_by_key, counts)``, rows in rank order, keys in the order given.

    Raises:
        ValueError: the tensors of one rank have different row counts, or one is 0-d.
        RankMismatchError: keys, dtypes, trailing shapes or device kinds differ across ranks.
    """
    return _gather_rows("all_gather_uneven_dict", dict(tensors), group)


def _describe_tensor(tensor: Tensor) -> tuple[str, tuple[int, ...], str]:
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), tensor.device.type


def _shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _local_row_problem(fn: str, tensors: dict[str, Tensor]) -> str | None:
    if not tensors:
        return f"{fn}: got no tensors."
    if any(t.ndim == 0 for t in tensors.values()):
        return f"{fn}: needs tensors with a row dimension; got a 0-d tensor. Use tensor.reshape(1)."
    counts = {k: t.shape[0] for k, t in tensors.items()}
    if len(set(counts.values())) > 1:
        return f"{fn}: tensors of one rank must have the same number of rows; got {counts}."
    return None


def _gather_rows(fn: str, tensors: dict[str, Tensor], group: dist.ProcessGroup | None
                 ) -> tuple[dict[str, Tensor], list[int]]:
    problem = _local_row_problem(fn, tensors)
    if not is_distributed(group):
        if problem:
            raise ValueError(problem)
        return tensors, [next(iter(tensors.values())).shape[0]]
    first = next(iter(tensors.values()), None)
    device = _comm_device(group, first)
    # Everything that must match is folded into one checksum, so the happy path costs one fixed-size
    # exchange whatever the number of tensors; the details are exchanged only to explain a mismatch.
    layout = [(k, *_describe_tensor(t)[::2], t.shape[1:], t.ndim) for k, t in tensors.items()]
    signature = zlib.crc32(repr(layout).encode())
    rows = first.shape[0] if first is not None and not problem else 0
    records = _exchange(_record(fn, arg=1 if problem else 0, payload=rows, aux=signature), group, device)
    ranks = _check_same_call(fn, records, group)
    if any(rec[_I_ARG] for rec in records) or len({rec[_I_AUX] for rec in records}) > 1:
        _explain_row_mismatch(fn, tensors, problem, ranks, group)
    counts = [rec[_I_PAYLOAD] for rec in records]
    world, most, rank = len(counts), max(counts), dist.get_rank(group)
    row_bytes = {k: math.prod(t.shape[1:]) * t.element_size() for k, t in tensors.items()}
    width = sum(row_bytes.values())
    if most == 0 or width == 0:
        return {k: t.new_empty((sum(counts), *t.shape[1:])) for k, t in tensors.items()}, counts

    # One rank's block: tensor after tensor, each as raw bytes; blocks padded to the largest rank.
    flats = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()]
    if len(flats) == 1 and counts[rank] == most and flats[0].device == device:
        send = flats[0]
    else:
        send = torch.empty(most * width, dtype=torch.uint8, device=device)  # padding is never read
        offset = 0
        for flat in flats:
            send[offset: offset + flat.numel()].copy_(flat)
            offset += flat.numel()
    out = torch.empty(world * most * width, dtype=torch.uint8, device=device).view(world, most * width)
    _all_gather_single(out.view(-1), send, group=group)

    result: dict[str, Tensor] = {}
    offsets = [0] * world
    for key, tensor in tensors.items():
        rb = row_bytes[key]
        if len(tensors) == 1 and min(counts) == most:
            raw = out.view(-1)
        else:
            raw = torch.cat([out[r, offsets[r]: offsets[r] + counts[r] * rb] for r in range(world)])
        offsets = [o + c * rb for o, c in zip(offsets, counts)]
        result[key] = raw.view(tensor.dtype).reshape(sum(counts), *tensor.shape[1:]).to(tensor.device)
    return result, counts


def _explain_row_mismatch(fn: str, tensors: dict[str, Tensor], problem: str | None, ranks: list[int],
                          group: dist.ProcessGroup | None) -> None:
    """Second exchange, on the error path only: every rank's layout, then one precise error everywhere."""
    mine = (problem, {k: _describe_tensor(t) for k, t in tensors.items()})
    every = gather_objects(mine, group=group)
    assert every is not None
    problems = {r: p for r, (p, _) in zip(ranks, every) if p}
    if problems:  # bad input rather than disagreement, but every rank learns every rank's problem
        raise ValueError(f"{fn}: " + "; ".join(f"rank {r}: {p.removeprefix(fn + ': ')}" for r, p in problems.items()))
    layouts = {r: lay for r, (_, lay) in zip(ranks, every)}
    keys = {r: list(lay) for r, lay in layouts.items()}
    if len({tuple(k) for k in keys.values()}) > 1:
        raise RankMismatchError(f"{fn}: keys differ across ranks: {format_ranks(keys)}. Return the same keys from "
                                "every rank (every step of every rank must produce the same structure).", keys)
    for key in keys[ranks[0]]:
        label = f" for key {key!r}" if key else ""
        dtypes = {r: lay[key][0] for r, lay in layouts.items()}
        _raise_if_differs(fn, "dtype" + label, dtypes, "Pass the same dtype on every rank (cast before gathering).")
        trailing = {r: (len(lay[key][1]), lay[key][1][1:]) for r, lay in layouts.items()}
        if len(set(trailing.values())) > 1:
            shapes = {r: f"{_shape_text(lay[key][1])} {lay[key][0]} on {lay[key][2]}" for r, lay in layouts.items()}
            raise RankMismatchError(
                f"{fn}: trailing shape{label} differs across ranks: {format_ranks(shapes)}. Pass tensors with the "
                "same trailing shape on every rank (only dim 0 may differ); pad ragged rows and gather their "
                "lengths alongside.", shapes)
        _raise_if_differs(fn, "device kind" + label, {r: lay[key][2] for r, lay in layouts.items()},
                          "Put the tensors on the same kind of device on every rank.")
    raise AssertionError(f"{fn}: layout checksums differ but no difference was found: {layouts}")


def gather_uneven(tensor: Tensor, dst: int = 0, group: dist.ProcessGroup | None = None
                  ) -> tuple[Tensor | None, list[int]]:
    """Like :func:`all_gather_uneven`, but only global rank ``dst`` receives the rows.

    All ranks of ``group`` must call it with the same ``dst``; it blocks. The other ranks never
    allocate the gathered rows, so a large result costs memory on ``dst`` only.

    Args:
        tensor: at least one dimension; dim 0 is the row dimension (any count, zero included).
        dst: the global rank that receives the rows.
        group: the process group; the world by default.

    Returns:
        ``(rows, counts)`` on ``dst`` (rows as in :func:`all_gather_uneven`), ``(None, counts)`` on the
        other ranks; every rank gets the per-rank row counts. Not distributed: ``(tensor, [len(tensor)])``.

    Raises:
        RankMismatchError: ``dst``, dtype, trailing shape or device kind differ across ranks.
    """
    if tensor.ndim == 0:
        raise ValueError("gather_uneven: needs a tensor with a row dimension; got a 0-d tensor. Use tensor.reshape(1).")
    if not is_distributed(group):
        return tensor, [tensor.shape[0]]
    fn = "gather_uneven"
    device = _comm_device(group, tensor)
    records = _exchange(_record(fn, arg=dst, tensor=tensor), group, device)
    ranks = _check_same_call(fn, records, group)
    _raise_if_differs(fn, "dst", {r: rec[_I_ARG] for r, rec in zip(ranks, records)}, "Pass the same dst on every rank.")
    if dst not in ranks:
        raise ValueError(f"gather_uneven: dst={dst} is not a rank of the group (its global ranks: {ranks}).")
    _raise_if_differs(fn, "dtype", {r: _dtype_name(rec[_I_DTYPE]) for r, rec in zip(ranks, records)},
                      "Pass the same dtype on every rank (cast before gathering).")
    if len({(rec[_I_NDIM], _shape_of(rec)[1:]) for rec in records}) > 1:
        shapes = {r: _describe(rec) for r, rec in zip(ranks, records)}
        raise RankMismatchError(
            f"{fn}: trailing shape differs across ranks: {format_ranks(shapes)}. Pass tensors with the same trailing "
            "shape on every rank (only dim 0 may differ).", shapes)
    _raise_if_differs(fn, "device kind", {r: _device_name(rec[_I_DEVICE]) for r, rec in zip(ranks, records)},
                      "Put the tensor on the same kind of device on every rank.")
    counts = [rec[_I_DIMS] for rec in records]
    trailing = tuple(tensor.shape[1:])
    row_bytes = math.prod(trailing) * tensor.element_size()
    is_dst = dist.get_rank() == dst
    world, most = len(counts), max(counts)
    if most == 0 or row_bytes == 0:
        return (tensor.new_empty((sum(counts), *trailing)) if is_dst else None), counts
    local = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if counts[dist.get_rank(group)] == most and local.device == device:
        send = local
    else:
        send = torch.zeros(most * row_bytes, dtype=torch.uint8, device=device)
        send[: local.numel()].copy_(local)
    out = torch.empty(world, most * row_bytes, dtype=torch.uint8, device=device) if is_dst else None
    dist.gather(send, list(out.unbind(0)) if out is not None else None, dst=dst, group=group)
    if out is None:
        return None, counts
    flat = out.reshape(-1)
    if min(counts) != most:  # drop each rank's padding
        flat = torch.cat([out[r, : counts[r] * row_bytes] for r in range(world)])
    rows = flat.view(tensor.dtype).reshape(sum(counts), *trailing)
    return rows.to(tensor.device), counts


def _source_record(fn: str, src: int, records: list[list[int]], group: dist.ProcessGroup | None) -> list[int]:
    """Check that every rank entered ``fn`` with the same ``src`` (a group member); return ``src``'s record."""
    ranks = _check_same_call(fn, records, group)
    _raise_if_differs(fn, "src", {r: rec[_I_ARG] for r, rec in zip(ranks, records)},
                      "Pass the same src on every rank.")
    if src not in ranks:
        raise ValueError(f"{fn}: src={src} is not a rank of the group (its global ranks: {ranks}).")
    return records[ranks.index(src)]


def _to_bytes(obj: Any) -> Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def _from_bytes(buf: Tensor) -> Any:
    return pickle.loads(buf.cpu().numpy().tobytes())


def broadcast_object(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Send a picklable object from global rank ``src`` to every rank of ``group``.

    All ranks must call it with the same ``src``; it blocks. The object on ranks other than ``src``
    is ignored (pass ``None``).

    Returns:
        ``src``'s object (on ``src`` itself, the very object passed in).

    Raises:
        RankMismatchError: ranks passed different ``src``, or ``src`` is not in ``group``.
    """
    if not is_distributed(group):
        return obj
    fn = "broadcast_object"
    device = _comm_device(group)
    rank = dist.get_rank()
    payload = _to_bytes(obj) if rank == src else None
    records = _exchange(_record(fn, arg=src, payload=payload.numel() if payload is not None else _NONE), group, device)
    size = _source_record(fn, src, records, group)[_I_PAYLOAD]
    buf = payload.to(device) if payload is not None else torch.empty(size, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    return obj if rank == src else _from_bytes(buf)


def gather_objects(obj: Any, dst: int | None = None, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Collect one picklable object from every rank, in rank order.

    All ranks must call it with the same ``dst``; it blocks. Objects are pickled and exchanged as
    one padded byte buffer per rank (tensors are better sent with :func:`all_gather_uneven`).

    Args:
        obj: this rank's object.
        dst: ``None``: every rank receives the list; a global rank: only that rank does.
        group: the process group; the world by default.

    Returns:
        The list of every rank's object (group rank order), or ``None`` on ranks other than ``dst``.
        Not distributed: ``[obj]``.

    Raises:
        RankMismatchError: ranks passed different ``dst``.
    """
    if not is_distributed(group):
        return [obj]
    fn = "gather_objects"
    device = _comm_device(group)
    payload = _to_bytes(obj)
    records = _exchange(_record(fn, arg=_NONE if dst is None else dst, payload=payload.numel()), group, device)
    ranks = _check_same_call(fn, records, group)
    _raise_if_differs(fn, "dst", {r: (None if rec[_I_ARG] == _NONE else rec[_I_ARG]) for r, rec in zip(ranks, records)},
                      "Pass the same dst on every rank (None: everyone receives the list).")
    if dst is not None and dst not in ranks:
        raise ValueError(f"gather_objects: dst={dst} is not a rank of the group (its global ranks: {ranks}).")
    sizes = [rec[_I_PAYLOAD] for rec in records]
    most = max(sizes)
    send = torch.zeros(most, dtype=torch.uint8, device=device)
    send[: payload.numel()].copy_(payload)
    world = len(ranks)
    if dst is None:
        out = torch.empty(world * most, dtype=torch.uint8, device=device)
        _all_gather_single(out, send, group=group)
        chunks = list(out.view(world, most))
    else:
        chunks_out = [torch.empty(most, dtype=torch.uint8, device=device) for _ in range(world)]
        dist.gather(send, chunks_out if dist.get_rank() == dst else None, dst=dst, group=group)
        if dist.get_rank() != dst:
            return None
        chunks = chunks_out
    return [_from_bytes(chunk[:size]) for chunk, size in zip(chunks, sizes)]


def validate_seed(seed: int | None, what: str = "seed", check_range: bool = True) -> None:
    """Raise TypeError unless ``seed`` is an int or None, ValueError if it is outside ``[0, MAX_SEED]``."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"{what} must be an int or None; got {type(seed).__name__} {seed!r}.")
    if check_range and seed is not None and not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{what} must be in [0, {MAX_SEED}]; got {seed}.")


def broadcast_seed(seed: int | None = None, src: int = 0, group: dist.ProcessGroup | None = None) -> int:
    """Make every rank agree on ``src``'s seed and return it.

    All ranks must call it with the same ``src``; it blocks. Only ``src``'s ``seed`` counts; when it
    is ``None``, ``src`` draws a fresh one from OS entropy. Seeds are in ``[0, 2**32 - 1]``.

    Returns:
        The seed of ``src``, identical on every rank. Not distributed: ``seed`` (or a fresh one).

    Raises:
        ValueError: ``src``'s seed is outside ``[0, 2**32 - 1]`` (raised on every rank).
        RankMismatchError: ranks passed different ``src``.
    """
    # Only src's seed counts, and its range is checked once every rank knows it (below): a local
    # ValueError on one rank would leave the others waiting.
    validate_seed(seed, check_range=False)
    if not is_distributed(group):
        seed = seed if seed is not None else secrets.randbelow(MAX_SEED + 1)
        validate_seed(seed)
        return seed
    fn = "broadcast_seed"
    rank = dist.get_rank()
    if rank == src and seed is None:
        seed = secrets.randbelow(MAX_SEED + 1)
    # -1: no seed; -2: out of range (reported once every rank knows). Seeds ride in the record itself.
    aux = _NONE if seed is None else (seed if 0 <= seed <= MAX_SEED else -2)
    records = _exchange(_record(fn, arg=src, aux=aux), group, _comm_device(group))
    chosen = _source_record(fn, src, records, group)[_I_AUX]
    if chosen == -2:
        raise ValueError(f"broadcast_seed: rank {src}'s seed is outside [0, {MAX_SEED}]"
                         + (f": {seed}" if rank == src else "") + ". Pick a seed in that range.")
    return int(chosen)
