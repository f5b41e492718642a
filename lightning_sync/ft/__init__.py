"""Fault tolerance across replica groups, on torchft (``pip install "lightning_sync[ft]"``).

A run is R *replica groups*, each an ordinary (one-process, or ``torchrun``) training job; torchft's
lighthouse forms a quorum of the live groups every step, the groups average their gradients over torchft's
reconfigurable process group, and a group that died and was restarted takes the weights and optimizer state
of a live peer instead of a checkpoint file. ``lsync-ft-run`` (:mod:`lightning_sync.ft.launch`) starts the
lighthouse and the groups and restarts a group that dies; :func:`replica_context` builds, inside a group,
torchft's ``Manager`` bound to the group's own address (loopback on one machine), never every interface.

Environment each group gets from ``lsync-ft-run``: ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``,
``TORCHFT_LIGHTHOUSE`` (torchft's), ``LSYNC_FT_RESTART`` (0 in a group's first life, then 1, 2, ...) and
``LSYNC_FT_HOST`` (the address its servers bind to) and ``LSYNC_FT_MIN_REPLICAS`` (``--min-replicas``).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["ReplicaContext", "ReplicaGroup", "replica_context", "report_fatal", "require_torchft", "run_finished"]

log = logging.getLogger(__name__)

ENV_GROUP, ENV_GROUPS, ENV_LIGHTHOUSE, ENV_RESTART, ENV_HOST, ENV_MIN = (
    "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE", "LSYNC_FT_RESTART", "LSYNC_FT_HOST",
    "LSYNC_FT_MIN_REPLICAS")


def report_fatal(message: str) -> None:
    """Tell ``lsync-ft-run`` (``LSYNC_FT_FATAL``: a file of its own per group) that this group stops for a set-up
    error that every life would meet again: it is not restarted, and the run ends with ``message``. Call it just
    before raising."""
    path = os.environ.get("LSYNC_FT_FATAL")
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(message)
    except OSError:
        pass  # the launcher then restarts the group as after any failure, and it refuses again


def run_finished() -> bool:
    """Whether a replica group of this run ended its training with success (``lsync-ft-run`` creates the file
    ``LSYNC_FT_FINISHED`` names then): a restarted group that finds none ahead of it has nothing left to do."""
    path = os.environ.get("LSYNC_FT_FINISHED", "")
    return path != "" and os.path.exists(path)


def require_torchft() -> None:
    """Raise a clear ``ImportError`` naming the extra when torchft is not installed."""
    try:
        import torchft  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "lightning_sync's fault tolerance runs on torchft, which is not installed. Install the extra: "
            "pip install \"lightning_sync[ft]\" (torchft>=0.2).") from err


@dataclass(frozen=True)
class ReplicaGroup:
    """This process's replica group, as ``lsync-ft-run`` described it in the environment."""

    group_id: int
    num_groups: int
    restart: int
    lighthouse: str
    host: str
    min_replicas: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ReplicaGroup:
        env = os.environ if env is None else env
        missing = [k for k in (ENV_GROUP, ENV_GROUPS, ENV_LIGHTHOUSE) if not env.get(k)]
        if missing:
            raise RuntimeError(
                f"not inside a replica group: {', '.join(missing)} not set. Start the training command under "
                "lsync-ft-run --replicas R -- CMD ... (or set them as lsync-ft-run does: docs/fault_tolerance.md).")
        return cls(group_id=int(env[ENV_GROUP]), num_groups=int(env[ENV_GROUPS]), restart=int(env.get(ENV_RESTART, 0)),
                   lighthouse=env[ENV_LIGHTHOUSE], host=env.get(ENV_HOST, "127.0.0.1"),
                   min_replicas=int(env.get(ENV_MIN, 1) or 1))


@dataclass
class ReplicaContext:
    """torchft's ``Manager`` of this process and what it needs kept alive (the group's store, on its rank 0), and
    torchft's process group across the groups (``pg``, the one the manager reconfigures at each new quorum)."""

    group: ReplicaGroup
    manager: Any
    store: Any
    pg: Any

    def allreduce_mean(self, tensor: Any) -> Any:
        """Start averaging ``tensor`` in place over the groups of the current quorum; return a future that completes
        with ``tensor``, never with an error: a failure (a group lost in the middle, torchft's timeout) is reported
        to the manager, so that the step is not committed (``should_commit``), and ``tensor`` then holds garbage
        the step drops. What ``manager.allreduce(tensor)`` does (a group outside the quorum sends zeros; the sum is
        divided by the quorum's size), without blocking the caller: DDP's backward goes on computing the next
        gradient buckets while this one crosses the groups, as under ``ddp``. (torchft 0.2.0's own DDP hook waits
        for each bucket, and the future its ``Manager.allreduce`` hands back ends the process when a group is lost
        in the middle of it.)"""
        import torch
        from torch.distributed import AllreduceOptions, ReduceOp

        manager = self.manager
        if manager.errored() is None:  # (otherwise the step is lost already: nothing to send)
            manager.wait_quorum()
            participants = manager.num_participants()
            if not manager.is_participating():
                tensor.zero_()
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]

            def averaged(fut: Any) -> Any:
                try:
                    fut.value()
                except Exception as err:  # noqa: BLE001 (reported: the step is not committed)
                    _report_failed_allreduce(manager, err)
                    return tensor
                if participants > 1:
                    tensor.div_(participants)
                return tensor

            try:
                return self.pg.allreduce([tensor], opts).get_future().then(averaged)
            except Exception as err:  # noqa: BLE001 (a process group torchft has aborted: reported, the step lost)
                _report_failed_allreduce(manager, err)
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(tensor)
        return done

    def close(self) -> None:
        """Stop the manager's servers and threads (every process, at its end)."""
        self.manager.shutdown(wait=False)
        self.store = None


def replica_context(state_dict: Callable[[], dict[str, Any]], load_state_dict: Callable[[dict[str, Any]], None], *,
                    min_replica_size: int = 1, timeout: timedelta = timedelta(seconds=30),
                    quorum_timeout: timedelta = timedelta(seconds=120), use_async_quorum: bool = True,
                    init_sync: bool = True, group: ReplicaGroup | None = None, rank: int = 0, world_size: int = 1,
                    share_port: Callable[[int | None], int] | None = None) -> ReplicaContext:
    """torchft's ``Manager`` for this process of its replica group: the group's TCP store and manager server on the
    group's host (``LSYNC_FT_HOST``, loopback by default), kept by the group's rank 0, torchft's gloo process group
    across groups (rank ``r`` of every group in one ring), and the recovery state sent over that process group (no
    HTTP server: rank ``r`` of a recovering group is sent rank ``r``'s state of a live one). ``state_dict`` /
    ``load_state_dict``: what a restarted group takes from a live peer (the weights, the optimizer state, and
    anything else that must be equal: a step counter, the data position). ``init_sync``: torchft's (groups at step
    0 take the weights of one of them; ``False`` where every group builds the same weights from one seed).

    ``rank`` / ``world_size``: this process's within its group (several processes: ``torchrun`` under
    ``lsync-ft-run --nproc-per-replica``); ``share_port``: with several, a collective over the group that takes
    the store's port from rank 0 (which passes it; the others pass None) to every rank."""
    require_torchft()
    import torch
    from torch.distributed import TCPStore  # type: ignore[attr-defined]
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    from lightning_sync._compat.torchft_api import manager_server_bound_to, quiet_manager_log

    quiet_manager_log()
    group = group or ReplicaGroup.from_env()
    if world_size > 1 and share_port is None:
        raise ValueError(f"replica_context(world_size={world_size}): give share_port, the group's exchange of the "
                         "store's port.")
    kept: tuple[Any, Any] | None = None
    port: int | None = None
    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((group.host, 0))
        listener.listen(128)
        port = int(listener.getsockname()[1])
        # a TCPStore server listens on every interface unless handed a socket already bound
        kept = (TCPStore(group.host, port, is_master=True, wait_for_workers=False, master_listen_fd=listener.fileno()),
                listener)
    if share_port is not None:
        port = share_port(port)
    assert port is not None
    pg = ProcessGroupGloo(timeout=timeout)
    transport = PGTransport(pg, timeout=timeout, device=torch.device("cpu"))
    with manager_server_bound_to(group.host):
        manager = Manager(pg=pg, load_state_dict=load_state_dict, state_dict=state_dict,
                          min_replica_size=min_replica_size, use_async_quorum=use_async_quorum, timeout=timeout,
                          init_sync=init_sync,
                          quorum_timeout=quorum_timeout, connect_timeout=timeout, rank=rank, world_size=world_size,
                          store_addr=group.host, store_port=port, lighthouse_addr=group.lighthouse,
                          replica_id=f"replica_{group.group_id}", hostname=group.host, checkpoint_transport=transport)
    return ReplicaContext(group=group, manager=manager, store=kept, pg=pg)


def _report_failed_allreduce(manager: Any, err: Exception) -> None:
    """One line (torchft's own all-reduce logs a traceback), and the error to the manager: the step is not committed."""
    if manager.errored() is None:
        first_line = next(iter(str(err).splitlines()), "")[:300]
        log.warning("ddp_sync_ft: an all-reduce across the replica groups failed (%s: %s); this step is not committed "
                    "and is run again with the groups still alive.", type(err).__name__, first_line)
    manager.report_error(err)
