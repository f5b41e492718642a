"""The guard's background thread: publishes, compares, and diagnoses off the training thread.

Fork safety: the thread is stopped (joined) before every ``os.fork`` of its process and restarted
in the parent afterwards, so no guard thread exists, let alone holds a lock, while a data-loader
worker is forked; the child starts without one.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import IO, Any

from lightning_sync.errors import LightningSyncError
from lightning_sync.guard import report
from lightning_sync.guard.fingerprint import Fingerprint, Recorder, decode
from lightning_sync.guard.protocol import Exchange, StoreUnavailable, stream_members

__all__ = ["Monitor", "probe"]

_EXIT_CODE = 70
_monitors: weakref.WeakSet[Monitor] = weakref.WeakSet()


class _WatchdogThread(threading.Thread):
    """The watchdog's daemon thread. Its ``stop()`` ends the guard it belongs to: that is the method
    harnesses that find a left-over daemon thread call (Lightning's own test suite does)."""

    def __init__(self, monitor: Monitor, stopped: threading.Event) -> None:
        super().__init__(target=monitor._run, args=(stopped,), name="lightning_sync-guard", daemon=True)
        self._monitor = weakref.ref(monitor)

    def stop(self) -> None:
        monitor = self._monitor()
        if monitor is not None:
            monitor._end_owner()


class StoreLostError(LightningSyncError):
    """The rendezvous store stopped answering: the process hosting it (rank 0, or an agent) is gone."""


def probe(beat: dict[str, Any]) -> str:
    """``"alive"``, ``"stopped"``, ``"dead"`` or ``"unknown"`` (another host, or a platform without Linux's
    ``/proc``, where a silent peer is reported as silent instead) for a rank's published identity."""
    if beat.get("host") != socket.gethostname() or not os.path.isdir("/proc/self"):
        return "unknown"
    try:
        with open(f"/proc/{beat['pid']}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return "dead"
    if beat.get("start") and fields[19] != beat["start"]:
        return "dead"  # the pid was reused
    return {"Z": "dead", "X": "dead", "T": "stopped", "t": "stopped"}.get(fields[0], "alive")


class Monitor:
    """Runs :class:`Exchange` turns every ``interval`` s and turns findings into one failure.

    The failure is raised by the training thread at its next guarded collective (or while it waits
    in one). If that thread does not pick it up within ``grace`` s (it is blocked where Python
    cannot raise, e.g. DDP's gradient all-reduce), the report and the stacks are written and the
    process ends with exit code 70, so no rank of a failed run is left behind (``grace=math.inf``: never).
    A peer on this host found stopped (SIGSTOP, a debugger) is sent SIGKILL only with ``kill_stopped``.
    """

    def __init__(self, exchange: Exchange, recorder: Recorder, timeout: float, hang_timeout: float,
                 write: Callable[[str, bool], None], interval: float = 0.1, grace: float | None = None,
                 kill_stopped: bool = False) -> None:
        self.exchange = exchange
        self.recorder = recorder
        self.timeout = timeout
        self.hang_timeout = hang_timeout
        self.interval = interval
        # long enough for the usual ending (a failed peer exits, its connections close, this rank raises)
        self.grace = grace if grace is not None else max(30.0, min(timeout, 120.0))
        self.kill_stopped = kill_stopped
        self.stale_after = min(timeout, max(2.0, 20 * interval))
        #: how long ``stop()`` (and so a fork of this process) waits for a turn in progress to end
        self.join_timeout = 5.0
        self._write = write
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        self._pending: tuple[str, bool, str] | None = None  # the failure's report, until written (report())
        #: the training thread raised the failure (its traceback carries the message): set by the guard
        self.raised = False
        self._failed_at = 0.0
        self._may_exit = True
        self._stop = threading.Event()
        self._wake = threading.Event()  # an early turn (a closing check waiting for its confirmation)
        recorder.wake = self.wake  # and one when the recorder's queue fills up between two turns
        self._thread: threading.Thread | None = None
        self._paused = False
        self._dumped_for: float | None = None
        self._store_lost_since: float | None = None
        self._killed: set[int] = set()
        self._verified: dict[str, int] = {}  # replaced, never mutated: read by the training thread
        #: returns False once the process group this guard checks is gone (set by the guard)
        self.group_alive: Callable[[], bool] | None = None
        #: ends the whole guard, not only this thread (set by the guard; called by the thread's ``stop``)
        self.owner_stop: Callable[[], None] | None = None
        _monitors.add(self)

    # ---------------------------------------------------------------- life cycle

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    @property
    def running(self) -> bool:
        """True while the watchdog thread is alive (it compares, times out and diagnoses)."""
        thread = self._thread
        return self._paused or (thread is not None and thread.is_alive())

    def verified(self, stream: str) -> int:
        """Highest seq of ``stream`` this rank compared equal with its neighbour."""
        return self._verified.get(stream, -1)

    def start(self) -> None:
        # Each thread gets a stop event of its own: a thread that outlived its stop() (its join timed out in a
        # busy turn, e.g. before a fork) still ends at its next turn instead of running beside its successor.
        self._stop = threading.Event()
        self._thread = _WatchdogThread(self, self._stop)
        self._thread.start()

    def wake(self) -> None:
        """Run the next turn now instead of after ``interval`` (from any thread)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        thread = self._thread
        self._thread = None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.join_timeout)

    def leave(self) -> None:
        """Stop for good and tell the others this rank stopped guarding on purpose."""
        self.stop()
        rec = self.recorder
        streams = rec.streams()
        try:  # the last fingerprints too: a peer explaining a mismatch reads them from here
            self.exchange.publish(rec.take_unpublished(), None, {s: rec.last(s) for s in streams},
                                  {s: rec.next_seq(s) for s in streams}, done=True)
        except StoreUnavailable:
            pass

    def _before_fork(self) -> None:
        if self._thread is not None:
            self._paused = True
            self.stop()

    def _after_fork_parent(self) -> None:
        if self._paused:
            self._paused = False
            self.start()

    def _after_fork_child(self) -> None:
        self._paused = False
        self._thread = None
        self._lock = threading.Lock()
        self.recorder.reset_lock_after_fork()
        self._stop.set()

    def _run(self, stopped: threading.Event) -> None:
        while True:
            self._wake.wait(self.interval)
            if stopped.is_set():
                return
            self._wake.clear()
            if self.group_alive is not None and not self.group_alive():
                # Whoever destroyed the process group ended the run without tearing the guard down
                # (a strategy set up and dropped, a test harness): stop guarding instead of lingering.
                self._end_owner()
                return
            try:
                self.turn()
            except Exception as err:  # noqa: BLE001 - a bug here must not leave a guard that checks nothing
                # Without this thread nothing compares or times out: fail the run with the cause, so every
                # rank's next collective (or closing check) raises instead of waiting on a dead watchdog.
                self.fail(LightningSyncError(
                    f"rank {self.exchange.rank}: the collective guard's watchdog failed ({type(err).__name__}: {err}); "
                    "collectives can no longer be checked, so the run stops here. Please report it; "
                    "SyncDDPStrategy(guard=False) runs without the guard."), stack=False, may_exit=False)
                return

    def _end_owner(self) -> None:
        owner_stop = self.owner_stop
        try:
            (owner_stop or self.stop)()
        except Exception:  # noqa: BLE001 - the store may be gone with the group: nothing left to tell
            pass

    # ---------------------------------------------------------------- one turn

    def fail(self, error: BaseException, post: bool = True, stack: bool = True, may_exit: bool = True,
             raised: bool = False) -> None:
        """Fail the run with ``error`` (the first failure wins): every guarded call of the training thread raises
        it from now on. Its report is written once (:meth:`write_report`): as the rank stops guarding (the message
        itself only where the training thread did not raise it: its traceback carries it otherwise), or before
        the grace exit of a thread blocked where Python cannot raise (with every thread's stack if ``stack``).
        ``raised``: the caller raises it now."""
        with self._lock:
            if self._failure is not None:
                self.raised = self.raised or raised  # (the caller's traceback carries a message of its own)
                return
            self._failure = error
            self._failed_at = time.monotonic()
            self._may_exit = may_exit
            self._pending = (f"[lightning_sync guard] rank {self.exchange.rank}: {type(error).__name__}: {error}\n",
                             stack, "")
            self.raised = self.raised or raised
        if stack and not self.raised:
            # where this rank stood when the failure was found: written only if the training thread never raises it
            # (its traceback shows where it was otherwise)
            stacks = (f"[lightning_sync guard] rank {self.exchange.rank}: Python stacks of every thread when the "
                      f"failure was found:\n{format_stacks()}")
            with self._lock:
                if self._pending is not None:
                    self._pending = (self._pending[0], stack, stacks)
        if post:
            try:
                self.exchange.post_abort(f"{type(error).__name__}: {error}")
            except StoreUnavailable:
                pass

    def write_report(self, ending: str = "") -> None:
        """Write the failure's report once: this rank's last collectives, preceded by the message unless the
        training thread raised it, followed by ``ending`` (and every thread's stack when ``ending`` is given and
        the failure asked for stacks)."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            if ending:
                self._write(ending, True)
            return
        text, stack, stacks = pending
        if ending:
            self._write(text + ending, stack)
        else:
            self._write("" if self.raised else text + stacks, False)

    def turn(self) -> None:
        """Publish, compare, diagnose (one watchdog turn; public for tests)."""
        rec = self.recorder
        busy = rec.busy
        try:
            streams = rec.streams()
            self.exchange.publish(rec.take_unpublished(), busy, {s: rec.last(s) for s in streams},
                                  {s: rec.next_seq(s) for s in streams})
            poll = self.exchange.poll()
            self._verified = dict(self.exchange.verified)
            self._store_lost_since = None
        except StoreUnavailable as err:
            self._store_lost(err)
            self._maybe_exit()
            return
        if poll.mismatch is not None and self._failure is None:
            m = poll.mismatch
            fps = self.fingerprints_at(m.stream, m.seq)
            fps.update({self.exchange.rank: m.mine, m.neighbour: m.theirs})
            # the report names every rank's call site: no stacks (the grace exit writes them if this rank
            # cannot raise)
            self.fail(report.mismatch(m.seq, fps), stack=False)
        if poll.aborts and self._failure is None:
            r, message = sorted(poll.aborts.items())[0]
            kind, _, text = message.partition(": ")
            error: BaseException = _rebuild(kind, text)
            program = text.startswith(f"rank {r} raised")  # the program's exception on rank r, posted as it left
            if not program:  # the guard's own finding on rank r: say whose it is
                error = _rebuild(kind, f"(found by rank {r}) {text}")
            self.fail(error, post=False, stack=not program)
        now = time.monotonic()
        if busy is not None and self._failure is None:
            waited = now - busy.since
            if waited > self.timeout:
                self.diagnose(busy.stream, busy.seq, waited)
            if waited > self.hang_timeout and self._dumped_for != busy.since and self._failure is None:
                self._dumped_for = busy.since
                last = rec.last(busy.stream, 1)
                self._write(f"[lightning_sync guard] rank {self.exchange.rank}: a collective has not finished after "
                            f"{self.hang_timeout:g} s: {last[-1].describe() if last else '?'}\n", True)
        if poll.neighbour_silent > self.timeout and self._failure is None:
            seq = rec.next_seq("w") - 1
            self.diagnose("w", seq, poll.neighbour_silent, blocked=busy is not None)
        self._maybe_exit()

    def _store_lost(self, err: StoreUnavailable) -> None:
        now = time.monotonic()
        if self._store_lost_since is None:
            self._store_lost_since = now
        if now - self._store_lost_since > min(self.timeout, 5.0) and self._failure is None:
            self.fail(StoreLostError(
                f"rank {self.exchange.rank}: the rendezvous store stopped answering ({err}); the rank hosting it "
                "(rank 0, or the launcher's agent) is gone, so the run cannot continue."), post=False, may_exit=False)

    def _maybe_exit(self) -> None:
        # Raising the failure once is not enough: code that catches it and goes on (Lightning's per-step
        # SIGTERM broadcast swallows any exception) walks into the next collective of a broken group. Until
        # the guard is uninstalled (the failure reached on_exception / teardown), the grace runs.
        if self._failure is None or self._stop.is_set() or not self._may_exit:
            return
        if time.monotonic() - self._failed_at > self.grace:
            self.write_report(f"[lightning_sync guard] rank {self.exchange.rank}: the failure above did not end the run "
                        f"within {self.grace:g} s (the training thread is blocked where Python cannot raise, or the "
                        f"error was caught and training went on); ending the process (exit code {_EXIT_CODE}).\n")
            os._exit(_EXIT_CODE)

    # ---------------------------------------------------------------- diagnosis

    def fingerprints_at(self, stream: str, seq: int) -> dict[int, Fingerprint | None]:
        beats = self.exchange.heartbeats(stream_members(stream, self.exchange.world))
        return {r: self.exchange.fingerprint_at(b, stream, seq) for r, b in beats.items()}

    def peer_states(self, stream: str, seq: int) -> list[report.PeerState]:
        me = self.exchange.rank
        mine = self.recorder.last(stream, 64)
        mine_at = next((fp for fp in mine if fp.seq == seq), None)
        states = []
        now = time.time()
        for r, beat in self.exchange.heartbeats(stream_members(stream, self.exchange.world)).items():
            if r == me:
                continue
            if beat is None:
                states.append(report.PeerState(r, "absent"))
                continue
            if beat.get("done"):
                last = decode(beat.get("ring", {}).get(stream, ""))
                states.append(report.PeerState(r, "behind", last=last[-1] if last else None, detail="left"))
                continue
            age = now - float(beat["time"])
            where = f"process {beat['pid']} on {beat['host']}"
            if age > self.stale_after:
                kind = probe(beat)
                status = {"dead": "dead", "stopped": "stopped"}.get(kind, "silent")
                detail = where if status != "silent" else f"no heartbeat for {age:.0f} s from {where}"
                states.append(report.PeerState(r, status, detail=detail))
                if status == "stopped" and r not in self._killed:
                    self._killed.add(r)
                    self._end_stopped(r, beat)
                continue
            nxt = int(beat.get("next", {}).get(stream, 0))
            ring = self.exchange.fingerprint_at(beat, stream, seq)
            if nxt <= seq:
                last = decode(beat.get("ring", {}).get(stream, ""))
                states.append(report.PeerState(r, "behind", last=last[-1] if last else None,
                                               busy=beat.get("busy") is not None))
            elif ring is None or mine_at is None:
                states.append(report.PeerState(r, "ahead" if nxt > seq + 1 else "same", at=ring or mine_at))
            else:
                same = ring.key(self.exchange.call_sites) == mine_at.key(self.exchange.call_sites)
                states.append(report.PeerState(r, ("ahead" if nxt > seq + 1 else "same") if same else "different",
                                               at=ring))
        return states

    def _end_stopped(self, rank: int, beat: dict[str, Any]) -> None:
        # A stopped rank can neither raise nor exit, and a stopped process ignores every signal but
        # SIGKILL. It may be a rank under a debugger: ended only where the user asked for it.
        if not self.kill_stopped:
            self._write(f"[lightning_sync guard] rank {self.exchange.rank}: rank {rank} (process {beat['pid']}) is "
                        "stopped and was left as it is (a debugger?); end it yourself, or pass "
                        "CollectiveGuard(kill_stopped_peers=True) to have the guard end stopped ranks.\n", False)
            return
        try:
            os.kill(int(beat["pid"]), signal.SIGKILL)
            self._write(f"[lightning_sync guard] rank {self.exchange.rank}: sent SIGKILL to the stopped rank {rank} "
                        f"(process {beat['pid']}) so the failed run leaves no process behind.\n", False)
        except OSError:
            pass

    def diagnose(self, stream: str, seq: int, waited: float, blocked: bool = True) -> None:
        try:
            states = self.peer_states(stream, seq)
        except StoreUnavailable as err:
            self._store_lost(err)
            return
        mine = next((fp for fp in self.recorder.last(stream, 64) if fp.seq == seq), None)
        if not blocked and not any(s.status in ("dead", "stopped", "silent") for s in states):
            return  # the neighbour's beat stalled but it is alive again / nothing to name
        error = report.stall(seq, self.timeout, self.exchange.rank, mine, waited, states)
        if error is not None:
            self.fail(error)

    def peer_abort(self) -> BaseException | None:
        """The error a peer posted before it left, if any (asked when a collective failed under us)."""
        try:
            aborts = self.exchange.read_aborts()
        except StoreUnavailable:
            return None
        if not aborts:
            return None
        r, message = sorted(aborts.items())[0]
        kind, _, text = message.partition(": ")
        self.fail(_rebuild(kind, text), post=False, stack=False)
        return self._failure

    def lost_peers(self, stream: str) -> dict[int, str]:
        """Peers whose process is gone (same host) or silent; asked when a collective failed."""
        try:
            beats = self.exchange.heartbeats(stream_members(stream, self.exchange.world))
        except StoreUnavailable:
            return {}
        lost = {}
        for r, beat in beats.items():
            if r == self.exchange.rank or beat is None:
                continue
            kind = probe(beat)
            if kind == "dead":
                lost[r] = f"process {beat['pid']} on {beat['host']} ended"
            elif kind == "unknown" and time.time() - float(beat["time"]) > self.stale_after:
                lost[r] = f"no heartbeat for {time.time() - float(beat['time']):.0f} s from {beat['host']}"
        return lost


def _rebuild(kind: str, text: str) -> BaseException:
    from lightning_sync import errors

    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, errors.LightningSyncError):
        try:
            return cls(text)
        except TypeError:
            pass
    return LightningSyncError(text)


def _before_fork() -> None:
    for monitor in list(_monitors):
        monitor._before_fork()


def _after_fork_parent() -> None:
    for monitor in list(_monitors):
        monitor._after_fork_parent()


def _after_fork_child() -> None:
    for monitor in list(_monitors):
        monitor._after_fork_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent, after_in_child=_after_fork_child)


def format_stacks() -> str:
    """Every thread's Python stack as text (as ``faulthandler`` writes them, most recent call first)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        lines = "".join(reversed(traceback.format_stack(frame)))
        parts.append(f"Thread {names.get(ident, hex(ident or 0))} (most recent call first):\n{lines}")
    return "\n".join(parts)


def dump_stacks(stream: IO[str]) -> None:
    faulthandler.dump_traceback(file=stream, all_threads=True)

