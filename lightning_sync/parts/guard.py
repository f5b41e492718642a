"""``GuardPart``: the collective guard installed for the run (``lightning_sync.guard``)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

from lightning_sync._compat import lightning_api as _compat
from lightning_sync.collectives import _backend_in_spec
from lightning_sync.guard.core import CollectiveGuard
from lightning_sync.guard.nccl import configure_nccl_flight_recorder
from lightning_sync.parts.base import Part

__all__ = ["GuardPart"]


class GuardPart(Part):
    """Checks every collective across ranks while the strategy is set up: a collective on some ranks
    only, or with other shapes, is a ``CollectiveMismatchError`` naming the call sites within
    ``guard_timeout``, never a hang. Also: NCCL's flight recorder on, the sampler check at train start,
    the run's last collectives compared at teardown (``closing_check``)."""

    def __init__(self, guard: CollectiveGuard) -> None:
        self.guard: CollectiveGuard | None = guard

    def callbacks(self, strategy: Any) -> Sequence[Any]:
        from lightning_sync.strategy_checks import SamplerCheck

        return (SamplerCheck(),) if self.guard is not None else ()

    def before_setup_distributed(self, strategy: Any) -> None:
        # (a mixed "cpu:gloo,cuda:nccl" group carries its CUDA tensors on NCCL: the recorder is for them)
        if self.guard is not None and _backend_in_spec(_compat.process_group_backend(strategy), "cuda") == "nccl":
            configure_nccl_flight_recorder()  # read by NCCL at process-group creation: set it first

    def setup_distributed(self, strategy: Any, fresh: bool) -> None:
        if self.guard is not None and not self.guard.install_if_real(
                context=lambda: _compat.current_hook_name(strategy.lightning_module)):
            self.guard = None

    def guarded(self, name: str, match: str, group: Any) -> Any:
        """A context in which a pair of collectives (Lightning's barrier + all_reduce) counts as one."""
        assert self.guard is not None
        return self.guard.guarded(name, match, group)

    def on_train_start(self, strategy: Any, trainer: Any) -> None:
        self._unguard_on_sigterm()

    def _unguard_on_sigterm(self) -> None:
        # Lightning's SIGTERM handler (installed after strategy.setup) broadcasts from rank 0. When a
        # peer died, torchrun SIGTERMs the survivors, and a guarded broadcast would wait for ranks that
        # are gone until the launcher's SIGKILL (30 s). Stop guarding first; unguarded, gloo fails at once.
        if self.guard is None or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if not callable(previous) or getattr(previous, "_lsync_unguard", False):
            return
        guard = self.guard

        def handler(signum: int, frame: Any) -> None:
            guard.uninstall(failed=True)
            previous(signum, frame)

        handler._lsync_unguard = True  # type: ignore[attr-defined]
        signal.signal(signal.SIGTERM, handler)  # Lightning's teardown restores the original handler

    def on_exception(self, strategy: Any, exception: BaseException) -> None:
        # No checked collectives after a failure: Lightning's SIGTERM handler broadcasts during
        # teardown, and the guard would wait for peers that are gone until the launcher's SIGKILL
        # (30 s under torchrun); unguarded, gloo fails at once. The peers are told why first.
        guard = self.guard
        if guard is not None and guard.active and guard.failure is None:
            guard.post_exception(exception, _compat.current_hook_name(strategy.lightning_module) or "")
        self.end(strategy.global_rank, failed=True, posted=guard is not None and guard.failure is None)

    def closing(self, strategy: Any) -> None:
        if self.guard is not None:
            # the run's last collectives were compared after they ran: a mismatch among them (ranks that
            # synced different metrics at the last epoch end) is raised here
            self.guard.closing_check()

    def after_teardown(self, strategy: Any) -> None:
        self.end(strategy.global_rank)

    def end(self, rank: int, failed: bool = False, posted: bool = False) -> None:
        """Stop guarding; after a failure (or an exception it ``posted``) rank 0 stays a few watchdog turns, so
        the peers read the error it posted in the store it hosts instead of only "the store stopped answering"
        once it is gone."""
        guard = self.guard
        if guard is None or not guard.active:
            return
        found = guard.failure is not None or posted
        guard.uninstall(failed=failed)
        if found and rank == 0:
            time.sleep(min(1.0, 5 * guard.interval))
