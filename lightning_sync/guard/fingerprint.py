"""What one collective looked like on one rank, and this rank's ring of them.

A :class:`Fingerprint` is immutable; the :class:`Recorder` is written by the rank's main thread
(a few microseconds per collective) and read by the watchdog thread, under one lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor

__all__ = ["Busy", "Fingerprint", "Recorder", "decode", "describe_tensor", "encode", "op_name"]

_FIELD = "\x1f"
_RECORD = "\x1e"


class Fingerprint(NamedTuple):
    """One guarded collective as this rank issued it."""

    seq: int  #: position in its stream (the world, or one subgroup), from 0
    op: str  #: e.g. ``all_reduce``, ``strategy.reduce``, ``gather_objects``
    match: str  #: what must be equal on every rank: dtype/shape, reduce op, src/dst
    site: str  #: ``file:line function`` of the user's call, plus ``[lightning hook]``

    def key(self, call_sites: bool) -> tuple[str, ...]:
        """What two ranks' fingerprints must share."""
        return (self.op, self.match, self.site) if call_sites else (self.op, self.match)

    def describe(self) -> str:
        return f"at {self.site}: {self.op}{' ' + self.match if self.match else ''}"


class Busy(NamedTuple):
    """The collective this rank's main thread is blocked in."""

    stream: str
    seq: int  #: the last fingerprint's seq in ``stream`` when it entered
    since: float  #: time.monotonic() at entry


def encode(fingerprints: list[Fingerprint]) -> str:
    return _RECORD.join(f"{f.seq}{_FIELD}{f.op}{_FIELD}{f.match}{_FIELD}{f.site}" for f in fingerprints)


def decode(text: str) -> list[Fingerprint]:
    out = []
    for record in text.split(_RECORD) if text else ():
        seq, op, match, site = record.split(_FIELD, 3)
        out.append(Fingerprint(int(seq), op, match, site))
    return out


_described: dict[Any, str] = {}


def describe_tensor(t: Any) -> str:
    if isinstance(t, Tensor):
        key = (t.dtype, t.shape)
        text = _described.get(key)
        if text is None:
            if len(_described) > 4096:
                _described.clear()
            text = _described[key] = f"{str(t.dtype).removeprefix('torch.')}[{', '.join(map(str, t.shape))}]"
        return text
    if isinstance(t, (list, tuple)):
        return f"{len(t)} x " + (describe_tensor(t[0]) if t else "[]")
    return type(t).__name__


_op_names: dict[Any, str] = {}


def op_name(op: Any) -> str:
    if op is None:
        return "sum"
    try:
        return _op_names[op]
    except (KeyError, TypeError):
        name = str(op).rsplit(".", 1)[-1].lower()
        try:
            _op_names[op] = name
        except TypeError:
            pass
        return name


class Recorder:
    """This rank's fingerprints: a ring for reports, a queue the watchdog publishes from.

    ``busy`` is replaced (never mutated) by the main thread, so the watchdog reads it without the lock.
    ``wake``: called (from the recording thread) when ``capacity`` fingerprints wait to be published, so the
    watchdog publishes them now instead of at its next turn (a fast loop between two turns of a slow
    ``interval``). The queue holds at most ``4 * capacity`` (a stalled watchdog must not grow memory): beyond
    that the oldest go (``dropped``), never the newest, which the checks that wait for confirmation need.
    """

    def __init__(self, capacity: int = 256) -> None:
        self._lock = threading.Lock()
        self._seq: dict[str, int] = {}
        self._ring: dict[str, deque[Fingerprint]] = {}
        self._unpublished: deque[tuple[str, Fingerprint]] = deque(maxlen=4 * capacity)
        self._capacity = capacity
        self.busy: Busy | None = None
        self.entered = 0  # guarded collectives recorded (all streams)
        self.dropped = 0  # fingerprints never published (the queue was full): compared by no rank
        self.wake: Callable[[], None] | None = None

    def record(self, stream: str, op: str, match: str, site: str) -> Fingerprint:
        with self._lock:
            seq = self._seq.get(stream, 0)
            self._seq[stream] = seq + 1
            fp = Fingerprint(seq, op, match, site)
            ring = self._ring.get(stream)
            if ring is None:
                ring = self._ring[stream] = deque(maxlen=self._capacity)
            ring.append(fp)
            queue = self._unpublished
            if len(queue) == queue.maxlen:
                self.dropped += 1  # (the oldest, as the append below pushes it out)
            queue.append((stream, fp))
            backlog = len(queue)
            self.entered += 1
        wake = self.wake
        if wake is not None and backlog == self._capacity:
            wake()
        return fp

    def enter(self, stream: str) -> Busy | None:
        """Mark the main thread blocked in a collective of ``stream``; returns the previous mark."""
        previous = self.busy
        if previous is None:
            self.busy = Busy(stream, self._seq.get(stream, 0) - 1, time.monotonic())
        return previous

    def take_unpublished(self) -> list[tuple[str, Fingerprint]]:
        with self._lock:
            batch = list(self._unpublished)
            self._unpublished.clear()
        return batch

    def last(self, stream: str, n: int = 8) -> list[Fingerprint]:
        with self._lock:
            ring = self._ring.get(stream)
            return list(ring)[-n:] if ring else []

    def streams(self) -> list[str]:
        with self._lock:
            return list(self._ring)

    def next_seq(self, stream: str) -> int:
        with self._lock:
            return self._seq.get(stream, 0)

    def reset_lock_after_fork(self) -> None:
        self._lock = threading.Lock()
