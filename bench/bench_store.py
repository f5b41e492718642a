"""The collective guard's store traffic against the world size: requests per rank and on the store's host.

    .venv/bin/python bench/bench_store.py [--worlds 2 4 8 16 64 256] [--turns 200] [--per-turn 1]

Every rank's watchdog talks to the rendezvous store (rank 0's ``TCPStore``, or torchrun's agent) once per
turn (``CollectiveGuard(interval=0.1)``: ten turns a second). This runs the guard's real protocol
(:class:`lightning_sync.guard.protocol.Exchange`) for W ranks in one process over torch's ``HashStore``
behind a proxy that counts every request and the bytes it carries, with ``--per-turn`` collectives
recorded by every rank between two turns (a training step's ``sync_dist`` and DDP bucket, say), and
prints per world size: requests per turn of one rank (mean and max over ranks), the same per second at
the default interval, and the whole store's requests per second (what rank 0's store thread serves).
No network and no processes: the request counts are what grows or not, and they do not depend on
the machine. A rank's traffic must stay flat in W; the store's total grows as W (every rank's own).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lightning_sync.guard.fingerprint import Recorder  # noqa: E402
from lightning_sync.guard.protocol import Exchange  # noqa: E402

INTERVAL = 0.1  # CollectiveGuard's default seconds between two watchdog turns


class CountingStore:
    """Forwards every call to a real store and counts it (one call = one request on the wire)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.requests = 0
        self.bytes = 0

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._store, name)

        def counted(*args: Any) -> Any:
            self.requests += 1
            self.bytes += sum(len(a) if isinstance(a, (str, bytes)) else
                              sum(len(x) for x in a) if isinstance(a, list) else 8 for a in args)
            return fn(*args)

        return counted


def measure(world: int, turns: int, per_turn: int) -> dict[str, float]:
    base = dist.HashStore()
    base.set_timeout(timedelta(seconds=5))
    stores = [CountingStore(base) for _ in range(world)]
    exchanges = [Exchange(stores[r], r, world) for r in range(world)]
    recorders = [Recorder() for _ in range(world)]
    for ex in exchanges:
        ex.start()
    for s in stores:
        s.requests = s.bytes = 0
    for t in range(turns):
        for r in range(world):
            for i in range(per_turn):
                recorders[r].record("w", "all_reduce", "float32[1] op=sum", f"model.py:{40 + i} training_step")
            rec = recorders[r]
            exchanges[r].publish(rec.take_unpublished(), None, {"w": rec.last("w")}, {"w": rec.next_seq("w")})
            exchanges[r].poll()
    per_rank_requests = [s.requests for s in stores]
    for ex in exchanges:  # one more read each (not counted): every rank's last batch is published by now
        ex.poll()
    lag = [turns * per_turn - 1 - ex.verified.get("w", -1) for ex in exchanges]
    assert max(lag) == 0, f"the protocol did not compare every fingerprint: {lag}"
    per_rank = [n / turns for n in per_rank_requests]
    return {"mean": sum(per_rank) / world, "max": max(per_rank), "bytes": sum(s.bytes for s in stores) / world / turns,
            "store": sum(per_rank) / INTERVAL}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16, 64, 256])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--per-turn", type=int, default=1, help="collectives each rank records between two turns")
    args = parser.parse_args()
    print(f"guard protocol over a counting HashStore: {args.turns} turns, {args.per_turn} collective(s) a rank "
          f"a turn, {1 / INTERVAL:g} turns/s (the default interval)")
    print(f"{'ranks':>6} {'req/turn a rank (mean, max)':>28} {'req/s a rank':>13} {'bytes/turn a rank':>18} "
          f"{'store req/s (all ranks)':>24}")
    for world in args.worlds:
        m = measure(world, args.turns, args.per_turn)
        print(f"{world:>6} {m['mean']:>19.2f} {m['max']:>8.2f} {m['mean'] / INTERVAL:>13.1f} {m['bytes']:>18.0f} "
              f"{m['store']:>24.0f}")


if __name__ == "__main__":
    main()
