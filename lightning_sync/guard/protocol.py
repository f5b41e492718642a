"""The guard's cross-rank protocol, written against torch's ``Store`` interface.

Each rank's watchdog, every ``interval``:

* publishes the fingerprints recorded since its last turn as one batch (a one-way ``set`` into a
  ring of ``SLOTS`` keys per rank and stream, plus the batch count) and a heartbeat (its beat
  counter, wall time, process id/host, whether it is blocked in a collective, and its last
  fingerprints);
* reads its *neighbour's* (the next rank of the stream, cyclically) new batches and heartbeat in one
  ``multi_get`` and compares the two sequences. Equality is transitive around the ring, so every
  rank comparing with one neighbour checks the whole world, and the work per rank (and per rank at
  the store) stays constant as the world grows;
* reads the failure counter; a rank that diagnosed a failure posts it there for everyone.

Only a stall or a failure makes a rank read everyone's heartbeat (O(world), once). Nothing here
runs on the training thread. Unit-tested in one process on ``torch.distributed.HashStore``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from lightning_sync.guard.fingerprint import Fingerprint, decode, encode

__all__ = ["SLOTS", "Exchange", "Mismatch", "Poll", "StoreUnavailable", "stream_key", "stream_members"]

SLOTS = 64  # batches kept per rank and stream: a neighbour may lag this many turns before data is skipped
_BATCH = "\x1d"
_KEEP = 8192  # fingerprints awaiting comparison, per stream and side


class StoreUnavailable(RuntimeError):
    """The store did not answer (timeout, connection closed: the rank hosting it may be gone)."""


def stream_key(ranks: list[int] | None) -> str:
    """``"w"`` for the world, ``"g0_2_3"`` for a subgroup of those global ranks."""
    return "w" if ranks is None else "g" + "_".join(map(str, ranks))


def stream_members(stream: str, world: int) -> list[int]:
    return list(range(world)) if stream == "w" else [int(r) for r in stream[1:].split("_")]


@dataclass(frozen=True)
class Mismatch:
    stream: str
    seq: int
    mine: Fingerprint
    theirs: Fingerprint
    neighbour: int


@dataclass
class Poll:
    """What one turn found."""

    mismatch: Mismatch | None = None
    aborts: dict[int, str] = field(default_factory=dict)  #: rank -> its posted failure
    neighbour_silent: float = 0.0  #: seconds since the world neighbour's beat last changed


def _process_start() -> str:
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return ""


class Exchange:
    """One rank's side of the protocol.

    Args:
        store: any torch ``Store``, already prefixed for this guard installation.
        rank, world: this rank's global rank and the world size.
        call_sites: compare call sites too (else only op and match).
    """

    def __init__(self, store: Any, rank: int, world: int, call_sites: bool = True) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.call_sites = call_sites
        self.identity = {"pid": os.getpid(), "host": socket.gethostname(), "start": _process_start()}
        self._published: dict[str, int] = {}
        self._read: dict[str, int] = {}
        self._mine: dict[str, dict[int, Fingerprint]] = {}
        self._theirs: dict[str, dict[int, Fingerprint]] = {}
        self.verified: dict[str, int] = {}  #: per stream: highest seq compared equal with the neighbour
        self._beat = 0
        self._world_keys_ready = False
        self._nbr_beat: tuple[int, float] = (-1, time.monotonic())
        self._aborts_seen = 0
        self.skipped = 0  #: fingerprints not compared because a neighbour's ring was overwritten

    # ---------------------------------------------------------------- helpers

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as err:  # noqa: BLE001 - every store failure means the same here
            raise StoreUnavailable(f"{type(err).__name__}: {err}") from err

    def neighbour(self, stream: str) -> int | None:
        members = stream_members(stream, self.world)
        if self.rank not in members or len(members) < 2:
            return None
        return members[(members.index(self.rank) + 1) % len(members)]

    # ---------------------------------------------------------------- writing

    def start(self) -> None:
        """Create this rank's keys (before its first turn)."""
        self._call(self.store.add, "abort", 0)
        self._call(self.store.multi_set, [f"c/w/{self.rank}", f"h/{self.rank}"], ["0", self._heartbeat(None, {})])

    def publish(self, batch: list[tuple[str, Fingerprint]], busy: tuple[str, int, float] | None,
                rings: dict[str, list[Fingerprint]], nexts: dict[str, int] | None = None, done: bool = False) -> None:
        """One-way writes, in one request: the new fingerprints per stream, their counts, then the
        heartbeat (the store applies a request's keys in order before it answers the next request, so a
        reader that sees a count sees its batch).

        ``done``: the last heartbeat of a rank that stops guarding on purpose (its silence is not a freeze).
        """
        by_stream: dict[str, list[Fingerprint]] = {}
        for stream, fp in batch:
            by_stream.setdefault(stream, []).append(fp)
        keys: list[str] = []
        values: list[str] = []
        for stream, fps in by_stream.items():
            k = self._published.get(stream, 0)
            keys += [f"f/{stream}/{self.rank}/{k % SLOTS}", f"c/{stream}/{self.rank}"]
            values += [f"{k}{_BATCH}{encode(fps)}", str(k + 1)]
            self._published[stream] = k + 1
            mine = self._mine.setdefault(stream, {})
            mine.update((fp.seq, fp) for fp in fps)
            _trim(mine)
        keys.append(f"h/{self.rank}")
        values.append(self._heartbeat(busy, rings, nexts, done))
        self._call(self.store.multi_set, keys, values)

    def _heartbeat(self, busy: tuple[str, int, float] | None, rings: dict[str, list[Fingerprint]],
                   nexts: dict[str, int] | None = None, done: bool = False) -> str:
        self._beat += 1
        return json.dumps({"beat": self._beat, "time": time.time(), **self.identity,
                           "busy": list(busy) if busy is not None else None,
                           "next": nexts if nexts is not None else {s: r[-1].seq + 1 for s, r in rings.items() if r},
                           "ring": {s: encode(r) for s, r in rings.items()}, "done": done})

    def post_abort(self, message: str) -> None:
        self._call(self.store.set, f"abort/{self.rank}", message)
        self._call(self.store.add, "abort", 1)

    # ---------------------------------------------------------------- reading

    def poll(self) -> Poll:
        """Read the neighbours' new batches and the failure counter; compare."""
        result = Poll()
        store = self.store
        nbr = self.neighbour("w")
        if nbr is not None:
            keys = ["abort", f"c/w/{nbr}", f"h/{nbr}"]
            if not self._world_keys_ready:
                self._world_keys_ready = bool(self._call(store.check, keys))
            if self._world_keys_ready:
                aborts, count, beat = self._call(store.multi_get, keys)
                self._fetch("w", nbr, int(count))
                heartbeat = json.loads(beat)
                self._track_beat(-1 if heartbeat.get("done") else heartbeat["beat"])
                n_aborts = int(aborts)
            else:
                n_aborts = int(self._call(store.add, "abort", 0))
            result.neighbour_silent = time.monotonic() - self._nbr_beat[1]
        else:
            n_aborts = int(self._call(store.add, "abort", 0))
        for stream in list(self._mine):
            if stream == "w":
                continue
            other = self.neighbour(stream)
            if other is not None and self._call(store.check, [f"c/{stream}/{other}"]):
                self._fetch(stream, other, int(self._call(store.get, f"c/{stream}/{other}")))
        result.mismatch = self._compare()
        if n_aborts > self._aborts_seen:
            self._aborts_seen = n_aborts
            result.aborts = self.read_aborts()
        return result

    def _track_beat(self, beat: int) -> None:
        if beat == -1:  # it stopped guarding on purpose: silence is expected
            self._nbr_beat = (-1, time.monotonic())
        elif beat != self._nbr_beat[0]:
            self._nbr_beat = (beat, time.monotonic())

    def _fetch(self, stream: str, other: int, count: int) -> None:
        start = self._read.get(stream, 0)
        if count <= start:
            return
        if count - start > SLOTS:  # it published faster than we read: the oldest slots are overwritten
            start = count - SLOTS
        keys = [f"f/{stream}/{other}/{k % SLOTS}" for k in range(start, count)]
        theirs = self._theirs.setdefault(stream, {})
        for k, raw in zip(range(start, count), self._call(self.store.multi_get, keys)):
            number, payload = raw.decode().split(_BATCH, 1)
            if int(number) != k:  # overwritten by a later batch: these fingerprints cannot be compared
                self.skipped += 1
                continue
            theirs.update((fp.seq, fp) for fp in decode(payload))
        _trim(theirs)
        self._read[stream] = count

    def _compare(self) -> Mismatch | None:
        for stream, mine in self._mine.items():
            theirs = self._theirs.get(stream)
            if not theirs:
                continue
            for seq in sorted(mine.keys() & theirs.keys()):
                a, b = mine.pop(seq), theirs.pop(seq)
                if a.key(self.call_sites) != b.key(self.call_sites):
                    nbr = self.neighbour(stream)
                    assert nbr is not None
                    return Mismatch(stream, seq, a, b, nbr)
                self.verified[stream] = max(self.verified.get(stream, -1), seq)
        return None

    def read_aborts(self) -> dict[int, str]:
        keys = [f"abort/{r}" for r in range(self.world) if r != self.rank]
        found = {}
        for r, key in zip([r for r in range(self.world) if r != self.rank], keys):
            if self._call(self.store.check, [key]):
                found[r] = self._call(self.store.get, key).decode()
        return found

    def heartbeats(self, ranks: list[int]) -> dict[int, dict[str, Any] | None]:
        """Every listed rank's last heartbeat (None: it never published one). O(len(ranks)); on failure only."""
        out: dict[int, dict[str, Any] | None] = {}
        present = [r for r in ranks if self._call(self.store.check, [f"h/{r}"])]
        values = self._call(self.store.multi_get, [f"h/{r}" for r in present]) if present else []
        out.update({r: None for r in ranks})
        out.update({r: json.loads(v) for r, v in zip(present, values)})
        return out

    def fingerprint_at(self, beat: dict[str, Any] | None, stream: str, seq: int) -> Fingerprint | None:
        if beat is None:
            return None
        for fp in decode(beat.get("ring", {}).get(stream, "")):
            if fp.seq == seq:
                return fp
        return None


def _trim(fps: dict[int, Fingerprint]) -> None:
    if len(fps) > _KEEP:
        for seq in sorted(fps)[: len(fps) - _KEEP]:
            del fps[seq]
