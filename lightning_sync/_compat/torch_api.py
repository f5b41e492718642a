"""The private torch names lightning_sync uses (torch only: no Lightning import). See ``_compat``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBatchNormFunction
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase

from lightning_sync._compat import TouchPoint

__all__ = ["DDP_IGNORE_ATTR", "LIGHTNING_RESULT_FILE", "TOUCH_POINTS", "BatchNormBase", "TorchSyncBatchNormFunction",
           "all_gather_single", "ddp_ignored_names", "default_store", "dynamo_callback", "flight_recorder_dump",
           "init_process_group_kwargs",
           "rank_not_in_group", "raise_group_count", "replace_default_group", "WorkBase", "C10D_MODULES",
           "AUTOGRAD_MODULES", "DYNAMO_DISABLE_MODULE", "current_autograd_node", "register_buffer_sync_hook"]

#: torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` (the old name is deprecated);
#: same semantics. Public either way; the shim lives here so it is written once.
def all_gather_single(output: Any, input: Any, group: Any = None, async_op: bool = False) -> Any:
    # Looked up at call time: while the collective guard replaces the namespace's functions, a rank
    # blocked here can still raise the guard's error (lightning_sync.guard.intercept).
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def _no_dynamo_callback() -> None:
    return None


try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _get_eval_frame_callback
except ImportError:  # a build without Dynamo: no code of this thread ever runs under torch.compile
    _get_eval_frame_callback = _no_dynamo_callback

#: Dynamo's frame callback of this thread (C, ~20 ns): not None while the thread runs code under
#: ``torch.compile`` (a compiled function's frames and the eager fallbacks of its graph breaks), None in
#: eager code, including a ``torch.compiler.disable`` region. An alias, not a wrapper: it is called on the
#: collective guard's hot path (``lightning_sync.guard.intercept``).
dynamo_callback: Any = _get_eval_frame_callback


#: The attribute DDP reads for names it must not synchronise (set by
#: ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``).
DDP_IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"


def ddp_ignored_names(module: torch.nn.Module) -> set[str]:
    """Parameter and buffer names DDP leaves alone in ``module``."""
    return set(getattr(module, DDP_IGNORE_ATTR, ()))


def raise_group_count(minimum: int) -> None:
    """Make torch number the next default process group's store keys from ``minimum`` on.

    ``destroy_process_group()`` resets torch's group counter; under torchrun the next job's group
    would reuse the previous one's store keys and dial dead peers.
    """
    from torch.distributed import distributed_c10d as c10d

    world = getattr(c10d, "_world", None)
    if world is not None:
        world.group_count = max(world.group_count, minimum)


#: The base class of a collective's work handle, subclassable in Python (``torch.distributed._Work``).
WorkBase: Any = getattr(dist, "_Work", None) or torch._C._distributed_c10d.Work
#: Modules whose frames make up a torch.distributed collective function (its body, its logging decorator,
#: the functional collectives).
C10D_MODULES = frozenset({"torch.distributed.distributed_c10d", "torch.distributed.c10d_logger",
                          "torch.distributed._functional_collectives"})
#: The module of ``torch.compiler.disable``'s wrapper frames.
DYNAMO_DISABLE_MODULE = "torch._dynamo.eval_frame"
#: Modules whose frame calls into autograd's engine (``loss.backward()``): a collective issued with one of them
#: as the innermost Python frame comes from a backward hook (DDP's reducer).
AUTOGRAD_MODULES = frozenset({"torch.autograd.graph", "torch.autograd", "torch._tensor"})


def _no_autograd_node() -> None:
    return None


#: The autograd node this thread is executing (None outside backward): C, cheap.
current_autograd_node: Any = getattr(torch._C, "_current_autograd_node", _no_autograd_node)


def replace_default_group(old: Any, new: Any) -> bool:
    """Make ``new`` the default process group in place of ``old``: ``dist.group.WORLD``, every collective given no
    group, and the name functional collectives resolve reach ``new``. ``old`` stays registered beside it (same
    ranks, backend and store: a reference taken before, e.g. a DDP module built earlier, keeps working), unless
    ``new`` is the one ``old`` stood for (``replace_default_group(watched, original)``), in which case ``old``'s
    entries go. Returns False (nothing changed) where ``old`` is not the default group or this torch keeps its
    groups otherwise.
    """
    from torch.distributed import distributed_c10d as c10d

    world = getattr(c10d, "_world", None)
    names = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag")
    registry: Any = getattr(torch._C, "_distributed_c10d", None)
    if (world is None or world.default_pg is not old or not callable(getattr(c10d, "_update_default_pg", None))
            or not all(isinstance(getattr(world, name, None), dict) for name in names)
            or not isinstance(getattr(world, "tags_to_pg", None), dict)
            or not callable(getattr(registry, "_register_process_group", None))
            or not callable(getattr(registry, "_unregister_process_group", None))):
        return False
    restoring = new in world.pg_map  # new was there before old stood in for it
    for name in names:
        table = getattr(world, name)
        if old in table:
            if restoring:
                del table[old]
            else:
                # new first, so that a search of the tables (by ranks, by tag) finds it before old
                items = [(new, table[old]), *table.items()]
                table.clear()
                table.update(items)
    for groups in world.tags_to_pg.values():
        if old in groups:
            if restoring:
                groups[:] = [group for group in groups if group is not old]
            elif new not in groups:
                groups.insert(0, new)
    c10d._update_default_pg(new)
    registry._unregister_process_group(old.group_name)
    registry._register_process_group(old.group_name, new)
    return True


def default_store() -> Any:
    """The default process group's rendezvous store (a ``torch.distributed.Store``)."""
    return dist.distributed_c10d._get_default_store()


def rank_not_in_group(group: Any) -> bool:
    """Whether this process is outside ``group`` (collectives on it return at once, doing nothing)."""
    return bool(dist.distributed_c10d._rank_not_in_group(group))


def flight_recorder_dump() -> bytes | None:
    """torch's flight-recorder trace (a pickle), or None where this build has none.

    Private and absent from some builds; only called when the user turned the recorder on
    (``TORCH_FR_BUFFER_SIZE``), for the guard's hang report.
    """
    c10d: Any = getattr(torch._C, "_distributed_c10d", None)
    # _dump_fr_trace since the recorder became backend-neutral (2025); _dump_nccl_trace from torch 2.2
    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        return None
    try:
        return dump(False, True, False)  # type: ignore[no-any-return]
    except TypeError:  # the first versions took no arguments
        return dump()  # type: ignore[no-any-return]


def init_process_group_kwargs(device_id: Any) -> dict[str, Any]:
    """``device_id=`` for ``init_process_group`` where torch takes it (torch 2.3 on; Lightning does the same)."""
    import inspect

    if device_id is None or "device_id" not in inspect.signature(dist.init_process_group).parameters:
        return {}
    return {"device_id": device_id}


#: The file of Lightning's logged-metric results (``_ResultMetric.compute`` syncs a metric there):
#: the guard names the metric when it sees that frame. A file name, not an import: the guard never
#: imports Lightning. Checked in ``lightning_api.TOUCH_POINTS``.
LIGHTNING_RESULT_FILE = "result.py"


def _can_replace_group() -> bool:
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    return (all(isinstance(getattr(world, name, None), dict) for name in
                ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg"))
            and callable(getattr(c10d, "_update_default_pg", None))
            and callable(getattr(torch._C._distributed_c10d, "_register_process_group", None))
            and callable(getattr(torch._C._distributed_c10d, "_unregister_process_group", None)))


def register_buffer_sync_hook(ddp_module: Any, state: Any, hook: Any) -> None:
    """DDP's buffer sync (its broadcast of rank 0's buffers before a training forward, where ``broadcast_buffers``
    asks for it) done by ``hook(state, {name: buffer})`` instead, at the same point
    (``DistributedDataParallel._register_buffer_comm_hook``, ``_BufferCommHookLocation.PRE_FORWARD``)."""
    from torch.nn.parallel.distributed import _BufferCommHookLocation

    ddp_module._register_buffer_comm_hook(state, hook, _BufferCommHookLocation.PRE_FORWARD)


def _ddp_has_buffer_hooks() -> bool:
    from torch.nn.parallel import distributed as ddp

    location = getattr(ddp, "_BufferCommHookLocation", None)
    return callable(getattr(ddp.DistributedDataParallel, "_register_buffer_comm_hook", None)) \
        and hasattr(location, "PRE_FORWARD") and callable(getattr(ddp.DistributedDataParallel, "_sync_buffers", None))


def _group_count_exists() -> bool:
    from torch.distributed import distributed_c10d as c10d

    return isinstance(c10d._world.group_count, int)


def _ddp_reads_ignore_attr() -> bool:
    import inspect

    source = inspect.getsource(torch.nn.parallel.DistributedDataParallel)
    return DDP_IGNORE_ATTR in source


TOUCH_POINTS: tuple[TouchPoint, ...] = (
    TouchPoint("torch.nn.modules.batchnorm._BatchNorm", "base class of lightning_sync.SyncBatchNorm",
               lambda: issubclass(torch.nn.BatchNorm2d, BatchNormBase)
               and callable(getattr(BatchNormBase, "_check_input_dim", None))),
    TouchPoint("torch.nn.modules._functions.SyncBatchNorm", "CUDA fast path of lightning_sync.SyncBatchNorm",
               lambda: issubclass(TorchSyncBatchNormFunction, torch.autograd.Function)),
    TouchPoint("DistributedDataParallel's _ddp_params_and_buffers_to_ignore",
               "SyncBatchNorm statistics kept out of DDP's buffer broadcast", _ddp_reads_ignore_attr),
    TouchPoint("torch.distributed.distributed_c10d._get_default_store",
               "PredictionWriter: ranks wait for rank 0's merge on the store, not in a collective",
               lambda: callable(getattr(dist.distributed_c10d, "_get_default_store", None))),
    TouchPoint("torch.distributed.distributed_c10d._rank_not_in_group",
               "the collective guard skips collectives on groups this rank is not in",
               lambda: rank_not_in_group(None) in (True, False)),
    TouchPoint("torch._C._distributed_c10d._dump_fr_trace or _dump_nccl_trace (optional: absent from some builds)",
               "the guard's hang report quotes torch's flight recorder when it is on",
               lambda: any(callable(getattr(getattr(torch._C, "_distributed_c10d", None), name, None))
                           for name in ("_dump_fr_trace", "_dump_nccl_trace"))
               or not hasattr(torch._C, "_distributed_c10d")),
    TouchPoint("torch._C._dynamo.eval_frame.get_eval_frame_callback",
               "the collective guard hands collectives run under torch.compile to torch unrecorded",
               lambda: _get_eval_frame_callback is not _no_dynamo_callback and dynamo_callback() is None),
    TouchPoint("torch.distributed.distributed_c10d._world (its group tables), _update_default_pg, "
               "torch._C._distributed_c10d._register_process_group",
               "the collective guard watches the default group (lightning_sync.guard.group)", _can_replace_group),
    TouchPoint("torch.distributed._Work (Python subclass), torch._C._current_autograd_node, the c10d modules",
               "the watched group's sliced waits and its reading of who issued a collective; invariant dropout "
               "telling a recomputation in backward (activation checkpointing) from a forward",
               lambda: WorkBase is not None and current_autograd_node is not _no_autograd_node
               and current_autograd_node() is None
               and all(__import__(m, fromlist=["_"]) is not None for m in C10D_MODULES)),
    TouchPoint("DistributedDataParallel._register_buffer_comm_hook, _BufferCommHookLocation.PRE_FORWARD",
               "ddp_sync_ft: DDP's buffer broadcast done across the replica groups of a step's quorum",
               _ddp_has_buffer_hooks),
    TouchPoint("torch.distributed.distributed_c10d._world.group_count",
               "process groups of successive torchrun jobs (launcher)", _group_count_exists),
)
