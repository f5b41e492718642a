"""The guard's view of the default process group: every collective issued on it passes through one object.

While a :class:`~lightning_sync.guard.CollectiveGuard` is installed, the default ("world") group is a
:class:`WatchedGroup`: a ``torch.distributed.ProcessGroup`` (subclassed in Python, as torch allows and
torchft does) that holds the very backends of the group ``init_process_group`` made (gloo's, NCCL's:
the same objects, so torch's ``isinstance`` checks, splitting and flight recorder see what they saw) and
hands every collective method to them after the guard has seen the call. Nothing in the
``torch.distributed`` namespace is replaced: ``dist.all_reduce`` calls the group's ``allreduce`` as
always, DDP's C++ reducer calls it for each gradient bucket, functional collectives resolve the group by
its name. ``torch.compile`` traces the functions it knows (the same graphs and breaks as without the
guard); compiled code issues its collectives from torch's frames, which the guard trusts.

Who issued a call is read from the Python stack above the group method:

* from a ``torch.distributed`` function (``dist.all_reduce``, ``all_gather_object``...): the outermost such
  function names the collective, the first frame outside torch, Lightning and lightning_sync is the call
  site. A call made by torch itself (DDP's parameter broadcast at wrap, ``broadcast_object_list``'s inner
  broadcasts) or by lightning_sync's own symmetric code passes unchecked (``callsite.is_trusted``);
* from autograd (DDP's gradient buckets, on the training thread on CPU, on autograd's device threads on
  GPU where no Python frame exists): recorded as "DDP gradient all-reduce" at
  :data:`DDP_BUCKET_SITE`, so a collective one rank makes while the others are in backward is a mismatch
  found within a watchdog turn.

On gloo a user's call is confirmed before its data moves (``CollectiveGuard._confirm``) and a synchronous
one is waited for in slices, between which the guard's failure is raised (:class:`_SlicedWork`). On NCCL a
call is recorded and queued as written: no host-device synchronisation is added.

Collectives on subgroups a program makes itself (``dist.new_group``) are not seen unless the guard is
built with ``patch_namespace=True`` (``intercept.py``); lightning_sync's own groups record through
``lightning_sync.collectives``.
"""

from __future__ import annotations

import sys
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sync._compat.torch_api import (AUTOGRAD_MODULES, C10D_MODULES, DYNAMO_DISABLE_MODULE, WorkBase,
                                             current_autograd_node)
from lightning_sync.collectives import backend_for
from lightning_sync.errors import LightningSyncError
from lightning_sync.guard.callsite import is_trusted
from lightning_sync.guard.fingerprint import describe_tensor, op_name

__all__ = ["DDP_BUCKET_SITE", "WatchedGroup", "unwatch_default_group", "wait_sliced", "watch_default_group"]

#: The call site of DDP's gradient all-reduce in reports (no Python frame of the program issues it).
DDP_BUCKET_SITE = "DistributedDataParallel backward"

_ProcessGroup: Any = dist.ProcessGroup
_Work: Any = WorkBase
_C10D = C10D_MODULES
_AUTOGRAD = AUTOGRAD_MODULES
_current_autograd_node = current_autograd_node

# For each group method: where its tensor is (the one that must have one shape on every rank; None: no
# such tensor), whether it is a list there, and what else must agree ("op", "src", "dst": read from opts).
_METHODS: dict[str, tuple[int | None, str | None]] = {
    "allreduce": (0, "op"), "allreduce_coalesced": (0, "op"), "broadcast": (0, "src"),
    "allgather": (1, None), "allgather_coalesced": (1, None), "all_gather_single": (1, None),
    "_allgather_base": (1, None), "allgather_into_tensor_coalesced": (1, None),
    "all_gather_single_coalesced": (1, None),
    "reduce": (0, "dst"), "reduce_scatter": (0, "op"), "reduce_scatter_single": (0, "op"),
    "_reduce_scatter_base": (0, "op"), "reduce_scatter_tensor_coalesced": (0, "op"),
    "reduce_scatter_single_coalesced": (0, "op"),
    "gather": (1, "dst"), "scatter": (0, "src"),
    "alltoall": (None, None), "alltoall_base": (None, None), "all_to_all_single": (None, None),
    "barrier": (None, None),
}
#: Methods whose tensor must have one shape and dtype on every rank (gloo aborts the process otherwise).
_SAME_SHAPE = frozenset({"allreduce", "broadcast", "allgather", "all_gather_single", "_allgather_base", "reduce",
                         "reduce_scatter_single", "_reduce_scatter_base"})
#: torch.distributed function names (the outermost frame's) under which a tensor's shape may legitimately
#: differ by rank in the method calls they make (the object collectives pad their buffers: same shapes).
_POLL = timedelta(seconds=0.1)


def _first_tensor(value: Any) -> Any:
    while isinstance(value, (list, tuple)):
        if not value:
            return None
        value = value[0]
    return value


def _tensor_of(method: str, args: tuple[Any, ...]) -> Tensor | None:
    """The call's (first) tensor, or None."""
    at = _METHODS[method][0]
    tensor = _first_tensor(args[at]) if at is not None and len(args) > at else None
    return tensor if isinstance(tensor, Tensor) else None


def _match(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Tensor | None]:
    """What must agree across ranks for this call, and its tensor."""
    other = _METHODS[method][1]
    opts = kwargs.get("opts", args[-1] if args else None)
    tensor = _tensor_of(method, args)
    match = describe_tensor(tensor) if tensor is not None else ""
    if other is not None and opts is not None:
        if other == "op":
            value = getattr(opts, "reduceOp", None)
            if value is not None:
                match += f" op={op_name(getattr(value, 'op', value))}"
        else:
            match += f" {other}={getattr(opts, 'rootRank', 0)}"
    return match.strip(), tensor


def _issuer(frame: Any) -> tuple[str | None, Any]:
    """The torch.distributed function that issued this call (its outermost frame's name; None: not one) and the
    frame that called it (the caller of the group method when no torch.distributed function is on the stack)."""
    public = None
    while frame is not None and frame.f_globals.get("__name__") == DYNAMO_DISABLE_MODULE:
        frame = frame.f_back  # torch.compiler.disable's wrapper of the group method
    while frame is not None and frame.f_globals.get("__name__") in _C10D:
        if frame.f_globals.get("__name__") != "torch.distributed.c10d_logger":
            public = frame.f_code.co_name
        frame = frame.f_back
    return public, frame


class WatchedGroup(_ProcessGroup):  # type: ignore[misc]
    """The default process group while the guard is installed (see the module's docstring). Made by
    :func:`watch_default_group`; with no guard attached it only hands calls to the wrapped group's backends."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner.rank(), inner.size())
        self._inner = inner
        self._guard: weakref.ref[Any] | None = None
        self._gloo: dict[str, bool] = {}

    def attach(self, guard: Any) -> None:
        self._guard = weakref.ref(guard) if guard is not None else None

    @property
    def wrapped(self) -> Any:
        """The group ``init_process_group`` made."""
        return self._inner

    def name(self) -> str:
        return str(self._inner.name())

    # The wrapped group stays registered beside this one (torch_api.replace_default_group) and holds the same
    # backends: torch's destroy_process_group shuts them down (or aborts them) once, through it.
    def shutdown(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def _on_gloo(self, tensor: Tensor | None) -> bool:
        device = tensor.device.type if tensor is not None else "cpu"
        known = self._gloo.get(device)
        if known is None:
            try:
                known = self._gloo[device] = backend_for(self, device) == "gloo"
            except (ValueError, RuntimeError):
                known = False
        return known

    def _call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        run = getattr(self._inner, method)
        ref = self._guard
        guard = ref() if ref is not None else None
        if guard is None or not guard.active:
            return run(*args, **kwargs)
        public, caller = _issuer(sys._getframe(2))
        if guard._depth:  # inside a guarded operation: its fingerprint covers this call
            return _run(guard, self, run, args, kwargs, _tensor_of(method, args))
        module = caller.f_globals.get("__name__", "") if caller is not None else ""
        trusted = public is None or caller is None or is_trusted(caller)
        if trusted and method == "allreduce" and (
                caller is None or module in _AUTOGRAD or _current_autograd_node() is not None):
            return _bucket(guard, run, method, args, kwargs)  # DDP's gradient all-reduce (or its comm hook's)
        if trusted:
            if caller is None or module.startswith("torch."):
                # torch's own, the same code on every rank (DDP's parameter broadcast at wrap and its bucket
                # rebuild, FSDP2's all-gathers and reduce-scatters, a join hook's all-reduce, compiled code's
                # collectives): recorded, not confirmed
                site = ("autograd backward" if caller is None or module in _AUTOGRAD
                        else f"{module}.{caller.f_code.co_name}")
                match, _ = _match(method, args, kwargs)
                guard._record(public or method, match, None, None, site=site)
            # (lightning_sync's own symmetric code, a user's `with trusted():`: recorded by its own hooks, if at all)
            return _run(guard, self, run, args, kwargs, _tensor_of(method, args))
        if guard._refusal is not None:
            guard._refuse(f"torch.distributed.{public}", caller)
        match, tensor = _match(method, args, kwargs)
        if public == "all_reduce" and guard._module is not None and tensor is not None:
            guard._reject_managed(tensor, caller)
        fp = guard._record(public, match, None, caller)
        if fp is None:
            return run(*args, **kwargs)
        if self._on_gloo(tensor):
            same_shape = method in _SAME_SHAPE and tensor is not None
            if guard._confirms(None):  # every rank's token of this very call (shapes included) first
                guard._confirm(fp, public, None, tensor if same_shape else None)
            elif same_shape:
                guard._check_layout(public, tensor, None)
        return _run(guard, self, run, args, kwargs, tensor)


def _bucket(guard: Any, run: Any, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """DDP's gradient all-reduce (or its communication hook's): recorded, issued as DDP issued it."""
    tensor = _tensor_of(method, args)
    guard._record("DDP gradient all-reduce", describe_tensor(tensor) if tensor is not None else "", None, None,
                  site=DDP_BUCKET_SITE)
    try:
        return run(*args, **kwargs)
    except RuntimeError as err:
        raise guard._explain(err) from None


def _run(guard: Any, group: WatchedGroup, run: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
         tensor: Tensor | None) -> Any:
    """Issue the call; a gloo work comes back waited in slices (:class:`_SlicedWork`). ``tensor``: the call's."""
    try:
        work = run(*args, **kwargs)
    except RuntimeError as err:
        raise guard._explain(err) from None
    if work is None or not group._on_gloo(tensor):
        return work
    return _SlicedWork(work, guard, group)


class _SlicedWork(_Work):  # type: ignore[misc]
    """A gloo collective's work whose ``wait()`` waits in slices of 0.1 s, between which the guard's failure
    (found by the watchdog thread) is raised: a rank blocked in a collective its peers never reach raises the
    guard's error instead of waiting for gloo's timeout. A plain gloo collective cannot be cancelled, so one
    given up this way is abandoned (its work and group kept alive until the process ends: destroying them
    would block until the group's timeout)."""

    def __init__(self, inner: Any, guard: Any, group: WatchedGroup) -> None:
        super().__init__()
        self._inner = inner
        self._guard = weakref.ref(guard)
        self._group = group

    def wait(self, timeout: timedelta | None = None) -> bool:
        guard = self._guard()
        inner = self._inner
        if (timeout is not None and timeout != timedelta(0)) or guard is None or not guard.active:
            return bool(inner.wait(timeout) if timeout is not None else inner.wait())
        try:
            wait_sliced(inner, guard, self._group)
        except LightningSyncError as err:
            raise err.with_traceback(None)  # noqa: B904 - the guard's frames below it cut from the traceback
        return True

    def get_future(self) -> Any:
        return self._inner.get_future()

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())

    def is_success(self) -> bool:
        return bool(self._inner.is_success())

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return int(self._inner.source_rank())

    def result(self) -> Any:
        return self._inner.result()

    def synchronize(self) -> None:
        self._inner.synchronize()


def wait_sliced(work: Any, guard: Any, group: Any) -> None:
    """Wait for a gloo ``work`` on ``group`` in slices of 0.1 s, raising the guard's failure between two (and
    then abandoning the work, see :class:`_SlicedWork`); the rank counts as blocked in its last collective
    meanwhile."""
    from lightning_sync.guard.intercept import wait_in_slices

    recorder = guard._recorder
    previous = recorder.enter(guard._stream) if recorder is not None else None
    try:
        wait_in_slices(work, guard, group, _POLL)
    finally:
        if previous is None and recorder is not None:
            recorder.busy = None


def _method(name: str) -> Any:
    def method(self: WatchedGroup, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._call(name, args, kwargs)
        except LightningSyncError as err:
            # the guard's error, raised from here: the user's traceback ends at the collective they called (and
            # this line), not in the guard's frames below it
            raise err.with_traceback(None)  # noqa: B904 - the guard's frames below it cut from the traceback

    method.__name__ = method.__qualname__ = name
    # Dynamo, tracing a torch.distributed function it does not map to an in-graph collective, meets the group's
    # method: it must see what it sees on torch's own group (an opaque call, a graph break), not our Python
    return torch.compiler.disable(method)  # type: ignore[no-untyped-call]


for _name in _METHODS:
    if hasattr(_ProcessGroup, _name):
        setattr(WatchedGroup, _name, _method(_name))


def _backend_type(backend: Any) -> Any:
    types = _ProcessGroup.BackendType
    for cls_name, kind in (("ProcessGroupGloo", types.GLOO), ("ProcessGroupNCCL", types.NCCL)):
        cls = getattr(dist, cls_name, None)  # (absent from builds without that backend)
        if cls is not None and isinstance(backend, cls):
            return kind
    return types.CUSTOM


def watch_default_group(guard: Any) -> WatchedGroup | None:
    """Make the default group a :class:`WatchedGroup` reporting to ``guard`` (the same one again if it is one
    already). None where this torch keeps its groups in a way :func:`replace_default_group` does not know: the
    guard then falls back to replacing the namespace's functions."""
    from lightning_sync._compat.torch_api import replace_default_group

    current: Any = dist.group.WORLD
    if isinstance(current, WatchedGroup):
        current.attach(guard)
        return current
    watched = WatchedGroup(current)
    kinds = []
    for device in current._device_types:
        backend = current._get_backend(device)
        kind = _backend_type(backend)
        kinds.append(kind)
        watched._register_backend(device, kind, backend)
    if not kinds:
        return None
    watched._set_default_backend(_ProcessGroup.BackendType.NCCL if _ProcessGroup.BackendType.NCCL in kinds
                                 else kinds[0])
    watched._set_group_name(current.group_name)
    watched._set_group_desc(current.group_desc)
    if getattr(current, "bound_device_id", None) is not None:
        watched.bound_device_id = current.bound_device_id
    if not replace_default_group(current, watched):
        return None
    watched.attach(guard)
    return watched


def unwatch_default_group(watched: WatchedGroup) -> None:
    """Detach the guard (a group kept by a DDP module then only hands its calls on) and give torch back the group
    ``init_process_group`` made, if ``watched`` is still the default one."""
    from lightning_sync._compat.torch_api import replace_default_group

    watched.attach(None)
    if dist.is_initialized() and dist.group.WORLD is watched:
        replace_default_group(watched, watched.wrapped)
