"""The guard's error messages: pure functions of what the ranks recorded (no I/O, no torch calls)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_sync.errors import CollectiveMismatchError, LightningSyncError
from lightning_sync.guard.fingerprint import Fingerprint

__all__ = ["PeerState", "first_line", "lost", "mismatch", "stall"]

_FIX = (
    "Every rank must issue the same collectives in the same order: look for a collective, "
    "self.log(..., sync_dist=True), trainer.save_checkpoint or strategy.barrier inside a rank-dependent branch "
    "(`if self.global_rank == 0:`, `if trainer.is_global_zero:`) or in a loop whose length differs across "
    "ranks, and move it where every rank runs it (log with rank_zero_only=True instead of sync_dist inside "
    "such branches)."
)


@dataclass(frozen=True)
class PeerState:
    """What a rank was doing when another rank diagnosed a stall, read from its heartbeat."""

    rank: int
    #: "same" / "different" / "ahead" (it recorded this collective: ``at`` is its fingerprint there),
    #: "behind" (it never reached it: ``last`` is its last one), "stopped", "dead", "silent", "absent"
    status: str
    at: Fingerprint | None = None
    last: Fingerprint | None = None
    busy: bool = False  #: blocked in a guarded collective (``last``) right now
    detail: str = ""  #: e.g. "no heartbeat for 12 s", "process 4242 on host-a"


def first_line(error: BaseException | str, limit: int = 400) -> str:
    """The first line of ``error``'s message, for quoting in another rank's error: cut at a word before ``limit``
    characters, with ``[...]`` where it was cut (the whole message is in the rank's own log)."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    if len(line) <= limit:
        return line
    cut = line[:limit].rsplit(" ", 1)[0] if " " in line[:limit] else line[:limit]
    return cut.rstrip(",;:") + " [...]"


def mismatch(seq: int, fingerprints: dict[int, Fingerprint | None], note: str = "") -> CollectiveMismatchError:
    """Ranks recorded different collectives at ``seq``."""
    described = {r: (fp.describe() if fp is not None else "not recorded (its ring has moved on)")
                 for r, fp in sorted(fingerprints.items())}
    known = [fp for fp in fingerprints.values() if fp is not None]
    same_op = len({(fp.op, fp.match) for fp in known}) == 1
    message = (
        f"ranks entered different collectives (guarded collective #{seq}{note}): "
        + "; ".join(f"rank {r} {text}" for r, text in described.items()) + ". "
        + ("The operation matches but the call sites differ: the ranks are at different points of the program, "
           "and the collective would combine unrelated values (e.g. different metrics logged with sync_dist=True). "
           if same_op else "")
        + _FIX + " If different lines on purpose issue the same collective, use CollectiveGuard(match_call_sites=False)."
    )
    return CollectiveMismatchError(message, described)


def _state_text(s: PeerState, seq: int) -> str:
    if s.status in ("same", "different", "ahead"):
        assert s.at is not None
        return f"rank {s.rank} {s.at.describe()}" + (" (it is further on)" if s.status == "ahead" else "")
    if s.status == "behind" and s.detail == "left":
        last = f"; its last collective was #{s.last.seq} {s.last.describe()}" if s.last is not None else ""
        return f"rank {s.rank} never reached it: it has stopped guarding (left its guarded block or torn down){last}"
    if s.status == "behind":
        if s.last is None:
            text = f"rank {s.rank} never reached it and has issued no guarded collective yet"
        else:
            text = f"rank {s.rank} never reached it; its last collective was #{s.last.seq} {s.last.describe()}"
            text += (" (it is still blocked in that one)" if s.busy and s.last.seq < seq - 1 else
                     " (which every rank completed); it is outside any guarded collective: computing, or in a "
                     "collective the guard cannot see (DDP's gradient all-reduce in backward)"
                     if not s.busy else " (it is blocked in it)")
        return text
    if s.status == "stopped":
        return f"rank {s.rank} is frozen: its process is stopped ({s.detail}), e.g. SIGSTOP or a debugger"
    if s.status == "dead":
        return f"rank {s.rank} is dead: its process ended ({s.detail})"
    if s.status == "silent":
        return f"rank {s.rank} is unresponsive: {s.detail} (frozen or dead)"
    return f"rank {s.rank} has not started the guard ({s.detail or 'no heartbeat'})"


def stall(seq: int, timeout: float, me: int, mine: Fingerprint | None, waited: float,
          states: list[PeerState]) -> LightningSyncError | None:
    """Rank ``me`` made no progress for ``waited`` s: name the ranks that hold it up (None: all are in it)."""
    if any(s.status == "different" for s in states) and mine is not None:
        return mismatch(seq, {me: mine, **{s.rank: s.at for s in states if s.status in ("same", "different", "ahead")}})
    lost_ranks = [s for s in states if s.status in ("dead", "stopped", "silent")]
    missing = [s for s in states if s.status in ("behind", "absent")] + lost_ranks
    if not missing:
        return None  # every rank is in this collective: slow, not wrong (the hang dump covers it)
    where = f"rank {me} {mine.describe()} (waited {waited:.0f} s)" if mine is not None else f"rank {me} (waited {waited:.0f} s)"
    parts = [where] + [_state_text(s, seq) for s in sorted(states, key=lambda s: s.rank)]
    values: dict[int, str] = {me: mine.describe() if mine is not None else "waiting"}
    values.update({s.rank: (s.at.describe() if s.at is not None else s.status) for s in states})
    names = ", ".join(str(s.rank) for s in missing)
    if lost_ranks and len(lost_ranks) == len(missing):
        dead = [s for s in lost_ranks if s.status == "dead"]
        what = "died" if len(dead) == len(lost_ranks) else "stopped making progress"
        return LightningSyncError(
            f"rank(s) {names} {what} while the others waited in guarded collective #{seq}: " + "; ".join(parts)
            + ". The run cannot continue; look at that rank's log (out of memory, a signal, a crash in native code) "
            "and restart from the last checkpoint.")
    return CollectiveMismatchError(
        f"rank(s) {names} did not reach guarded collective #{seq} within {timeout:g} s: " + "; ".join(parts)
        + ". The missing rank is either in a collective the others never enter (e.g. DDP's gradient all-reduce in "
        "backward while this rank runs a collective inside an `if rank == 0:` branch), finished early (fewer batches "
        "than the others), or working alone longer than the guard timeout. Make every rank issue the same "
        "collectives (see its stack on its stderr), or raise guard_timeout if one rank legitimately works alone "
        "that long.", values)


def lost(ranks: dict[int, str], error: BaseException | None, where: str) -> LightningSyncError:
    """Peers that died (``ranks``: rank -> detail) while this rank was ``where``."""
    names = ", ".join(map(str, sorted(ranks)))
    detail = "; ".join(f"rank {r}: {text}" for r, text in sorted(ranks.items()))
    return LightningSyncError(
        f"rank(s) {names} died {where}: {detail}. The run cannot continue; look at that rank's log (out of memory, a "
        "signal, a crash in native code) and restart from the last checkpoint."
        + (f" (The process group reported: {first_line(error)})" if error is not None else ""))
