"""The guard's cross-rank protocol and watchdog in one process, on torch's HashStore (no process group).

Each "rank" is an Exchange + Recorder + Monitor over the same store; turns are driven by hand, so
every case is deterministic and takes milliseconds.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_sync.errors import CollectiveMismatchError, LightningSyncError
from lightning_sync.guard import report
from lightning_sync.guard.fingerprint import Busy, Fingerprint, Recorder, decode, encode
from lightning_sync.guard.protocol import SLOTS, Exchange, StoreUnavailable
from lightning_sync.guard.watchdog import Monitor


class Rank:
    def __init__(self, store: dist.Store, rank: int, world: int, timeout: float = 5.0) -> None:
        self.written: list[str] = []
        self.recorder = Recorder()
        self.exchange = Exchange(store, rank, world)
        self.exchange.start()
        self.monitor = Monitor(self.exchange, self.recorder, timeout, timeout,
                               lambda text, stack: self.written.append(text), interval=0.01, grace=1e9)

    def call(self, op: str, site: str = "model.py:10 training_step", match: str = "float32[1] op=sum") -> None:
        self.recorder.record("w", op, match, site)


def ranks(world: int, timeout: float = 5.0) -> list[Rank]:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1))
    return [Rank(store, r, world, timeout) for r in range(world)]


def turns(group: list[Rank], n: int = 2) -> None:
    for _ in range(n):
        for r in group:
            r.monitor.turn()


def test_fingerprints_round_trip() -> None:
    fps = [Fingerprint(0, "all_reduce", "float32[2] op=sum", "a.py:3 f [training_step]"), Fingerprint(1, "barrier", "", "?")]
    assert decode(encode(fps)) == fps and decode("") == []


def test_same_sequences_in_any_order_of_turns_verify() -> None:
    group = ranks(4)
    for i in range(100):
        for r in reversed(group):  # ranks record and publish at different moments
            r.call("all_reduce", site=f"model.py:{i % 7} training_step")
        group[i % 4].monitor.turn()
    turns(group)
    assert all(r.monitor.failure is None for r in group)
    assert all(r.monitor.verified("w") == 99 for r in group)


def test_mismatch_names_both_call_sites_on_every_rank() -> None:
    group = ranks(3)
    for r in group:
        r.call("all_reduce")
    group[0].call("all_reduce", site="model.py:20 training_step")
    group[1].call("all_reduce", site="model.py:30 training_step")
    group[2].call("all_reduce", site="model.py:30 training_step")
    turns(group, 3)
    for r in group:
        error = r.monitor.failure
        assert isinstance(error, CollectiveMismatchError), r.written
        assert "guarded collective #1" in str(error) and "model.py:20" in str(error) and "model.py:30" in str(error)
        assert "call sites differ" in str(error)


def test_a_late_rank_is_not_a_mismatch() -> None:
    group = ranks(2)
    for _ in range(5):
        group[0].call("barrier", match="")
    turns(group)
    for _ in range(5):
        group[1].call("barrier", match="")  # arrives later; nobody waited in between
        turns(group)
    assert all(r.monitor.failure is None for r in group) and group[0].monitor.verified("w") == 4


def test_a_missing_rank_is_named_with_its_last_collective() -> None:
    group = ranks(2, timeout=0.2)
    for r in group:
        r.call("barrier", match="", site="train.py:5 main")
    group[0].call("all_reduce", site="model.py:42 training_step")
    turns(group)
    group[0].recorder.busy = Busy("w", 1, time.monotonic() - 0.3)  # rank 0 waits in it; rank 1 never comes
    turns(group)
    error = group[0].monitor.failure
    assert isinstance(error, CollectiveMismatchError)
    text = str(error)
    assert "rank(s) 1 did not reach guarded collective #1" in text
    assert "rank 0 at model.py:42 training_step: all_reduce float32[1] op=sum" in text
    assert "rank 1 never reached it; its last collective was #0 at train.py:5 main: barrier" in text
    assert "outside any guarded collective" in text
    assert isinstance(group[1].monitor.failure, CollectiveMismatchError)  # the other rank hears of it
    assert not group[1].written  # its report waits: the training thread may raise it (one message per rank)
    group[1].monitor.write_report()  # it stops guarding without having raised it: the report says whose finding it is
    assert "rank 1: CollectiveMismatchError: (found by rank 0) rank(s) 1 did not reach" in group[1].written[0]


def test_everyone_in_the_same_slow_collective_is_not_an_error() -> None:
    group = ranks(2, timeout=0.1)
    for r in group:
        r.call("barrier", match="")
    turns(group)
    for r in group:
        r.recorder.busy = Busy("w", 0, time.monotonic() - 0.2)
    turns(group)
    assert all(r.monitor.failure is None for r in group)
    assert any("has not finished" in text for text in group[0].written)  # the hang dump


def test_neighbour_ring_overrun_skips_without_false_alarm() -> None:
    group = ranks(2)
    for i in range(SLOTS + 10):
        group[1].call("barrier", match="")
        group[1].monitor.turn()  # publishes one batch per turn; rank 0 does not read meanwhile
    for _ in range(SLOTS + 10):
        group[0].call("barrier", match="")
    turns(group)
    assert group[0].monitor.failure is None and group[0].exchange.skipped == 0  # slots read lag-free by count
    assert group[1].monitor.verified("w") == SLOTS + 9


def test_store_timeouts_become_store_unavailable() -> None:
    store = dist.HashStore()
    store.set_timeout(timedelta(milliseconds=50))
    exchange = Exchange(store, 0, 2)
    with pytest.raises(StoreUnavailable):
        exchange._call(store.get, "never/set")  # what a dead rendezvous server looks like


def test_silent_store_fails_the_run_after_a_while() -> None:
    class Gone:  # a store whose server went away (every call raises as TCPStore does)
        def __getattr__(self, name: str) -> object:
            def fail(*args: object) -> None:
                raise RuntimeError("Connection reset by peer")
            return fail

    rank = Rank(dist.HashStore(), 1, 2, timeout=0.05)
    rank.exchange.store = Gone()
    rank.monitor.turn()
    assert rank.monitor.failure is None  # one failed turn is not enough
    time.sleep(0.1)
    rank.monitor.turn()
    assert isinstance(rank.monitor.failure, LightningSyncError) and "store stopped answering" in str(rank.monitor.failure)


def test_report_of_lost_and_stopped_ranks() -> None:
    mine = Fingerprint(3, "barrier", "", "model.py:1 f")
    stopped = report.stall(3, 5, 0, mine, 6, [report.PeerState(1, "stopped", detail="process 7 on h")])
    assert isinstance(stopped, LightningSyncError) and not isinstance(stopped, CollectiveMismatchError)
    assert "rank 1 is frozen: its process is stopped (process 7 on h)" in str(stopped)
    dead = report.lost({1: "process 7 on h ended"}, RuntimeError("Connection closed by peer"), "while waiting")
    assert "rank(s) 1 died" in str(dead) and "Connection closed by peer" in str(dead)
    assert report.stall(3, 5, 0, mine, 6, [report.PeerState(1, "same", at=mine)]) is None


def test_a_rank_that_stopped_guarding_is_not_called_frozen() -> None:
    group = ranks(2, timeout=0.05)
    for r in group:
        r.call("barrier", match="")
    turns(group)
    group[1].monitor.leave()  # its guarded block ended; rank 0 computes on
    time.sleep(0.1)
    group[0].monitor.turn()
    group[0].monitor.turn()
    assert group[0].monitor.failure is None


@pytest.mark.parametrize("kill", [False, True], ids=["default_leaves_it", "kill_stopped_peers"])
def test_a_stopped_peer_is_ended_only_when_asked(kill: bool) -> None:
    """A real stopped process (SIGSTOP: what a debugger's breakpoint looks like from outside) is named as stopped;
    the guard sends it SIGKILL only with kill_stopped_peers, and says so either way."""
    import signal
    import socket
    import subprocess

    peer = subprocess.Popen(["sleep", "60"])
    try:
        peer.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while True:  # the signal is delivered asynchronously
            with open(f"/proc/{peer.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] == "T" or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        start = fields[19]
        group = ranks(2)
        me = group[0]
        me.monitor.kill_stopped = kill
        beat = {"pid": peer.pid, "host": socket.gethostname(), "start": start, "time": time.time() - 600}
        me.exchange.heartbeats = lambda members: {1: beat}  # type: ignore[method-assign]  # the peer's last beat
        states = me.monitor.peer_states("w", 0)
        assert [(s.rank, s.status) for s in states] == [(1, "stopped")]
        written = "".join(me.written)
        if kill:
            assert peer.wait(timeout=10) == -signal.SIGKILL and "sent SIGKILL to the stopped rank 1" in written
        else:
            time.sleep(0.3)
            assert peer.poll() is None and "left as it is" in written and "kill_stopped_peers=True" in written
    finally:
        peer.kill()
        peer.wait()


def test_a_ranks_store_traffic_is_flat_in_the_world_size() -> None:
    """Issue 40: each rank reads its one neighbour, so its requests a turn do not grow with the world (the store's
    host serves world x that); bench/bench_store.py prints the figures."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_store", Path(__file__).parents[1] / "bench" / "bench_store.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    small, large = bench.measure(2, 30, 2), bench.measure(32, 30, 2)
    assert large["max"] <= small["max"] + 0.1 and small["mean"] <= 4, (small, large)
    assert large["store"] == pytest.approx(16 * small["store"], rel=0.05)


def test_a_watchdog_thread_that_outlives_its_stop_ends_at_its_next_turn() -> None:
    """A fork stops the thread and starts a new one after it; a thread whose join timed out (a slow turn) must not
    go on turning beside its successor (one stop flag for both once let it: start() cleared it)."""
    rank = ranks(1)[0]
    monitor = rank.monitor
    release, in_turn = threading.Event(), threading.Event()
    turns: list[str] = []

    def slow_turn() -> None:
        turns.append(threading.current_thread().name + str(threading.get_ident()))
        in_turn.set()
        release.wait(10)

    monitor.turn = slow_turn  # type: ignore[method-assign]
    monitor.join_timeout = 0.1
    monitor.start()
    assert in_turn.wait(10)
    first = monitor._thread
    monitor.stop()  # the join times out: the first thread is still in its turn
    assert first is not None and first.is_alive()
    monitor.start()
    release.set()
    first.join(5)
    assert not first.is_alive(), "the stopped thread went on beside its successor"
    assert monitor.running
    monitor.stop()
    assert len({t for t in turns if str(first.ident) in t}) == 1
