"""The private torch names lightning_sync uses (torch only: no Lightning import). See ``_compat``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBatchNormFunction
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase

from lightning_sync._compat import TouchPoint

__all__ = ["DDP_IGNORE_ATTR", "TOUCH_POINTS", "BatchNormBase", "TorchSyncBatchNormFunction", "all_gather_single", "ddp_ignored_names", "default_store",
           "raise_group_count"]

#: torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` (the old name is deprecated);
#: same semantics. Public either way; the shim lives here so it is written once.
def all_gather_single(output: Any, input: Any, group: Any = None, async_op: bool = False) -> Any:
    # Looked up at call time: while the collective guard replaces the namespace's functions, a rank
    # blocked here can still raise the guard's error (lightning_sync.guard.intercept).
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)

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


def default_store() -> Any:
    """The default process group's rendezvous store (a ``torch.distributed.Store``)."""
    return dist.distributed_c10d._get_default_store()


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
    TouchPoint("torch.distributed.distributed_c10d._world.group_count",
               "process groups of successive torchrun jobs (launcher)", _group_count_exists),
)
