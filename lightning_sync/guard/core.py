"""``CollectiveGuard``: the life cycle that ties the parts together.

Hot path per guarded collective (the training thread): find the call site, append a fingerprint
to this rank's ring, run the collective. Everything that talks to other ranks happens on the
watchdog thread (:mod:`~lightning_sync.guard.watchdog`) through the store protocol
(:mod:`~lightning_sync.guard.protocol`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import sys
import tempfile
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sync import collectives
from lightning_sync._compat.torch_api import (DDP_IGNORE_ATTR, all_gather_single, default_store, flight_recorder_dump,
                                             rank_not_in_group)
from lightning_sync.errors import CollectiveMismatchError, LightningSyncError, RankMismatchError
from lightning_sync.guard import report
from lightning_sync.guard.callsite import CallSites, is_trusted
from lightning_sync.guard.fingerprint import Fingerprint, Recorder
from lightning_sync.guard.group import (DDP_BUCKET_SITE, WatchedGroup, unwatch_default_group, wait_sliced,
                                        watch_default_group)
from lightning_sync.guard.intercept import Interceptor
from lightning_sync.guard.protocol import Exchange, stream_key
from lightning_sync.guard.watchdog import Monitor, StoreLostError, dump_stacks

__all__ = ["CollectiveGuard"]

_CLOSING = "end of guarded block"
_LAYOUT_FIX = ("Pass tensors of one shape and dtype on every rank; for rows that differ in number per rank use "
               "lightning_sync.collectives.all_gather_uneven (gathers) or pad to a common length first.")
_generation = 0  # rank 0's count of installs (see install): keeps store keys apart
_active: weakref.WeakSet[CollectiveGuard] = weakref.WeakSet()


class _Guarded:
    """Context manager for one guarded operation made of several collectives (``strategy.reduce``); ``as``
    gives whether every rank's token of it was compared before its data moves (``confirm_first``)."""

    __slots__ = ("_guard", "_confirmed")

    def __init__(self, guard: CollectiveGuard, confirmed: bool = False) -> None:
        self._guard, self._confirmed = guard, confirmed

    def __enter__(self) -> bool:
        self._guard._depth += 1
        return self._confirmed

    def __exit__(self, *exc: object) -> None:
        self._guard._depth -= 1


class _Refusing:
    """``CollectiveGuard.refusing``'s context manager (nestable: the innermost refusal applies)."""

    __slots__ = ("_guard", "_error", "_previous")

    def __init__(self, guard: CollectiveGuard, error: Callable[[str, str], BaseException]) -> None:
        self._guard, self._error = guard, error
        self._previous: Callable[[str, str], BaseException] | None = None

    def __enter__(self) -> None:
        self._previous = self._guard._refusal
        self._guard._refusal = self._error

    def __exit__(self, *exc: object) -> None:
        self._guard._refusal = self._previous


class _Nothing:
    __slots__ = ()

    def __enter__(self) -> bool:
        return False  # nothing was confirmed

    def __exit__(self, *exc: object) -> None:
        return None


_NOTHING = _Nothing()


class CollectiveGuard:
    """Checks that every rank issues the same collectives; names the rank that does not.

    ``strategy="ddp_sync"`` installs one after the process group is created and removes it at
    teardown; pass ``SyncDDPStrategy(guard=False)`` to turn it off, ``guard_timeout=...`` to change
    the timeout, or ``guard=CollectiveGuard(...)`` for the other settings. Without Lightning::

        dist.init_process_group(...)
        with CollectiveGuard(timeout=30):
            ...  # every collective on the default group (DDP's included) and lightning_sync's is checked

    Each rank records a fingerprint of every collective (op, dtype/shape, reduce op/src/dst, call
    site, Lightning hook) locally; a background thread publishes them in batches and compares the
    ranks' sequences. Ranks that issued different collectives raise
    :class:`~lightning_sync.CollectiveMismatchError` within a fraction of a second (the training
    thread raises at its next collective, or while waiting in one); a rank that makes no progress
    for ``timeout`` seconds is named by the others with its last collective; a dead or frozen rank
    is named as such. A rank blocked where Python cannot raise writes the report and its stack and
    ends (exit code 70).

    Args:
        timeout: seconds without progress (a rank waiting in a collective the others do not reach,
            a rank whose heartbeat stopped) before the guard fails the run. It must exceed the
            longest stretch one rank legitimately works alone between two collectives (e.g. rank 0
            writing a large checkpoint while the others wait in the barrier that follows).
        hang_timeout: seconds after which a collective that has not finished (every rank in it,
            just slow) makes the rank dump its stack and last collectives to ``stream``
            (default: ``timeout``).
        match_call_sites: also require the same call site on every rank. Catches two different
            collectives with identical shapes pairing up silently (the values of one metric summed
            with another's); turn it off for programs that issue the same collective from different
            lines on different ranks on purpose.
        stream: where the watchdog writes (default: the rank's stderr).
        history: how many of this rank's last collectives each heartbeat carries for reports.
        check_every: accepted for compatibility; the guard no longer waits before collectives, so
            there is nothing to sample (every collective is compared).
        interval: seconds between two turns of the watchdog (publish, compare, heartbeat).
        kill_stopped_peers: when a rank of a failed run is found stopped on this host (SIGSTOP, a
            debugger), end it with SIGKILL so that no process is left behind. Off by default: the
            report names the stopped rank and leaves it alone.
        exit_grace: seconds after a failure that the training thread did not raise (it is blocked where
            Python cannot, e.g. in DDP's C++ all-reduce) before the rank writes its report and ends
            with exit code 70. Default ``max(30, min(timeout, 120))``; ``math.inf``: never.
        confirm_first: on gloo, before a checked collective's data moves, every rank's token of it
            (op, shapes, call site) is compared in one all-reduce of two int64 on a gloo group of the
            guard's own. Done by default for calls on the world group, where DDP's gradient
            all-reduce runs (a check there, or a collective on one rank only, would pair on the wire
            with a gradient bucket, and gloo aborts the process on the size mismatch);
            ``confirm_first=True`` does it for subgroups too (through the store: a watchdog turn), for
            programs whose other collectives the guard does not see (FSDP2's all-gathers and
            reduce-scatters). Otherwise a same-shape call on a subgroup compares shapes with one small
            exchange on its own group. A rank that never reaches the call is named after ``timeout``.
        patch_namespace: also replace the collective functions of the ``torch.distributed`` namespace while
            installed, so that calls on subgroups the program makes itself (``dist.new_group``) are checked
            too. Off by default: the guard watches the default process group (:mod:`.group`), which sees every
            collective on it, DDP's gradient buckets and torch's own included, and leaves torch's namespace
            as it is (``torch.compile`` traces as without the guard).
    """

    def __init__(self, timeout: float = 120.0, hang_timeout: float | None = None, match_call_sites: bool = True,
                 stream: IO[str] | None = None, history: int = 8, check_every: int = 1,
                 interval: float = 0.1, confirm_first: bool = False, kill_stopped_peers: bool = False,
                 exit_grace: float | None = None, patch_namespace: bool = False) -> None:
        if not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"CollectiveGuard(check_every={check_every!r}): must be a positive int.")
        if not timeout > 0:
            raise ValueError(f"CollectiveGuard(timeout={timeout!r}): the timeout must be a positive number of seconds.")
        if hang_timeout is not None and not hang_timeout > 0:
            raise ValueError(f"CollectiveGuard(hang_timeout={hang_timeout!r}): must be positive seconds or None.")
        if exit_grace is not None and not exit_grace > 0:
            raise ValueError(f"CollectiveGuard(exit_grace={exit_grace!r}): must be positive seconds (math.inf: "
                             "never), or None for the default.")
        if not 0 < interval <= 5:
            raise ValueError(f"CollectiveGuard(interval={interval!r}): must be in (0, 5] seconds.")
        self.check_every = check_every
        self.timeout = float(timeout)
        self._hang_timeout = float(hang_timeout) if hang_timeout is not None else None
        self.match_call_sites = match_call_sites
        self.stream = stream
        self.history_size = history
        self.interval = interval
        self.confirm_first = bool(confirm_first)
        self.kill_stopped_peers = bool(kill_stopped_peers)
        self.exit_grace = None if exit_grace is None else float(exit_grace)
        self.patch_namespace = bool(patch_namespace)
        self._side_group: Any = None  # the guard's own gloo group for token confirmations (made at install on gloo)
        self._flags_group: Any = None  # and one for own_broadcast only
        self._cache: _GroupCache | None = None  # what this install shares with the others on its group
        self._closings = 0  # closing checks of this install (their store keys)
        self.context: Callable[[], str | None] | None = None
        self._recorder: Recorder | None = None
        self._monitor: Monitor | None = None
        self._exchange: Exchange | None = None
        self._interceptor: Interceptor | None = None
        self._watched: WatchedGroup | None = None
        self._sites: CallSites | None = None
        self._stream = "w"
        self._rank = 0
        self._depth = 0
        self._refusal: Callable[[str, str], BaseException] | None = None  # see refusing()
        self._module: weakref.ref[torch.nn.Module] | None = None
        self._write_lock = threading.Lock()
        self.checks = 0  # guarded collectives so far (for tests and the benchmark)

    @property
    def hang_timeout(self) -> float:
        """Seconds before a slow collective dumps stacks (follows ``timeout`` unless set)."""
        return self._hang_timeout if self._hang_timeout is not None else self.timeout

    @hang_timeout.setter
    def hang_timeout(self, value: float) -> None:
        self._hang_timeout = float(value)

    @property
    def history(self) -> list[str]:
        """This rank's last collectives, as shown in reports."""
        if self._recorder is None:
            return []
        return [f"#{fp.seq} {fp.describe()}" for s in self._recorder.streams() for fp in self._recorder.last(s)]

    # ------------------------------------------------------------------ life cycle

    def __getstate__(self) -> dict[str, Any]:
        # The strategy travels to spawned ranks pickled: send the settings, not the live state.
        return {"timeout": self.timeout, "hang_timeout": self._hang_timeout, "match_call_sites": self.match_call_sites,
                "history": self.history_size, "check_every": self.check_every, "interval": self.interval,
                "confirm_first": self.confirm_first, "kill_stopped_peers": self.kill_stopped_peers,
                "exit_grace": self.exit_grace}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    @property
    def active(self) -> bool:
        """True between :meth:`install` and :meth:`uninstall`."""
        return self._monitor is not None

    @property
    def failure(self) -> BaseException | None:
        """The error the guard found (None while all is well); the training thread raises it."""
        return self._monitor.failure if self._monitor is not None else None

    def __enter__(self) -> CollectiveGuard:
        self.install()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        failure = self._failure()
        if exc is not None and failure is not None and exc is not failure:
            # e.g. DDP's all-reduce failed because the guard ended a frozen peer: the guard's report says why
            self.uninstall(failed=True)
            raise failure from exc
        try:
            if exc_type is None and self.active and dist.is_initialized():
                # A closing check: a rank that skipped a collective the others made, or a mismatch in
                # the last collectives, is reported here rather than going unnoticed.
                self.closing_check()
        finally:
            self.uninstall(failed=exc is not None)

    def closing_check(self) -> None:
        """Wait until every rank's collectives so far were compared (every rank must call it; blocks for at
        most ``timeout`` s). The last collectives of a run are compared after they ran: without this, a
        mismatch among them (ranks syncing different metrics at the last epoch end) would only be printed.

        Raises:
            CollectiveMismatchError: as :meth:`check`.
        """
        if not (self.active and dist.is_initialized()):
            return
        fp = self._record(_CLOSING, "", None, sys._getframe(1))
        recorder = self._recorder
        if fp is None or recorder is None or self._closing_agreed():
            return
        self._wait_confirmed(fp, _CLOSING)
        # and each subgroup's last collective: a rank publishes its world stream before its subgroups',
        # so the world stream compared says nothing of them
        for stream in recorder.streams():
            last = recorder.last(stream, 1)
            if stream != "w" and last:
                self._wait_confirmed(last[0], _CLOSING, stream)

    def _closing_agreed(self) -> bool:
        """Every rank's world-stream sequence equal, known from one exchange through the store instead of the
        watchdog's turns (~7 ms a trainer call here); ``False`` when it cannot be
        shown.

        Each rank posts its next seq, a CRC32 of the fingerprints it still holds (the ring's last
        ``capacity``, the closing one included), whether its subgroups' streams are all compared, and
        how far its neighbour comparison got, then reads everyone's. All equal, every subgroup stream
        compared, everything older than the held ones compared: agreed (a CRC collision, 2**-32, would
        let a difference among the held ones pass).
        Anything else (a rank that skipped a collective, other metrics synced last, the store gone):
        ``False``, and the watchdog's comparison names the difference (:meth:`_wait_confirmed`). While
        it waits for a rank that has not arrived, the watchdog's failure is raised as in every check.
        """
        recorder, monitor, exchange = self._recorder, self._monitor, self._exchange
        if recorder is None or monitor is None or exchange is None or exchange.neighbour("w") is None:
            return False
        seq = recorder.next_seq("w")
        held = recorder.last("w", seq)
        digest = 0
        for fp in held:
            digest = zlib.crc32("\x1f".join(fp.key(self.match_call_sites)).encode() + b"\x1e", digest)
        # subgroups' streams are not in the digest: the fast path holds only when each is compared already
        # (posted, so that every rank takes the same path)
        others = int(all(monitor.verified(s) >= recorder.next_seq(s) - 1 for s in recorder.streams() if s != "w"))
        rows = self._closing_rows(f"{seq},{len(held)},{digest},{others},{monitor.verified('w')}")
        if rows is None:
            return False
        return (all(row[:4] == rows[0][:4] for row in rows) and rows[0][3] == 1
                and min(row[4] for row in rows) >= seq - len(held) - 1)

    def _closing_rows(self, mine: str) -> list[list[int]] | None:
        """Every rank's closing line through the store; ``None`` where the watchdog's
        path must decide (a failure, the store gone)."""
        recorder, monitor, exchange = self._recorder, self._monitor, self._exchange
        assert recorder is not None and monitor is not None and exchange is not None
        self._closings += 1
        keys = [f"closing/{self._closings}/{r}" for r in range(dist.get_world_size())]
        store = exchange.store
        previous = recorder.enter("w")
        try:
            store.set(keys[self._rank], mine)
            woken, pause = 0.0, 0.0001
            while not store.check(keys):  # non-blocking: the watchdog shares this store client
                if self._failure() is not None or not monitor.running:
                    return None  # the watchdog's path raises its failure (or accepts a store host that left first)
                now = time.monotonic()
                if now - woken > 0.01:  # keep the watchdog turning while this rank waits, as checks do
                    monitor.wake()
                    woken = now
                # the ranks arrive within a millisecond or two of each other at the end of a trainer call: poll
                # often at first (a fixed 2 ms sleep cost the first rank ~1 ms a call on average), then back off
                time.sleep(pause)
                pause = min(2 * pause, 0.002)
            return [[int(x) for x in bytes(v).decode().split(",")] for v in store.multi_get(keys)]
        except RuntimeError:
            return None  # the store stopped answering: the watchdog's path says why
        finally:
            if previous is None:
                recorder.busy = None

    def install(self, context: Callable[[], str | None] | None = None) -> None:
        """Start guarding: needs an initialised default process group; every rank must call it.

        Args:
            context: returns a label for where the program is (the strategy passes the current
                Lightning hook, e.g. ``"training_step"``), shown beside call sites.
        """
        global _generation
        if self.active:
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("CollectiveGuard.install: torch.distributed is not initialised; call "
                               "dist.init_process_group first.")
        # Every install needs fresh store keys (torchrun's store outlives a process group), and every
        # rank must use the same ones: a Hydra sweep's rank 0 has installed once per job, its other
        # ranks are new processes each job. So the highest count wins (one unguarded all-reduce, which
        # also tells every rank whether any rank's last install on this group failed: see _GroupCache).
        cache = _group_cache()
        agreed = torch.tensor([_generation + 1, int(cache.dirty)],
                              dtype=torch.int64, device=collectives._comm_device(None))
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        _generation, dirty = (int(x) for x in agreed.tolist())
        if dirty:
            cache.clients.clear()
            cache.groups = None
        cache.dirty = False
        self._cache = cache
        self._rank = dist.get_rank()
        self._depth = 0
        self._closings = 0
        self._sites = CallSites(context)
        self.context = context
        self._recorder = Recorder(capacity=max(64, self.history_size))
        # torchrun's store also outlives a restart of the worker group: the attempt keeps keys apart
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = _side_store(f"lightning_sync/guard/{attempt}/{_generation}/", min(self.timeout, 10.0), cache)
        self._exchange = Exchange(store, self._rank, dist.get_world_size(), self.match_call_sites)
        self._exchange.start()
        self._monitor = Monitor(self._exchange, self._recorder, self.timeout, self.hang_timeout, self._write,
                                interval=self.interval, grace=self.exit_grace, kill_stopped=self.kill_stopped_peers)
        self._monitor.group_alive = dist.is_initialized
        self._monitor.owner_stop = self.uninstall
        self._monitor.start()
        if self._side_group is None and _on_gloo(None):
            # Two gloo groups of the guard's own (none on NCCL): a call's token compared on one of them
            # cannot pair on the wire with a collective the other ranks make on the program's group
            # (DDP's gradient all-reduce, FSDP2's all-gathers), where gloo would abort on the size mismatch.
            if cache.groups is None:
                cache.groups = (dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
            self._side_group, self._flags_group = cache.groups
        self._watched = watch_default_group(self)
        if self.patch_namespace or self._watched is None:
            if self._watched is None:
                warnings.warn("lightning_sync: this torch keeps its process groups in a way the collective guard "
                              "does not know; it watches the torch.distributed functions instead of the default "
                              "group (collectives torch issues in C++ other than DDP's are not seen).", stacklevel=3)
            self._interceptor = Interceptor(self)
            self._interceptor.install()
        collectives.register_guard(self._collectives_hook, self._collectives_mismatch, self._record_exchange)
        _active.add(self)

    def install_if_real(self, context: Callable[[], str | None] | None = None) -> bool:
        """:meth:`install` when a real default process group exists; else warn once and return False.

        A test that mocks ``torch.distributed.init_process_group`` leaves none: the strategy then
        runs with the guard off instead of failing.
        """
        if dist.is_available() and dist.is_initialized():
            self.install(context)
            return True
        warnings.warn("lightning_sync: the collective guard is off: the strategy found no initialised "
                      "torch.distributed process group (init_process_group mocked?).", stacklevel=2)
        return False

    def uninstall(self, failed: bool = False) -> None:
        """Stop guarding, stop the watchdog thread and restore ``torch.distributed`` (idempotent).

        Args:
            failed: the guarded program failed (an exception left it); the next install on this process
                group then makes its own groups and store connection anew (as after a guard's own failure).
        """
        if self._interceptor is not None:
            self._interceptor.uninstall()
            self._interceptor = None
        if self._watched is not None:
            unwatch_default_group(self._watched)
            self._watched = None
        collectives.unregister_guard(self._collectives_hook)
        # (kept for the next install on this default group, unless this one failed: see _GroupCache)
        self._side_group = self._flags_group = None
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            monitor.write_report()  # a failure's report, once (its message only where no traceback carries it)
            monitor.leave()
            if (failed or monitor.failure is not None or self._depth) and self._cache is not None:
                self._cache.dirty = True  # (self._depth: ended from inside a guarded collective)
        self._cache = None
        _active.discard(self)

    def post_exception(self, exception: BaseException, where: str = "") -> None:
        """Tell the other ranks why this one is leaving (an exception of the program, not the guard's own
        finding): their watchdogs read it within a turn, and each raises ``LightningSyncError`` quoting it
        (at its next collective, or when its blocked one fails as this process ends) instead of "rank N
        died". Nothing is posted for the guard's own failure (posted already) or when the guard is off."""
        exchange, monitor = self._exchange, self._monitor
        if exchange is None or monitor is None or monitor.failure is not None:
            return
        text = report.first_line(exception)
        message = (f"rank {self._rank} raised {type(exception).__name__}{': ' + text if text else ''}"
                   f"{' in ' + where if where else ''}; the run cannot go on without it: its log has the traceback")
        try:
            exchange.post_abort(f"LightningSyncError: {message}")
        except Exception:  # noqa: BLE001 - the store may be gone too: the peers then name this rank as dead
            pass

    def watch_module(self, module: torch.nn.Module) -> None:
        """Reject ``all_reduce`` calls on ``module``'s parameters or gradients (DDP already syncs them); for a
        ``DistributedDataParallel`` module, also record its gradient all-reduces (:meth:`watch_ddp`)."""
        self._module = weakref.ref(getattr(module, "module", module))  # names as the user knows them
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            self.watch_ddp(module)

    def watch_ddp(self, model: torch.nn.parallel.DistributedDataParallel) -> bool:
        """Record every gradient bucket DDP all-reduces in backward as a guarded collective, so that a
        collective one rank makes while the others are in backward is a mismatch found within a watchdog turn,
        not a stall found after ``timeout``. On the watched default group (:mod:`.group`) the group sees the
        buckets itself; on another group through DDP's public communication hook, whose all-reduce gives the
        numbers DDP gives without one, to the bit. DDP takes one hook, so a model that has one already
        (``DDPStrategy(ddp_comm_hook=...)`` on CUDA) is left as it is: returns False then."""
        if self._watched is not None and model.process_group is self._watched:
            return True
        return self._hook_ddp(model)

    def _hook_ddp(self, model: torch.nn.parallel.DistributedDataParallel) -> bool:
        """Record every gradient bucket DDP all-reduces in backward as a guarded collective, so that a
        collective one rank makes while the others are in backward is a mismatch found within a watchdog turn,
        not a stall found after ``timeout``. Through DDP's public communication hook, whose all-reduce gives
        the numbers DDP gives without one, to the bit; DDP takes one hook, so a model that has one already
        (``DDPStrategy(ddp_comm_hook=...)`` on CUDA) is left as it is: returns False then."""
        try:
            model.register_comm_hook(_BucketHookState(self, model.process_group), _recording_allreduce_hook)
        except RuntimeError:  # a hook registered another way (a builtin hook): DDP allows one
            return False
        return True

    def guarded(self, op: str, match: str = "", group: Any = None) -> Any:
        """Context manager: record ``op`` as one collective, then run the block (nested collectives pass).

        Args:
            op: the collective's name as shown in errors.
            match: what must be identical on every rank (dtype, shape, reduce op ...).
            group: the process group the collective runs on (``None``: the world).
        """
        if not self.active or self._depth:
            return _NOTHING
        fp = self._record(op, match, group, sys._getframe(1))
        if fp is None:
            return _NOTHING
        confirmed = self._confirms(group)
        if confirmed:
            try:
                self._confirm(fp, op, group)
            except LightningSyncError as err:
                raise err.with_traceback(None)  # noqa: B904 - the guard's frames below it cut from the traceback
        return _Guarded(self, confirmed)

    def refusing(self, error: Callable[[str, str], BaseException]) -> Any:
        """Context manager: inside, a user's collective (one the guard would check, not a trusted caller's
        nor torchmetrics') raises ``error(op, call_site)`` instead of running. For blocks that every rank
        enters together and in which no collective of the user's can be right (a training step with a
        stand-in batch under ``uneven_batches="join"``): every rank reaches the same call and raises."""
        return _Refusing(self, error)

    def _refuse(self, op: str, frame: Any) -> None:
        refusal = self._refusal
        if refusal is None or frame.f_globals.get("__name__", "").startswith("torchmetrics."):
            return
        caller = frame
        while caller is not None and caller.f_globals.get("__name__") == "lightning_sync.collectives":
            caller = caller.f_back  # a call through lightning_sync.collectives: who made it
        if caller is not None and caller is not frame and is_trusted(caller):
            return  # lightning_sync's own symmetric collectives (SyncBatchNorm's input check, ...)
        site = self._sites.find(frame) if self._sites is not None else "?"
        raise refusal(op, site)

    def check(self, op: str, match: str = "", group: Any = None, _skip: int = 1) -> None:
        """Record ``op`` and wait until the neighbouring rank's sequence confirms it (a synchronous check).

        Every rank of ``group`` must call it; it blocks for at most ``timeout`` seconds.

        Raises:
            CollectiveMismatchError: on every rank, when ranks recorded different collectives or
                call sites, or when a rank did not get there within ``timeout``.
        """
        fp = self._record(op, match, group, sys._getframe(_skip))
        if fp is not None:
            self._wait_confirmed(fp, op)

    def own_broadcast(self, op: str, match: str, tensor: Tensor) -> None:
        """The strategy's per-step broadcast from rank 0 (its step flags: one layout, ``match``, from one
        call site), recorded as one guarded collective on the world's stream. On gloo it runs on a group of
        the guard's own that carries nothing else, so it can pair with no other collective and needs no
        confirmation first (a check and the broadcast would make two round trips a step): a rank that
        skipped it is found by the watchdog's comparison of the sequences. Otherwise (NCCL, a tensor not on
        the CPU) it is the guarded broadcast on the world group."""
        on_cpu = tensor.device.type == "cpu"
        group = self._flags_group if on_cpu and self.active and not self._depth else None
        if group is None:
            with self.guarded(op, match):
                dist.broadcast(tensor, src=0)
            return
        self._record(op, match, None, sys._getframe(1))
        self._depth += 1  # run (waited for in slices) by the interceptor, not checked again
        try:
            wait_sliced(dist.broadcast(tensor, src=0, group=group, async_op=True), self, group)
        finally:
            self._depth -= 1

    def _confirms(self, group: Any) -> bool:
        """Whether a checked call on ``group`` first compares every rank's token of it on the guard's own group
        (:meth:`_confirm`): on gloo, for calls on the world group (where DDP's gradient all-reduce runs), and
        for every call with ``confirm_first``. Elsewhere a same-shape call compares shapes on its own group."""
        if self._side_group is None or not _on_gloo(group):
            return False
        return self.confirm_first or group is None or group is dist.GroupMember.WORLD

    def _confirm(self, fp: Fingerprint, op: str, group: Any, tensor: Tensor | None = None) -> None:
        """Compare every rank's token of ``fp`` on the guard's own group before the call's data moves
        (subgroups: through the store, one watchdog turn). Raises on every rank on a mismatch; ``tensor``: the
        call needs one shape on every rank, and where that alone differs the error shows every rank's."""
        side = self._side_group
        if side is None or not (group is None or group is dist.GroupMember.WORLD):
            self._wait_confirmed(fp, op)
            return
        self._side_exchange(fp, op, side, tensor)

    def _side_exchange(self, fp: Fingerprint, op: str, side: Any, tensor: Tensor | None = None) -> None:
        """Compare every rank's token of ``fp`` on the guard's own group ``side``; raise on every rank where they
        differ (with every rank's layout where only ``tensor``'s shape or dtype does)."""
        # The same 16 bytes from every rank whatever the call (ranks at different calls still pair on the
        # wire, where gloo aborts on a size mismatch): the call's token beside its negation, under MAX: equal
        # everywhere iff max == -min, and every rank reads the same answer. Two elements: gloo's all-reduce of
        # three or more takes 2.2-2.8x as long as one of two, at 2 and 4 ranks (bench_guard.py --elements; an
        # all-gather 1.3-1.8x). Only where they differ, on every rank alike, the tokens and the tokens without
        # the tensor's layout are gathered, to name the ranks and tell a shape that alone differs.
        key = fp.key(self.match_call_sites)
        token = zlib.crc32("\x1f".join(key).encode()) or 1
        both = torch.tensor([token, -token])
        self._depth += 1  # the exchange itself is not a user's collective
        try:
            wait_sliced(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=side, async_op=True), self, side)
            high, minus_low = both.tolist()
            if high == -minus_low:
                return
            site = zlib.crc32("\x1f".join(key[:1] + key[2:]).encode()) or 1  # (the call without its layout)
            every = torch.empty(2 * dist.get_world_size(), dtype=torch.int64)
            wait_sliced(all_gather_single(every, torch.tensor([token, site]), group=side, async_op=True), self, side)
        finally:
            self._depth -= 1
        rows = every.view(-1, 2).tolist()
        tokens = [row[0] for row in rows]
        if len(set(tokens)) == 1:
            return
        if tensor is not None and len({row[1] for row in rows}) == 1:
            # every rank is at this very call, with another shape or dtype (ranks' last batches of different
            # sizes): every rank shows its layout, over the same group, where nothing else can pair with it
            self._check_layout(op, tensor, side)
        raise self._collectives_mismatch(op, None, dict(enumerate(tokens)))

    def _wait_confirmed(self, fp: Fingerprint, op: str, stream: str | None = None) -> None:
        """Block until the neighbouring rank's sequence of ``stream`` (default: the last collective's)
        confirms ``fp`` (or raise the guard's failure)."""
        monitor, recorder = self._monitor, self._recorder
        stream = self._stream if stream is None else stream
        if monitor is None or recorder is None or monitor.exchange.neighbour(stream) is None:
            return
        previous = recorder.enter(stream)
        woken = 0.0
        # The watchdog names a rank that does not get here within `timeout`; this bound is for the guard's own
        # faults (a confirmation no rank can give), which must end in an error too, never in a wait
        window = 2 * self.timeout + 10 * self.interval
        deadline = time.monotonic() + window
        try:
            while True:
                now = time.monotonic()
                if now > deadline:
                    raise LightningSyncError(
                        f"rank {self._rank}: {op!r} (collective #{fp.seq} of stream {stream!r}) was not confirmed by "
                        f"the neighbouring rank within {window:.0f} s "
                        f"although no rank was found missing (compared up to #{monitor.verified(stream)}; "
                        f"{recorder.dropped} of this rank's never published). This is the guard's fault, not the "
                        "program's: please report it; SyncDDPStrategy(guard=False) runs without the guard.")
                if now - woken > 0.01:  # a turn every 10 ms while waiting, not every interval
                    monitor.wake()
                    woken = now
                failure = monitor.failure
                if isinstance(failure, StoreLostError) and op == _CLOSING:
                    # The rank hosting the store verified this rank's sequence and left first (its
                    # comparisons cover every pair of neighbours but this one, which is redundant).
                    return
                failure = self._failure()
                if failure is not None:
                    raise failure
                if monitor.verified(stream) >= fp.seq:
                    return
                if not monitor.running:  # nobody left to confirm it (the guard was ended meanwhile)
                    raise LightningSyncError(
                        f"rank {self._rank}: the collective guard stopped while {op!r} waited for the other ranks' "
                        "confirmation (its process group was destroyed, or the guard uninstalled from another "
                        "thread); the check cannot complete.")
                time.sleep(0.005)
        finally:
            if previous is None:
                recorder.busy = None

    # ------------------------------------------------------------------ hot path

    def _failure(self) -> BaseException | None:
        """The failure, for the caller to raise (so the report need not repeat its message)."""
        monitor = self._monitor
        if monitor is None:
            return None
        failure = monitor.failure
        if failure is not None:
            monitor.raised = True
        return failure

    def _record(self, op: str, match: str, group: Any, frame: Any, site: str | None = None) -> Fingerprint | None:
        recorder, sites = self._recorder, self._sites
        if recorder is None or sites is None:
            return None
        failure = self._failure()
        if failure is not None:
            raise failure
        if group is None or group is dist.GroupMember.WORLD:
            self._stream = "w"
        else:
            if rank_not_in_group(group):
                return None
            self._stream = stream_key(dist.get_process_group_ranks(group))
        self.checks += 1
        return recorder.record(self._stream, op, match, site if site is not None else sites.find(frame))

    def _collectives_hook(self, name: str, group: Any) -> int:
        """lightning_sync.collectives: record its call; the token goes into its metadata exchange."""
        if self._depth:  # inside a guarded operation (its own fingerprint covers it): nested calls pass
            return 0
        if self._refusal is not None:
            self._refuse(f"lightning_sync.collectives.{name}", sys._getframe(1))
        fp = self._record(name, "", group, sys._getframe(1))
        if fp is None:
            return 0
        if self._confirms(group):
            try:
                self._confirm(fp, name, group)
            except LightningSyncError as err:
                raise err.with_traceback(None)  # noqa: B904 - the guard's frames below it cut from the traceback
        return zlib.crc32("\x1f".join(fp.key(self.match_call_sites)).encode()) or 1

    def _record_exchange(self, name: str, match: str, group: Any, site: str | None) -> None:
        """lightning_sync's own exchanges (SyncBatchNorm's): recorded as guarded collectives, not confirmed (every
        rank of a matching program makes them alike, and a confirmation would double their round trips)."""
        if not self._depth:
            self._record(name, match, group, sys._getframe(2), site=site)

    def _collectives_mismatch(self, name: str, group: Any, tokens: dict[int, int]) -> BaseException:
        """The metadata exchange saw different tokens: name every rank's call (waits for their rings)."""
        monitor, recorder = self._monitor, self._recorder
        assert monitor is not None and recorder is not None
        stream = self._stream
        seq = recorder.next_seq(stream) - 1
        fps: dict[int, Fingerprint | None] = {}
        deadline = time.monotonic() + max(5.0, 30 * self.interval)
        while time.monotonic() < deadline:  # the others publish within one watchdog turn
            try:
                fps = monitor.fingerprints_at(stream, seq)
            except Exception:  # noqa: BLE001 - store trouble: report what we have
                break
            if all(fps.get(r) is not None for r in tokens):
                break
            time.sleep(self.interval)
        mine = next((fp for fp in recorder.last(stream, 64) if fp.seq == seq), None)
        fps[self._rank] = mine
        error = report.mismatch(seq, {r: fps.get(r) for r in tokens})
        monitor.fail(error, stack=False, raised=True)
        return error

    def _explain(self, err: BaseException) -> BaseException:
        """A collective failed (a peer's connection closed ...): say which rank died, if one did. The error
        returned keeps ``err`` as its ``backend_error`` (raise it ``from None``: one traceback a rank)."""
        failure = self._failure()
        if failure is not None:
            _keep_backend_error(failure, err)
            return failure
        monitor, recorder = self._monitor, self._recorder
        if monitor is None or recorder is None:
            return err
        time.sleep(0.2)  # a peer that just died: let its process become a zombie or go
        # A peer that raised (a mismatch it saw first) and left closes the connection under us: its
        # posted error says why, which beats gloo's "Connection closed by peer".
        failure = self._failure() or monitor.peer_abort()
        if failure is not None:
            _keep_backend_error(failure, err)
            monitor.raised = True
            return failure
        lost = monitor.lost_peers(self._stream)
        if not lost:
            return err
        last = recorder.last(self._stream, 1)
        where = f"while rank {self._rank} waited in guarded collective " + (
            f"#{last[-1].seq} {last[-1].describe()}" if last else "")
        error = report.lost(lost, err, where)
        _keep_backend_error(error, err)
        monitor.fail(error, raised=True)
        return error

    def _check_layout(self, name: str, tensor: Tensor, group: Any) -> None:
        """Before a collective that needs one shape on every rank runs: compare the ranks' shapes and dtypes
        (gloo aborts the process on a size mismatch, or returns garbage). Every rank raises the same error."""
        self._depth += 1
        try:
            collectives._check_same_layout(tensor, f"torch.distributed.{name}", _LAYOUT_FIX, group, quick=True)
        except CollectiveMismatchError:
            raise
        except RankMismatchError as err:
            error = CollectiveMismatchError(str(err), err.values)
            if self._monitor is not None:
                self._monitor.fail(error, post=False, stack=False, may_exit=False, raised=True)
            raise error from None
        finally:
            self._depth -= 1

    def _reject_managed(self, tensor: Tensor, frame: Any) -> None:
        module = self._module() if self._module is not None else None
        if module is None:
            return
        ptr = tensor.untyped_storage().data_ptr()
        for pname, param in module.named_parameters():
            if param.untyped_storage().data_ptr() == ptr:
                what = (f"parameter {pname!r}", "DDP broadcast rank 0's parameters when it wrapped the model and keeps "
                        "replicas identical by averaging gradients, so an all_reduce(SUM) of the weights multiplies "
                        f"them by the world size ({dist.get_world_size()})")
            elif param.grad is not None and param.grad.untyped_storage().data_ptr() == ptr:
                what = (f"the gradient of {pname!r}", "DDP already averaged it across ranks during backward, so an "
                        f"all_reduce(SUM) makes it {dist.get_world_size()} x the average gradient")
            else:
                continue
            site = self._sites.find(frame) if self._sites is not None else "?"
            raise LightningSyncError(
                f"rank {self._rank} at {site}: dist.all_reduce of {what[0]}, which DistributedDataParallel "
                f"manages: {what[1]}. Remove the all_reduce (DDP does the synchronisation), or, if the tensor is "
                f"meant to be synchronised by hand, exclude it from DDP ({DDP_IGNORE_ATTR}).")

    # ------------------------------------------------------------------ output

    def _write(self, text: str, stack: bool) -> None:
        stream = self.stream or sys.stderr
        with self._write_lock, _one_writer_per_host():
            try:
                stream.write(text)
                history = self.history
                if history:
                    stream.write(f"[lightning_sync guard] rank {self._rank}: its last collectives:\n  "
                                 + "\n  ".join(history) + "\n")
                if stack:
                    recorded = _flight_recorder_tail()
                    if recorded:
                        stream.write(f"[lightning_sync guard] rank {self._rank}: torch's flight recorder, last "
                                     "collectives (DDP's C++ ones included):\n  " + "\n  ".join(recorded) + "\n")
                    stream.write(f"[lightning_sync guard] rank {self._rank}: Python stacks of every thread:\n")
                    stream.flush()
                    dump_stacks(stream)
                stream.flush()
            except (OSError, ValueError):
                pass


@contextlib.contextmanager
def _one_writer_per_host(wait: float = 5.0) -> Iterator[None]:
    """The ranks of one host write their reports one at a time (two ranks' stacks written at once interleave
    line by line on a shared terminal): an exclusive ``flock`` on a file in the temp directory, waited for at
    most ``wait`` s, so that a rank stopped while it holds the lock cannot silence the others."""
    try:
        import fcntl

        fd = os.open(os.path.join(tempfile.gettempdir(), f"lightning_sync_guard_{os.getuid()}.lock"),
                     os.O_CREAT | os.O_RDWR, 0o600)
    except (ImportError, OSError, AttributeError):  # no fcntl (Windows), no getuid, an unwritable temp dir
        yield
        return
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    break  # write anyway
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the lock


def _on_gloo(group: Any) -> bool:
    """Whether ``group`` carries CPU tensors on gloo (a mixed ``cpu:gloo,cuda:nccl`` group does: the guard's own
    exchanges are CPU tensors); False where this rank is not a member."""
    try:
        return collectives.backend_for(group, "cpu") == "gloo"
    except (ValueError, RuntimeError):
        return False


def _flight_recorder_tail(n: int = 4) -> list[str]:
    """The last entries of torch's flight recorder, when the user turned it on (TORCH_FR_BUFFER_SIZE)."""
    if not (os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")):
        return []
    try:
        dump = flight_recorder_dump()
        entries = pickle.loads(dump).get("entries", []) if dump is not None else []
    except Exception:  # noqa: BLE001 - a diagnostic extra must never fail the report
        return []
    return [f"seq {e.get('collective_seq_id')} {e.get('profiling_name')} in {e.get('input_sizes')} "
            f"{e.get('input_dtypes')} state={e.get('state')}" for e in entries[-n:]]


class _GroupCache:
    """What the guard's installs on one default process group share, made by the first and reused by the
    next (every trainer call installs a guard):

    * ``clients``: the watchdog's own ``TCPStore`` connection to the rendezvous server, per timeout. A new
      client costs ~1 ms and, about one connection in 12-40 here on torch 2.13, a 5 s stall on every rank
      at once (docs/guard.md, Cost).
    * ``groups``: the guard's two gloo groups (the token confirmations', the step flags'). Two new ones
      per install were ~3 native threads more per trainer call, freed only with the default group.
    * ``dirty``: an install on this group ended in a failure on this rank. A failed side exchange can leave a
      rank's all-gather pending on those groups and the store client mid-request, so the next install drops
      them, on every rank alike (agreed at install: ``new_group`` is a collective).

    Held weakly by the default group (:data:`_caches`): it all goes when the group goes, and with the
    groups the store reference they share with it, so nothing here keeps rank 0's rendezvous server open
    after ``destroy_process_group``.
    """

    __slots__ = ("clients", "groups", "dirty")

    def __init__(self) -> None:
        self.clients: dict[float, Any] = {}
        self.groups: tuple[Any, Any] | None = None
        self.dirty = False


_caches: weakref.WeakKeyDictionary[Any, _GroupCache] = weakref.WeakKeyDictionary()


def _group_cache() -> _GroupCache:
    """The default group's cache (a throwaway one where the group type takes no weak reference)."""
    world = dist.group.WORLD
    world = getattr(world, "wrapped", world)  # the group init_process_group made, watched or not
    try:
        cache = _caches.get(world)
        if cache is None:
            cache = _caches[world] = _GroupCache()
    except TypeError:
        return _GroupCache()
    return cache


def _side_store(prefix: str, timeout: float, cache: _GroupCache) -> Any:
    # torch.distributed exports the store classes without declaring them (mypy): go through Any
    c10d: Any = dist
    base = default_store()
    inner = base
    while isinstance(inner, c10d.PrefixStore):
        inner = inner.underlying_store
    if not isinstance(inner, c10d.TCPStore):
        return c10d.PrefixStore(prefix, base)
    # the watchdog's own connection to the rendezvous server, with its own short timeout
    client = cache.clients.get(timeout)
    if client is None:
        client = cache.clients[timeout] = c10d.TCPStore(inner.host, inner.port, is_master=False,
                                                        wait_for_workers=False, timeout=timedelta(seconds=timeout))
    return c10d.PrefixStore(prefix, client)


class _BucketHookState:
    """What :func:`_recording_allreduce_hook` needs: the guard (weakly; it records only while installed) and
    DDP's process group."""

    __slots__ = ("guard", "group")

    def __init__(self, guard: CollectiveGuard, group: Any) -> None:
        self.guard = weakref.ref(guard)
        self.group = group




def _recording_allreduce_hook(state: _BucketHookState, bucket: Any) -> Any:
    """DDP's communication hook under the guard: record the bucket, then the all-reduce DDP makes without a hook."""
    guard = state.guard()
    if guard is None or not guard.active:
        return _allreduce_bucket(state.group, bucket)
    if not guard._depth:
        buffer = bucket.buffer()
        guard._record("DDP gradient all-reduce", f"{str(buffer.dtype).removeprefix('torch.')}[{buffer.numel()}] "
                      f"bucket {bucket.index()}", state.group, None, site=DDP_BUCKET_SITE)
    guard._depth += 1  # its all_reduce is this fingerprint's: not recorded, checked or refused again
    try:
        return _allreduce_bucket(state.group, bucket)
    finally:
        guard._depth -= 1


def _allreduce_bucket(group: Any, bucket: Any) -> Any:
    """What DDP's reducer does without a hook, to the bit: each gradient multiplied by 1 / world size (a float
    scalar, as the reducer's ``wrapped_scalar_tensor``; torch's Python ``allreduce_hook`` divides instead, which
    rounds differently from 3 ranks on), then one all-reduce of the sums."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / dist.get_world_size(group))
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


# DDP checks the hook's annotations against the real objects (this module's are strings: `from __future__`)
_recording_allreduce_hook.__annotations__ = {"state": _BucketHookState, "bucket": getattr(dist, "GradBucket"),  # noqa: B009
                                             "return": torch.futures.Future[torch.Tensor]}


@atexit.register
def _stop_all() -> None:
    for guard in list(_active):
        guard.uninstall()


def _keep_backend_error(error: BaseException, backend: BaseException) -> None:
    """``backend`` (the collective's own failure) kept on the guard's ``error`` as ``backend_error``, not as its
    ``__cause__``: Python would print it as a second traceback."""
    if error is not backend:
        error.backend_error = backend  # type: ignore[attr-defined]
