"""Rank-safe collectives: the one module of lightning_sync that talks to process groups.

Every function here:

* must be called by **every rank of the group**, in the same order, and blocks until all have;
* returns its input unchanged (or a one-element result) when ``torch.distributed`` is not
  initialised or the group has a single rank, so the same code runs in one process;
* first exchanges one small fixed-size metadata record with every rank: which function, whether
  this rank's arguments are valid, ``src``/``dst``/``op``, payload size and a checksum of the
  tensor layout (dtype, shape, device). A bad argument on any rank (an unpicklable object, a float
  seed, an unknown op, a 0-d tensor where rows are needed) becomes the same ``TypeError`` or
  ``ValueError`` on every rank, naming the rank and its value, instead of an error on one rank and
  a hang on the others; ranks that disagree raise :class:`~lightning_sync.RankMismatchError` on
  every rank, naming each rank's value. Gloo would otherwise abort the process ("Received data
  size doesn't match expected size") or return zero-padded garbage;
* accepts ``group`` (default: the world) and works on gloo (CPU tensors) and NCCL (CPU inputs are
  moved to the current CUDA device for the exchange and the result is moved back).

``src``/``dst`` are global ranks, as in ``torch.distributed``.

:func:`broadcast_object` and :func:`gather_objects` pickle, so a peer's bytes can run code on the
receiver: the ranks of a process group must trust each other (see ``docs/security.md``). With
``safe=True`` they unpickle with a restricted unpickler instead, which accepts plain data only
(numbers, strings, lists, tuples, dicts, sets, CPU tensors, dtypes) and refuses anything else.
Plain CPU tensors travel as raw bytes in both modes (no ``torch.save`` on any rank).

Only ``torch.distributed`` is imported here, never Lightning.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sync._compat.torch_api import all_gather_single as _all_gather_single
from lightning_sync._pickling import from_bytes, to_bytes
from lightning_sync.errors import CollectiveMismatchError, RankMismatchError, format_ranks

__all__ = [
    "all_gather_uneven",
    "all_gather_uneven_dict",
    "all_reduce",
    "backend_for",
    "broadcast_object",
    "broadcast_seed",
    "check_same_layout",
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
          "all_gather_uneven_dict", "gather_uneven", "check_same_layout")
# Record layout (int64): magic, call, problem (bytes of this rank's argument error; 0: arguments
# valid), arg (src, dst or op), payload (rows or bytes), aux (the seed), layout checksum.
_MAGIC = 0x4C53594E  # "LSYN"
_I_CALL, _I_PROBLEM, _I_ARG, _I_PAYLOAD, _I_AUX, _I_LAYOUT = 1, 2, 3, 4, 5, 6
_I_SITE = 7  # the collective guard's token for this call (op + call site), 0 without a guard
_META_LEN = 8
_NONE = -1
# The exception classes a local argument problem may carry to the other ranks.
_PROBLEM_TYPES: dict[str, type[Exception]] = {"TypeError": TypeError, "ValueError": ValueError}


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    """True when a process group is initialised and ``group`` has more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


# --------------------------------------------------------------------------------------------------
# describing values


def _shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _layout(tensor: Tensor) -> tuple[str, tuple[int, ...], str]:
    """(dtype, shape, device kind): what must match across ranks, as shown in errors."""
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), tensor.device.type


def _describe(layout: Sequence[Any]) -> str:
    dtype, shape, device = layout
    return f"{_shape_text(shape)} {dtype} on {device}"


def _value(obj: Any, limit: int = 80) -> str:
    """``type repr`` of a user's value for an error message, short and never raising."""
    try:
        text = repr(obj)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
        text = "<unprintable>"
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(obj).__name__} {text}"


# --------------------------------------------------------------------------------------------------
# metadata exchange


def backend_for(group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> str:
    """The backend that carries a collective of tensors on ``device`` over ``group`` (``None``: the world):
    ``"gloo"``, ``"nccl"``, or whatever name torch reports, in lower case. A group made with one backend per
    device type (``"cpu:gloo,cuda:nccl"``) is resolved for ``device``'s type; a device type it has no backend
    for gets its first one. Every question "is this call on gloo or on NCCL?" in lightning_sync is asked
    here, so a mixed group sends CPU tensors through gloo and CUDA tensors through NCCL alike everywhere.
    Raises ``ValueError`` where this rank is not a member of ``group`` (as ``dist.get_backend`` does)."""
    return _backend_in_spec(str(dist.get_backend(group)), device)


def _backend_in_spec(spec: str, device: torch.device | str = "cpu") -> str:
    """:func:`backend_for` of a backend string before any group exists (``"nccl"``, ``"cpu:gloo,cuda:nccl"``):
    the backend that string gives tensors on ``device``."""
    spec = spec.lower()
    if ":" not in spec:
        return spec
    table = dict(part.split(":", 1) for part in spec.split(",") if ":" in part)
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return table.get(kind) or next(iter(table.values()))


def _comm_device(group: dist.ProcessGroup | None, tensor: Any = None) -> torch.device:
    """The device a payload must live on for ``group``'s backend."""
    if isinstance(tensor, Tensor) and tensor.device.type == "cuda":
        return tensor.device
    if backend_for(group, "cpu") == "nccl":  # a group with no CPU backend
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _device_barrier(group: dist.ProcessGroup | None = None, device_index: int | None = None,
                   async_op: bool = False) -> Any:
    """``dist.barrier`` that names the GPU on NCCL, as Lightning's ``DDPStrategy.barrier`` does.

    Without ``device_ids`` NCCL picks a device itself (the bound one, else ``rank % device_count``, with
    a warning): on a node whose ranks see their GPUs in another order that is a second communicator on
    the wrong GPU. ``device_index``: this rank's GPU (default: the current CUDA device).
    """
    kwargs: dict[str, Any] = {}
    if backend_for(group, "cuda") == "nccl" and torch.cuda.is_available():
        kwargs["device_ids"] = [torch.cuda.current_device() if device_index is None else device_index]
    return dist.barrier(group=group, async_op=async_op, **kwargs)


# The active collective guard's callbacks (see register_guard); None without a guard.
_guard_hook: Any = None
_guard_explain: Any = None
_guard_record: Any = None


def register_guard(hook: Callable[[str, Any], int], explain: Callable[[str, Any, dict[int, int]], BaseException],
                   record: Callable[[str, str, Any, str | None], None] | None = None) -> None:
    """Let a collective guard check every call of this module (one guard at a time; the last one wins).

    Args:
        hook: called with the collective's name and group before its metadata exchange; returns a
            token of the call (op + call site, 0: not recorded) that travels in the exchange, so
            ranks calling from different places are stopped before the payload moves. Shapes and
            arguments are still checked here, with the more specific RankMismatchError.
        explain: called with the name, the group and every rank's token when the tokens differ;
            returns the error every rank raises.
        record: called with an exchange's name, what must match (dtype and size), its group and a call site
            (None: the caller's) before :func:`all_gather_rows` runs one for a ``what`` it was given
            (SyncBatchNorm's statistics and gradient sums): recorded, not confirmed, so a rank that went on
            into one while another made an extra collective is a mismatch the guard finds in a turn.
    """
    global _guard_hook, _guard_explain, _guard_record
    _guard_hook, _guard_explain, _guard_record = hook, explain, record


def unregister_guard(hook: Callable[[str, Any], int]) -> None:
    """Undo :func:`register_guard` (only if ``hook`` is the registered one)."""
    global _guard_hook, _guard_explain, _guard_record
    if _guard_hook == hook:
        _guard_hook = _guard_explain = _guard_record = None


def _exchange(record: list[int], group: dist.ProcessGroup | None, device: torch.device,
              token: int | None = None) -> list[list[int]]:
    """All-gather one fixed-size record per rank. Same size everywhere, so it can never abort gloo.

    ``token``: the guard's token of this call when :func:`_same_everywhere` already took it (the
    guard records a call once)."""
    if token is not None:
        record[_I_SITE] = token
    elif _guard_hook is not None:
        record[_I_SITE] = _guard_hook(_CALLS[record[_I_CALL]], group)
    mine = torch.tensor(record, dtype=torch.int64, device=device)
    records = all_gather_rows(mine, group).tolist()
    tokens = [rec[_I_SITE] for rec in records]
    if _guard_explain is not None and len(set(tokens)) > 1 and min(tokens) > 0:
        raise _guard_explain(_CALLS[record[_I_CALL]], group, dict(zip(_global_ranks(group), tokens)))
    return records


def _same_everywhere(record: list[int], group: dist.ProcessGroup | None, device: torch.device) -> tuple[bool, int]:
    """Whether every rank's record equals this one (by a 62-bit digest), and the guard's token put into it.

    One all-reduce of two int64 (MAX of the digest beside its negation: the maximum and minus the
    minimum over the ranks) instead of the all-gather of :func:`_exchange`: on gloo an all-gather,
    or an all-reduce of 16 elements, took ~1.6-1.8x as long as an all-reduce of two (2 ranks, 265-480
    vs 270-310 us here). Every rank gets the same answer, so where it is False every rank goes on to
    the full exchange together.
    """
    if _guard_hook is not None:
        record[_I_SITE] = _guard_hook(_CALLS[record[_I_CALL]], group)
    # 62 bits of a BLAKE2b digest: a collision (a differing record taken for equal) is ~2**-62
    digest = int.from_bytes(hashlib.blake2b(",".join(map(str, record)).encode(), digest_size=8).digest(), "big") >> 2
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, minus_low = both.tolist()
    return high == -minus_low, record[_I_SITE]


def all_gather_rows(record: Tensor, group: dist.ProcessGroup | None, what: str | None = None,
                    site: str | None = None) -> Tensor:
    """Every rank's ``record`` (1-D, the same size on every rank) as ``[world, n]`` in rank order, on
    ``record``'s device: one ``all_gather_into_tensor`` on ``group``. Every rank of the group must call it.
    ``what`` (and ``site``, else the caller's): the name under which a collective guard records it."""
    if what is not None and _guard_record is not None:
        _guard_record(what, f"{str(record.dtype).removeprefix('torch.')}[{record.numel()}]", group, site)
    world = dist.get_world_size(group)
    gathered = torch.empty(world * record.numel(), dtype=record.dtype, device=record.device)
    _all_gather_single(gathered, record, group=group)
    return gathered.view(world, -1)


def _global_ranks(group: dist.ProcessGroup | None) -> list[int]:
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]


def _padded_exchange(parts: Sequence[Tensor], sizes: list[int], group: dist.ProcessGroup | None,
                     device: torch.device, dst: int | None = None) -> Tensor | None:
    """Exchange each rank's bytes (``parts`` back to back, ``sizes[r]`` bytes on group rank ``r``).

    Every rank sends one buffer of ``max(sizes)`` bytes, so the exchange is one even all-gather
    (``dst=None``) or gather (to global rank ``dst``). Returns the ``(world, max(sizes))`` uint8
    blocks on receiving ranks (row ``r``'s bytes past ``sizes[r]`` are padding), ``None`` elsewhere.
    """
    world, most = len(sizes), max(sizes)
    if len(parts) == 1 and parts[0].numel() == most and parts[0].device == device:
        send = parts[0]  # the common even case: no copy
    else:
        send = torch.empty(most, dtype=torch.uint8, device=device)
        offset = 0
        for part in parts:
            send[offset: offset + part.numel()].copy_(part)
            offset += part.numel()
        send[offset:].zero_()  # never read, but never send stale memory either
    if dst is None:
        out = torch.empty(world, most, dtype=torch.uint8, device=device)
        _all_gather_single(out.view(-1), send, group=group)
        return out
    receiving = dist.get_rank() == dst
    blocks = torch.empty(world, most, dtype=torch.uint8, device=device) if receiving else None
    dist.gather(send, list(blocks.unbind(0)) if blocks is not None else None, dst=dst, group=group)
    return blocks


def _trim(blocks: Tensor, sizes: list[int]) -> list[Tensor]:
    """Each rank's bytes without the padding, on the host: one device-to-host copy for all ranks (on
    NCCL the blocks arrive on the GPU; a copy per rank would be ``world`` synchronising transfers)."""
    host = blocks.cpu()
    return [host[r, :size] for r, size in enumerate(sizes)]


def _all_gather_texts(text: str, group: dist.ProcessGroup | None, device: torch.device,
                      sizes: list[int] | None = None) -> list[str]:
    """Every rank's UTF-8 ``text``; ``sizes``: their byte lengths where every rank knows them already."""
    data = text.encode()
    if sizes is None:
        mine = torch.tensor([len(data)], dtype=torch.int64, device=device)
        every = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
        _all_gather_single(every, mine, group=group)
        sizes = every.tolist()
    part = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    blocks = _padded_exchange([part.to(device)], sizes, group, device)
    assert blocks is not None
    return [chunk.numpy().tobytes().decode() for chunk in _trim(blocks, sizes)]


class _Problem:
    """A bad argument found on this rank: raised on every rank once every rank has reported."""

    def __init__(self, kind: type[Exception], message: str) -> None:
        self.kind, self.message = kind, message

    def encode(self) -> str:
        return f"{self.kind.__name__}:{self.message}"


def _record(fn: str, problem: _Problem | None, arg: int = _NONE, payload: int = _NONE, aux: int = _NONE,
            layout: Any = None) -> list[int]:
    """This rank's metadata record of a call (the guard's token slot still 0)."""
    if problem is not None:  # the arguments may not even be numbers
        return [_MAGIC, _CALLS.index(fn), len(problem.encode().encode()), _NONE, _NONE, _NONE, _NONE, 0]
    return [_MAGIC, _CALLS.index(fn), 0, arg, payload, aux,
            _NONE if layout is None else zlib.crc32(repr(layout).encode()), 0]


def _agree(fn: str, group: dist.ProcessGroup | None, device: torch.device, problem: _Problem | None, *,
           arg: int = _NONE, payload: int = _NONE, aux: int = _NONE, layout: Any = None, token: int | None = None
           ) -> tuple[list[list[int]], list[int]]:
    """The metadata exchange of every collective; returns every rank's record and the global ranks.

    Raises, on every rank: CollectiveMismatchError when ranks entered different collectives; the
    bad rank's TypeError/ValueError when any rank's arguments are invalid.
    """
    text = problem.encode() if problem is not None else ""
    records = _exchange(_record(fn, problem, arg, payload, aux, layout), group, device, token)
    ranks = _check_same_call(fn, records, group)
    if any(rec[_I_PROBLEM] for rec in records):
        texts = _all_gather_texts(text, group, device, [rec[_I_PROBLEM] for rec in records])
        _raise_problems(fn, {r: t for r, t in zip(ranks, texts) if t}, len(ranks))
    return records, ranks


def _raise_problems(fn: str, texts: dict[int, str], world: int) -> None:
    """One error, the same on every rank, for every rank's argument problem."""
    problems = {r: t.split(":", 1) for r, t in texts.items()}
    kind = _PROBLEM_TYPES.get(next(iter(problems.values()))[0], ValueError)
    messages = {r: msg for r, (_, msg) in problems.items()}
    if len(messages) == world and len(set(messages.values())) == 1:
        raise kind(f"{fn}: bad argument on every rank: {next(iter(messages.values()))}")
    where = "rank" if len(messages) == 1 else "ranks"
    listed = "; ".join(f"rank {r}: {msg}" for r, msg in messages.items())
    raise kind(f"{fn}: bad argument on {where} {', '.join(map(str, messages))} of {world} "
               f"(every rank raises this error): {listed}")


def _raise_local(fn: str, problem: _Problem | None) -> None:
    """Not distributed: a bad argument is raised right away."""
    if problem is not None:
        raise problem.kind(f"{fn}: {problem.message}")


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


def _check_same_arg(fn: str, name: str, records: list[list[int]], ranks: list[int], fix: str,
                    show: Any = None) -> None:
    values = {r: (show(rec[_I_ARG]) if show else rec[_I_ARG]) for r, rec in zip(ranks, records)}
    _raise_if_differs(fn, name, values, fix)


def _rank_problem(name: str, value: Any, group: dist.ProcessGroup | None, optional: bool = False
                  ) -> _Problem | None:
    """``src``/``dst`` must be an int naming a rank of the group (or None where ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return _Problem(TypeError, f"{name} must be an int{' or None' if optional else ''} (a global rank); "
                                   f"got {_value(value)}.")
    if is_distributed(group) and value not in _global_ranks(group):
        return _Problem(ValueError, f"{name}={value} is not a rank of the group (its global ranks: "
                                    f"{_global_ranks(group)}).")
    return None


def _explain_layouts(fn: str, mine: list[list[Any]], ranks: list[int],
                     group: dist.ProcessGroup | None, device: torch.device, whole_shape: bool) -> None:
    """Error path only: exchange every rank's layout (as JSON) and raise one precise error on every rank.

    ``mine``: ``[[key, dtype, shape, device], ...]``. ``whole_shape``: the whole shape must match
    (all_reduce); otherwise only the number of dimensions and the trailing shape (gathers).
    """
    # JSON, not pickle: nothing a peer sends here can run code
    layouts = {r: json.loads(t) for r, t in zip(ranks, _all_gather_texts(json.dumps(mine), group, device))}
    keys = {r: [entry[0] for entry in lay] for r, lay in layouts.items()}
    if len({tuple(k) for k in keys.values()}) > 1:
        raise RankMismatchError(f"{fn}: keys differ across ranks: {format_ranks(keys)}. Return the same keys from "
                                "every rank (every step of every rank must produce the same structure).", keys)
    for i, key in enumerate(keys[ranks[0]]):
        label = f" for key {key!r}" if key else ""
        shown = {r: _describe(lay[i][1:]) for r, lay in layouts.items()}
        if whole_shape:
            _raise_if_differs(fn, "tensor" + label, shown,
                              f"Pass tensors of one shape and dtype on every rank ({fn} combines them element by "
                              "element).")
            continue
        _raise_if_differs(fn, "dtype" + label, {r: lay[i][1] for r, lay in layouts.items()},
                          "Pass the same dtype on every rank (cast before gathering).")
        if len({(len(lay[i][2]), tuple(lay[i][2][1:])) for lay in layouts.values()}) > 1:
            raise RankMismatchError(
                f"{fn}: trailing shape{label} differs across ranks: {format_ranks(shown)}. Pass tensors with the "
                "same trailing shape on every rank (only dim 0 may differ); pad ragged rows and gather their "
                "lengths alongside.", shown)
        _raise_if_differs(fn, "device kind" + label, {r: lay[i][3] for r, lay in layouts.items()},
                          "Put the tensors on the same kind of device on every rank.")
    raise AssertionError(f"{fn}: layout checksums differ but no difference was found: {layouts}")


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
        TypeError: ``tensor`` is not a tensor, or ``op`` does not apply to its dtype (on every rank
            when any rank's argument is bad).
        ValueError: ``op`` is not one of the names above (on every rank when any rank's is not).
        RankMismatchError: ranks passed different shapes, dtypes or ops (raised on every rank).
    """
    fn = "all_reduce"
    problem = _reduce_problem(tensor, op)
    if not is_distributed(group):
        _raise_local(fn, problem)
        return tensor
    device = _comm_device(group, tensor)
    layout = [["", *_layout(tensor)]] if problem is None else None
    records, ranks = _agree(fn, group, device, problem, arg=_REDUCE_OPS.index(op) if problem is None else _NONE,
                            layout=layout)
    _check_same_arg(fn, "op", records, ranks, "Every rank must pass the same op.", lambda code: _REDUCE_OPS[code])
    if len({rec[_I_LAYOUT] for rec in records}) > 1:
        assert layout is not None
        _explain_layouts(fn, layout, ranks, group, device, whole_shape=True)

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


def check_same_layout(tensor: Tensor, caller: str = "check_same_layout", fix: str = "",
                      group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank, before any data moves, unless every rank's tensor has the same shape, dtype
    and device kind (for collectives that need equal shapes: ``all_gather``, ``all_reduce``, ``broadcast``).

    All ranks of ``group`` must call it; it blocks (one small metadata exchange). Does nothing when
    not distributed.

    Args:
        tensor: this rank's tensor.
        caller: the operation named in the error (e.g. ``"self.all_gather"``).
        fix: what to do instead, appended to the error.
        group: the process group; the world by default.

    Raises:
        TypeError: ``tensor`` is not a tensor (on every rank when any rank's is not).
        RankMismatchError: the layouts differ (on every rank, naming each rank's shape and dtype).
    """
    _check_same_layout(tensor, caller, fix, group, quick=False)


def _check_same_layout(tensor: Tensor, caller: str, fix: str, group: dist.ProcessGroup | None, quick: bool) -> None:
    """:func:`check_same_layout`; ``quick``: the collective guard's pre-check of a user's collective.

    Like every collective of this module, the public form opens with the fixed-size metadata
    all-gather, so a rank in another of them is named at once (:func:`_check_same_call`). ``quick``
    opens with one all-reduce of two int64 instead (:func:`_same_everywhere`, ~1.6x faster on gloo)
    and falls back to that exchange, on every rank, where the records differ: only the guard uses it,
    whose watchdog names ranks that entered different collectives by their fingerprints.
    """
    fn = "check_same_layout"
    problem = None if isinstance(tensor, Tensor) else _Problem(TypeError, f"tensor must be a torch.Tensor; got "
                                                                          f"{_value(tensor)}.")
    if not is_distributed(group):
        _raise_local(fn, problem)
        return
    device = _comm_device(group, tensor if problem is None else None)
    layout = [["", *_layout(tensor)]] if problem is None else None
    token = None
    if quick:  # every rank's layout equal in one all-reduce; otherwise the full exchange, on every rank
        same, token = _same_everywhere(_record(fn, problem, layout=layout), group, device)
        if same and problem is None:
            return
    records, ranks = _agree(fn, group, device, problem, layout=layout, token=token)
    if len({rec[_I_LAYOUT] for rec in records}) == 1:
        return
    assert layout is not None
    layouts = {r: json.loads(t) for r, t in zip(ranks, _all_gather_texts(json.dumps(layout), group, device))}
    shown = {r: _describe(lay[0][1:]) for r, lay in layouts.items()}
    raise RankMismatchError(f"{caller}: the tensor differs across ranks: {format_ranks(shown)}, and {caller} needs "
                            f"one shape and dtype on every rank. {fix}".rstrip(), shown)


def _reduce_problem(tensor: Any, op: Any) -> _Problem | None:
    if not isinstance(tensor, Tensor):
        return _Problem(TypeError, f"tensor must be a torch.Tensor; got {_value(tensor)}. Wrap a number with "
                                   "torch.tensor(value).")
    if not isinstance(op, str) or op not in _REDUCE_OPS:
        return _Problem(ValueError, f"op must be one of {', '.join(_REDUCE_OPS)}; got {op!r}.")
    if tensor.dtype == torch.bool and op not in ("max", "min"):
        return _Problem(TypeError, f"op={op!r} is not defined for bool tensors; use 'max' (any) or 'min' (all).")
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        return _Problem(TypeError, f"op='mean' needs a floating tensor, got {tensor.dtype}; cast it first "
                                   "(tensor.double()) or reduce with op='sum' and divide yourself.")
    return None


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
        TypeError, ValueError: ``tensor`` is not a tensor or is 0-d on some rank (raised on every rank).
        RankMismatchError: dtype, number of dimensions, trailing shape or device kind differ.
    """
    rows, counts = _gather_rows("all_gather_uneven", {"": tensor}, group)
    assert rows is not None
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
        ValueError: the tensors of some rank have different row counts, or one is 0-d (every rank).
        RankMismatchError: keys, dtypes, trailing shapes or device kinds differ across ranks.
    """
    rows, counts = _gather_rows("all_gather_uneven_dict", dict(tensors), group)
    assert rows is not None
    return rows, counts


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
        TypeError, ValueError: a bad ``tensor`` or ``dst`` on some rank (raised on every rank).
        RankMismatchError: ``dst``, dtype, trailing shape or device kind differ across ranks.
    """
    rows, counts = _gather_rows("gather_uneven", {"": tensor}, group, dst=dst)
    return (rows[""] if rows is not None else None), counts


def _rows_problem(tensors: dict[str, Any]) -> _Problem | None:
    if not tensors:
        return _Problem(ValueError, "got no tensors.")
    for key, t in tensors.items():
        label = f"key {key!r}: " if key else ""
        if not isinstance(t, Tensor):
            return _Problem(TypeError, f"{label}needs a torch.Tensor with a row dimension; got {_value(t)}.")
        if t.ndim == 0:
            return _Problem(ValueError, f"{label}needs a tensor with a row dimension; got a 0-d tensor "
                                        f"({t.item()!r}). Use tensor.reshape(1).")
    counts = {k: t.shape[0] for k, t in tensors.items()}
    if len(set(counts.values())) > 1:
        return _Problem(ValueError, f"tensors of one rank must have the same number of rows; got {counts}.")
    return None


def _gather_rows(fn: str, tensors: dict[str, Tensor], group: dist.ProcessGroup | None, dst: int | None = None
                 ) -> tuple[dict[str, Tensor] | None, list[int]]:
    """Rows of every rank, per key, in rank order; ``None`` instead of the rows on ranks other than ``dst``."""
    problem = _rows_problem(tensors) or (_rank_problem("dst", dst, group) if fn == "gather_uneven" else None)
    if not is_distributed(group):
        _raise_local(fn, problem)
        return tensors, [next(iter(tensors.values())).shape[0]]
    first = next(iter(tensors.values()), None)
    device = _comm_device(group, first)
    # Everything that must match is folded into one checksum, so the happy path costs one fixed-size
    # exchange whatever the number of tensors; the details are exchanged only to explain a mismatch.
    layout = [[k, *_layout(t)] for k, t in tensors.items()] if problem is None else None
    signature = [[k, d, len(s), list(s[1:]), dev] for k, d, s, dev in layout] if layout is not None else None
    records, ranks = _agree(fn, group, device, problem, arg=_NONE if dst is None else dst,
                            payload=first.shape[0] if problem is None and first is not None else 0, layout=signature)
    if dst is not None:
        _check_same_arg(fn, "dst", records, ranks, "Pass the same dst on every rank.")
    if len({rec[_I_LAYOUT] for rec in records}) > 1:
        assert layout is not None
        _explain_layouts(fn, layout, ranks, group, device, whole_shape=False)
    counts = [rec[_I_PAYLOAD] for rec in records]
    receives = dst is None or dist.get_rank() == dst
    row_bytes = {k: math.prod(t.shape[1:]) * t.element_size() for k, t in tensors.items()}
    width = sum(row_bytes.values())
    if max(counts) == 0 or width == 0:
        empty = {k: t.new_empty((sum(counts), *t.shape[1:])) for k, t in tensors.items()}
        return (empty if receives else None), counts

    # One rank's block: tensor after tensor, each as raw bytes.
    flats = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()]
    blocks = _padded_exchange(flats, [c * width for c in counts], group, device, dst)
    if blocks is None:
        return None, counts
    result: dict[str, Tensor] = {}
    offsets = [0] * len(counts)
    for key, tensor in tensors.items():
        rb = row_bytes[key]
        if len(tensors) == 1 and min(counts) == max(counts):
            raw = blocks.view(-1)
        else:
            raw = torch.cat([blocks[r, offsets[r]: offsets[r] + c * rb] for r, c in enumerate(counts)])
        offsets = [o + c * rb for o, c in zip(offsets, counts)]
        result[key] = raw.view(tensor.dtype).reshape(sum(counts), *tensor.shape[1:]).to(tensor.device)
    return result, counts


# --------------------------------------------------------------------------------------------------
# objects


def _pickle(fn: str, obj: Any, safe: bool) -> tuple[Tensor | None, _Problem | None]:
    try:
        payload = to_bytes(obj)
    except Exception as err:  # noqa: BLE001 - pickling raises PicklingError, TypeError, AttributeError...
        return None, _Problem(TypeError, f"cannot pickle {_value(obj)}: {type(err).__name__}: {err}")
    if safe:  # refuse on the sender what every receiver would refuse, while every rank can still hear it
        try:
            from_bytes(payload, safe=True)
        except Exception as err:  # noqa: BLE001
            first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            return None, _Problem(TypeError, f"safe=True accepts plain data only (numbers, strings, lists, tuples, "
                                             f"dicts, CPU tensors); got {_value(obj)}: {first}")
    return payload, None


def broadcast_object(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None, safe: bool = False) -> Any:
    """Send a picklable object from global rank ``src`` to every rank of ``group``.

    All ranks must call it with the same ``src``; it blocks. The object on ranks other than ``src``
    is ignored (pass ``None``).

    Args:
        obj: the object (only ``src``'s counts).
        src: the global rank whose object every rank receives.
        group: the process group; the world by default.
        safe: unpickle with a restricted unpickler: plain data only (no globals but dtypes), no code can run on
            the receivers. Default ``False``: plain pickle (the peers must be trusted).

    Returns:
        ``src``'s object (on ``src`` itself, the very object passed in).

    Raises:
        TypeError: ``src``'s object cannot be pickled (or is not plain data with ``safe``), or ``src``
            is not an int; raised on every rank.
        RankMismatchError: ranks passed different ``src``.
    """
    fn = "broadcast_object"
    problem = _rank_problem("src", src, group)
    if not is_distributed(group):
        _raise_local(fn, problem)
        return obj
    device = _comm_device(group)
    rank = dist.get_rank()
    payload = None
    if problem is None and rank == src:
        payload, problem = _pickle(fn, obj, safe)
    records, ranks = _agree(fn, group, device, problem, arg=src,
                            payload=payload.numel() if payload is not None else _NONE, aux=int(safe))
    _check_same_arg(fn, "src", records, ranks, "Pass the same src on every rank.")
    _raise_if_differs(fn, "safe", {r: bool(rec[_I_AUX]) for r, rec in zip(ranks, records)},
                      "Pass the same safe= on every rank.")
    size = records[ranks.index(src)][_I_PAYLOAD]
    buf = payload.to(device) if payload is not None else torch.empty(size, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    return obj if rank == src else from_bytes(buf, safe)


def gather_objects(obj: Any, dst: int | None = None, group: dist.ProcessGroup | None = None, safe: bool = False
                   ) -> list[Any] | None:
    """Collect one picklable object from every rank, in rank order.

    All ranks must call it with the same ``dst``; it blocks. Objects are pickled and exchanged as
    one padded byte buffer per rank (tensors are better sent with :func:`all_gather_uneven`).

    Args:
        obj: this rank's object.
        dst: ``None``: every rank receives the list; a global rank: only that rank does.
        group: the process group; the world by default.
        safe: unpickle with a restricted unpickler: plain data only (no globals but dtypes), no code can run on
            the receivers. Default ``False``: plain pickle (the peers must be trusted).

    Returns:
        The list of every rank's object (group rank order), or ``None`` on ranks other than ``dst``.
        Not distributed: ``[obj]``.

    Raises:
        TypeError: some rank's object cannot be pickled (or is not plain data with ``safe``), or
            ``dst`` is not an int; raised on every rank.
        RankMismatchError: ranks passed different ``dst``.
    """
    fn = "gather_objects"
    problem = _rank_problem("dst", dst, group, optional=True)
    if not is_distributed(group):
        _raise_local(fn, problem)
        return [obj]
    device = _comm_device(group)
    payload = None
    if problem is None:
        payload, problem = _pickle(fn, obj, safe)
    records, ranks = _agree(fn, group, device, problem, arg=_NONE if dst is None else dst,
                            payload=payload.numel() if payload is not None else 0, aux=int(safe))
    _check_same_arg(fn, "dst", records, ranks, "Pass the same dst on every rank (None: everyone receives the list).",
                    lambda code: None if code == _NONE else code)
    _raise_if_differs(fn, "safe", {r: bool(rec[_I_AUX]) for r, rec in zip(ranks, records)},
                      "Pass the same safe= on every rank.")
    assert payload is not None
    sizes = [rec[_I_PAYLOAD] for rec in records]
    blocks = _padded_exchange([payload.to(device)], sizes, group, device, dst)
    if blocks is None:
        return None
    return [from_bytes(chunk, safe) for chunk in _trim(blocks, sizes)]


# --------------------------------------------------------------------------------------------------
# seeds


def validate_seed(seed: int | None, what: str = "seed", check_range: bool = True) -> None:
    """Raise TypeError unless ``seed`` is an int or None, ValueError if it is outside ``[0, MAX_SEED]``."""
    problem = _seed_problem(seed, what, check_range)
    if problem is not None:
        raise problem.kind(problem.message)


def _seed_problem(seed: Any, what: str = "seed", check_range: bool = True) -> _Problem | None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        return _Problem(TypeError, f"{what} must be an int or None; got {_value(seed)}.")
    if check_range and seed is not None and not 0 <= seed <= MAX_SEED:
        return _Problem(ValueError, f"{what} must be in [0, {MAX_SEED}]; got {seed}.")
    return None


def broadcast_seed(seed: int | None = None, src: int = 0, group: dist.ProcessGroup | None = None) -> int:
    """Make every rank agree on ``src``'s seed and return it.

    All ranks must call it with the same ``src``; it blocks. Only ``src``'s ``seed`` counts; when it
    is ``None``, ``src`` draws a fresh one from OS entropy. Seeds are in ``[0, 2**32 - 1]``. Every
    rank's ``seed`` must still be an int or None (a float anywhere is a mistake worth hearing about).

    Returns:
        The seed of ``src``, identical on every rank. Not distributed: ``seed`` (or a fresh one).

    Raises:
        TypeError: some rank's seed is not an int or None (raised on every rank).
        ValueError: ``src``'s seed is outside ``[0, 2**32 - 1]`` (raised on every rank).
        RankMismatchError: ranks passed different ``src``.
    """
    fn = "broadcast_seed"
    if not is_distributed(group):
        _raise_local(fn, _seed_problem(seed))
        return seed if seed is not None else secrets.randbelow(MAX_SEED + 1)
    rank = dist.get_rank()
    problem = _rank_problem("src", src, group) or _seed_problem(seed, check_range=rank == src)
    if problem is None and rank == src and seed is None:
        seed = secrets.randbelow(MAX_SEED + 1)
    # The seed rides in the record itself (-1: none, on ranks other than src).
    aux = seed if problem is None and seed is not None and rank == src else _NONE
    records, ranks = _agree(fn, group, _comm_device(group), problem, arg=src if problem is None else _NONE, aux=aux)
    _check_same_arg(fn, "src", records, ranks, "Pass the same src on every rank.")
    return int(records[ranks.index(src)][_I_AUX])
