"""``TeardownPart``: a clean end on every rank, the process group kept for the next trainer call or destroyed."""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

import torch.distributed as dist

from lightning_sync._compat import lightning_api as _compat
from lightning_sync.collectives import _device_barrier
from lightning_sync.errors import UnevenEvaluationError
from lightning_sync.parts.base import Part
from lightning_sync.peers import Peer, gather_peers, lost_peer_message
from lightning_sync.ranks import free_port

__all__ = ["TeardownPart", "destroy_at_exit", "destroy_default_group"]

log = logging.getLogger("lightning_sync.strategy")


class TeardownPart(Part):
    """Last in every strategy's parts. Knows each rank's host (to name a lost peer in an error),
    meets every rank before the group goes, and keeps the group where the ranks live on (Lightning's
    subprocess launcher, torchrun, SLURM) so ``validate``/``test``/``predict`` after ``fit`` reuse it as
    under Lightning's ``ddp``; it is destroyed cleanly at interpreter exit then."""

    def __init__(self) -> None:
        self.peers: list[Peer] = []

    def setup_distributed(self, strategy: Any, fresh: bool) -> None:
        if fresh:
            self.peers = gather_peers()  # host and address per rank: names a lost peer (on_exception)

    def on_exception(self, strategy: Any, exception: BaseException) -> None:
        # Every rank raises UnevenEvaluationError at the same point: the group is healthy, tear down cleanly
        # (a peer that skipped the barrier could re-join the next run's rendezvous on the old store).
        strategy._failed = not isinstance(exception, UnevenEvaluationError)
        if strategy._failed and strategy.global_rank == 0:
            from lightning_sync.launcher import HydraDDPLauncher, mark_job_failed

            if isinstance(strategy.launcher, HydraDDPLauncher):  # a Hydra job: its ranks go when it is reaped
                mark_job_failed()
        lost = lost_peer_message(exception, self.peers, strategy.global_rank)
        if lost:  # gloo only names an address: say which rank(s) that is
            log.error("lightning_sync: %s", lost)

    def closing(self, strategy: Any) -> None:
        if not keeps_process_group(strategy):
            # Free DDP's reducer before the process group goes: destroying them in the wrong order at
            # interpreter exit is what makes gloo processes SIGABRT ("terminate called without an active
            # exception") after a successful run. (destroy_at_exit does it for a kept group.)
            gc.collect()
            device = strategy.root_device
            # nobody destroys the group while a peer still uses it
            _device_barrier(device_index=device.index if device.type == "cuda" else None)

    def after_teardown(self, strategy: Any) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        if keeps_process_group(strategy) and not strategy._failed:
            # The next validate/test/predict/fit of this process reuses the group, as under Lightning's
            # ddp; it is destroyed cleanly (barrier first) when the interpreter exits.
            strategy._kept_group = True
            destroy_at_exit()
        else:
            if strategy._failed:
                gc.collect()
            env = strategy.cluster_environment
            assert env is not None
            moved = not strategy._failed and _move_to_fresh_port(env)
            destroy_default_group(env.main_address, env.main_port, wait=0.0 if moved else 3.0)


def _move_to_fresh_port(env: Any) -> bool:
    """For ranks the Hydra launcher started (they live on for the job's next trainer call, which creates
    a new group): rank 0 picks a free port and every rank's environment takes it, agreed over the group
    before it goes. The next group's store is then a new server on a new port: no rank can dial the old
    one while it is still closing (rank 0's teardown can outlast any fixed wait), nothing to wait for.
    False where the environment keeps its own port (srun, torchrun's agent store: unchanged)."""
    import os

    if "LSYNC_GLOBAL_RANK" not in os.environ or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return False  # every rank decides alike: all are ours, started with the same environment
    port = [free_port() if dist.get_rank() == 0 else 0]  # rank 0 serves the store
    dist.broadcast_object_list(port, src=0)
    return _compat.set_main_port(env, int(port[0]))


def keeps_process_group(strategy: Any) -> bool:
    """Whether the process group outlives this trainer call: yes for ranks that live on (Lightning's
    subprocess launcher, torchrun, SLURM); no for spawned/forked ranks (they end with the call) and
    under the Hydra launcher (every job of a sweep gets fresh ranks and its own group)."""
    if _compat.start_method(strategy) != "popen":
        return False
    from lightning_sync.launcher import HydraDDPLauncher

    return not isinstance(strategy.launcher, HydraDDPLauncher)


_exit_hook_registered = False


def destroy_at_exit(timeout: float = 60.0) -> None:
    """At interpreter exit: free what still holds the default group, wait for every rank (at most
    ``timeout`` s), then destroy it. Registered once per process (idempotent).

    Destroying gloo's group (and DDP's reducer) in the interpreter's own shutdown order is what makes
    processes abort after a successful run ("terminate called without an active exception"); a rank
    that crashed meanwhile makes the others wait ``timeout`` s, then exit without the barrier.
    """
    global _exit_hook_registered
    if _exit_hook_registered:
        return
    _exit_hook_registered = True
    import atexit
    from datetime import timedelta

    def destroy() -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        gc.collect()
        try:
            work = _device_barrier(async_op=True)  # on NCCL, wait(timeout) aborts the communicator if it expires
            if work is not None:
                work.wait(timedelta(seconds=timeout))
        except RuntimeError:  # a peer is gone: destroying could block until the group's own timeout
            return
        dist.destroy_process_group()

    atexit.register(destroy)


def destroy_default_group(main_address: str, main_port: int, wait: float = 3.0) -> None:
    """``destroy_process_group()``; ranks > 0 then wait (at most ``wait`` s) until rank 0's store is closed.

    Rank 0 serves the rendezvous store on ``MASTER_PORT``. A rank that raced ahead into the next
    ``trainer.fit``/``validate`` of the same script would otherwise reach the old server, still open
    while rank 0 tears down, and fail when it closes ("Connection was likely closed"). Under torchrun
    the agent serves the store and keeps it: nothing to wait for.
    """
    import os
    import socket

    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            socket.create_connection((main_address, main_port), timeout=0.5).close()
        except OSError:
            return  # refused: the old server is gone
        time.sleep(0.02)
