"""Replacing the collective functions of the ``torch.distributed`` namespace, and restoring them.

Each wrapper records a fingerprint (unless the caller is trusted) and runs the collective so that
the training thread can still raise while it waits: the collective is issued with
``async_op=True`` and waited for in slices of ``poll`` seconds, between which the guard's failure
(found by the watchdog thread) is checked. A plain gloo collective cannot be cancelled, so a
collective given up this way is *abandoned*: its work and process group are kept alive for the
rest of the process, since destroying them would block until the process group's timeout.

Sliced waits are for gloo only. NCCL's ``Work.wait(timeout)`` is no poll: when the timeout expires it
aborts the group's communicators and raises (``ProcessGroupNCCL::WorkNCCL::wait``, torch 2.x), so one
slice shorter than a slow peer's step would end the run. On NCCL (and any backend not known to be
gloo) a collective runs as the caller wrote it: it is queued on the GPU stream and returns, and a rank
stuck behind it is ended by the watchdog's grace exit instead (see ``watchdog.py``).

Under ``torch.compile`` (while Dynamo traces, and while this thread runs compiled code, a graph break's
eager fallback included) a wrapper hands the call to torch's function first thing, so Dynamo sees the
function it maps to an in-graph collective: the same graphs and graph breaks as without the guard. Those
collectives are not recorded by the guard (torch's own checks apply, as under plain DDP).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.compiler import is_compiling

from lightning_sync._compat.torch_api import dynamo_callback
from lightning_sync.collectives import backend_for
from lightning_sync.guard.callsite import is_trusted
from lightning_sync.guard.fingerprint import describe_tensor, op_name

__all__ = ["GUARDED_OPS", "Interceptor", "abandon", "runs_on_gloo"]

#: Collectives of the torch.distributed namespace that the guard intercepts. Point-to-point calls
#: (send/recv) are left alone: their pairing legitimately differs by rank.
GUARDED_OPS = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "broadcast",
    "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single",
)
#: Of those, the ones whose tensor must have one shape on every rank: on gloo checked across ranks before
#: they run (one small metadata exchange), since gloo aborts on a size mismatch or returns garbage.
SAME_SHAPE_OPS = frozenset({"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast",
                            "reduce", "reduce_scatter_tensor", "reduce_scatter_single"})
# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (same arguments); both
# names are intercepted, whichever the caller uses.
# For each op: (position, keyword) of the tensor whose dtype and shape must match on every rank,
# and (position, keyword) of the argument that must match (reduce op, src or dst). None: nothing.
_MATCH: dict[str, tuple[tuple[int, str] | None, tuple[int, str] | None]] = {
    "all_reduce": ((0, "tensor"), (1, "op")),
    "all_gather": ((1, "tensor"), None),
    "all_gather_into_tensor": ((1, "input_tensor"), None),
    "all_gather_single": ((1, "input_tensor"), None),
    "reduce_scatter_single": ((0, "output"), (2, "op")),
    "broadcast": ((0, "tensor"), (1, "src")),
    "broadcast_object_list": (None, (1, "src")),
    "reduce": ((0, "tensor"), (1, "dst")),
    "reduce_scatter": ((0, "output"), (2, "op")),
    "reduce_scatter_tensor": ((0, "output"), (2, "op")),
    "gather": ((0, "tensor"), (2, "dst")),
    "gather_object": (None, (2, "dst")),
    "scatter": ((0, "tensor"), (2, "src")),
    "scatter_object_list": (None, (2, "src")),
}
# Positional index of async_op per op that has one: calls passing it positionally run as written.
_ASYNC_AT = {"all_reduce": 3, "all_gather": 3, "all_gather_into_tensor": 3, "all_gather_single": 3,
             "reduce_scatter_single": 4, "broadcast": 3, "barrier": 1,
             "reduce": 4, "reduce_scatter": 4, "reduce_scatter_tensor": 4, "gather": 4, "scatter": 4,
             "all_to_all": 3, "all_to_all_single": 5}
# Positional index of group per op (Lightning and user code pass it either way).
_GROUP_AT = {"all_reduce": 2, "all_gather": 2, "all_gather_into_tensor": 2, "all_gather_single": 2,
             "reduce_scatter_single": 3, "all_gather_object": 2, "broadcast": 2,
             "broadcast_object_list": 2, "barrier": 0, "reduce": 3, "reduce_scatter": 3, "reduce_scatter_tensor": 3,
             "gather": 3, "gather_object": 3, "scatter": 3, "scatter_object_list": 3, "all_to_all": 2,
             "all_to_all_single": 4}
_abandoned: list[Any] = []


def runs_on_gloo(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call goes to gloo (:func:`lightning_sync.collectives.backend_for` of its group and its first
    tensor's device: a mixed ``cpu:gloo,cuda:nccl`` group given CPU tensors does). Only then is its work waited
    for in slices (``Work.wait(timeout)`` repeated) and its shapes compared before it runs (gloo aborts the
    process on a size mismatch); on NCCL both would stop the CPU until the GPU stream has caught up, at every
    guarded call, and the watchdog compares the shapes in the fingerprints instead, a turn later."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    device = first.device if isinstance(first, Tensor) else "cpu"
    try:
        return backend_for(_arg(args, kwargs, (_GROUP_AT.get(name, 99), "group")), device) == "gloo"
    except (ValueError, RuntimeError):  # this rank is not a member: the call returns at once
        return False


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], where: tuple[int, str] | None) -> Any:
    if where is None:
        return None
    pos, name = where
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else None


def abandon(*objects: Any) -> None:
    """Keep ``objects`` (a pending gloo work, its process group) alive until the process ends.

    Their destructors would wait for the pending collective, i.e. until the process group's timeout
    (30 min by default), both in ``destroy_process_group`` and at interpreter exit.
    """
    for obj in objects:
        if obj is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
            _abandoned.append(obj)


def wait_in_slices(work: Any, guard: Any, group: Any, poll: timedelta) -> None:
    """Wait for a gloo ``work`` on ``group`` in slices of ``poll``, raising the guard's failure between two (the
    work and its group are then abandoned: see :func:`abandon`)."""
    while True:
        try:
            work.wait(poll)
            return
        except RuntimeError as err:
            if work.is_completed():
                # it may have completed between the slice's timeout and this check: a second wait returns at
                # once, or raises the collective's real error
                try:
                    work.wait(poll)
                    return
                except RuntimeError as real:
                    raise guard._explain(real) from None
        failure = guard._failure()
        if failure is not None:
            abandon(work, group)
            raise failure


def match_of(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any]:
    """What must agree across ranks for this call, and the tensor argument (for the DDP check)."""
    tensor_at, arg_at = _MATCH.get(name, (None, None))
    tensor = _arg(args, kwargs, tensor_at)
    match = describe_tensor(tensor) if tensor_at is not None else ""
    if arg_at is not None:
        value = _arg(args, kwargs, arg_at)
        match += f" {arg_at[1]}={op_name(value) if arg_at[1] == 'op' else (0 if value is None else value)}"
    return match.strip(), tensor


class Interceptor:
    """Installs and removes the wrappers for one ``CollectiveGuard``."""

    def __init__(self, guard: Any, poll: float = 0.1) -> None:  # a CollectiveGuard (core imports this module)
        self.guard = guard
        self.poll = timedelta(seconds=poll)
        self.originals: dict[str, Callable[..., Any]] = {}

    def install(self) -> None:
        for name in GUARDED_OPS:
            fn = getattr(dist, name, None)
            if fn is not None:
                self.originals[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        destroy = dist.destroy_process_group
        self.originals["destroy_process_group"] = destroy
        guard = self.guard

        @functools.wraps(destroy)
        def destroy_process_group(group: Any = None) -> None:
            if group is None or group is dist.GroupMember.WORLD:
                guard.uninstall()  # whoever destroys the strategy's group: the watchdog stops with it
            destroy(group)

        dist.destroy_process_group = destroy_process_group

    def uninstall(self) -> None:
        for name, fn in self.originals.items():
            setattr(dist, name, fn)
        self.originals = {}

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        guard = self.guard
        run = self.run
        checks_ddp = name == "all_reduce"
        same_shape = name in SAME_SHAPE_OPS
        group_at = (_GROUP_AT.get(name, 99), "group")

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if is_compiling() or dynamo_callback() is not None:  # under torch.compile: torch's own, unrecorded
                return fn(*args, **kwargs)
            frame = sys._getframe(1)
            if guard._depth or is_trusted(frame):
                return run(fn, name, args, kwargs)
            if guard._refusal is not None:
                guard._refuse(f"torch.distributed.{name}", frame)
            match, tensor = match_of(name, args, kwargs)
            if checks_ddp and guard._module is not None and isinstance(tensor, Tensor):
                guard._reject_managed(tensor, frame)
            group = _arg(args, kwargs, group_at)
            fp = guard._record(name, match, group, frame)
            if fp is None:
                return fn(*args, **kwargs)  # this rank is not in the group
            gloo = runs_on_gloo(name, args, kwargs)
            if gloo:
                if guard._confirms(group):  # every rank's token of this very call (shapes included) first
                    guard._confirm(fp, name, group, tensor if same_shape and isinstance(tensor, Tensor) else None)
                elif same_shape and isinstance(tensor, Tensor):
                    guard._check_layout(name, tensor, group)
            guard._depth += 1
            try:
                return run(fn, name, args, kwargs, gloo)
            finally:
                guard._depth -= 1

        guarded.__lightning_sync_guarded__ = True  # type: ignore[attr-defined]
        return guarded

    def run(self, fn: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
            gloo: bool | None = None) -> Any:
        """Run one collective so that the guard's failure can still be raised while it waits (``gloo``: the
        caller's :func:`runs_on_gloo` of this call, when it has it)."""
        guard = self.guard
        recorder = guard._recorder
        at = _ASYNC_AT.get(name)
        if recorder is None:
            return fn(*args, **kwargs)
        previous = recorder.enter(guard._stream)
        try:
            if at is None or kwargs.get("async_op") or len(args) > at or not (
                    gloo if gloo is not None else runs_on_gloo(name, args, kwargs)):
                try:
                    return fn(*args, **kwargs)
                except RuntimeError as err:
                    raise guard._explain(err)
            try:
                work = fn(*args, **{**kwargs, "async_op": True})
            except RuntimeError as err:
                raise guard._explain(err)
            if work is None:
                return None
            group = _arg(args, kwargs, (_GROUP_AT.get(name, 99), "group"))
            wait_in_slices(work, guard, group if group is not None else dist.group.WORLD, self.poll)
            return None
        finally:
            if previous is None:
                recorder.busy = None
