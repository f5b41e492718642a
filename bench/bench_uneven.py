"""Cost of ``uneven_batches="join"``, measured side by side in one run.

    python bench/bench_uneven.py                # 2 CPU ranks, --rounds 3 --steps 150

A tiny MLP (batch 64 a rank, one ``self.log(..., sync_dist=True)`` a step) on 2 gloo ranks through
Lightning's launcher; every fit in the same two processes, the first dropped (warm-up), then ABBA.

1. even data, map-style (Lightning's DistributedSampler): ``"join"`` vs ``"error"``, median loop
   iteration (batch start to the next batch start). ``"join"`` checks once at the epoch's start that
   the loader is even and then passes it through: the target is >= 0.97x the steps/s.
2. even data, a stream (an IterableDataset of equal shards): ``"join"`` vs ``"error"``; both agree on
   every batch (a stream's ranks may run out apart), so the exchange's own time per batch is shown too.
3. a 60/40 stream under ``"join"``: the epoch's wall time against the same model on an even stream
   of the longest rank's share on both ranks (as many steps): stand-in steps cost what real ones do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCH, DIM = 64, 32


def run(steps: int, rounds: int, out: Path) -> None:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset

    import lightning_sync as ls
    from lightning_sync.parts.uneven import UnevenBatchPart

    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(n)
            self.x, self.y = torch.randn(n, DIM, generator=g), torch.randn(n, generator=g)

        def __iter__(self):  # type: ignore[no-untyped-def]
            return zip(self.x, self.y)

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(DIM, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
            self.times: list[float] = []
            self._t = 0.0

        def on_train_batch_start(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            now = time.perf_counter()
            if self._t:
                self.times.append(now - self._t)
            self._t = now

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.set_num_threads(1)
    even = TensorDataset(torch.randn(BATCH * 2 * steps, DIM), torch.randn(BATCH * 2 * steps))
    cases = {
        "map error": ("error", lambda rank: DataLoader(even, batch_size=BATCH)),
        "map join": ("join", lambda rank: DataLoader(even, batch_size=BATCH)),
        "stream error": ("error", lambda rank: DataLoader(Stream(BATCH * steps), batch_size=BATCH)),
        "stream join": ("join", lambda rank: DataLoader(Stream(BATCH * steps), batch_size=BATCH)),
        "60/40 join": ("join", lambda rank: DataLoader(Stream(BATCH * steps * (3 if rank == 0 else 2) // 3),
                                                       batch_size=BATCH)),
        "even longest join": ("join", lambda rank: DataLoader(Stream(BATCH * steps), batch_size=BATCH)),
    }
    pairs = [("map error", "map join"), ("stream error", "stream join"), ("even longest join", "60/40 join")]
    results: dict[str, dict[str, list[float]]] = {
        k: {"step_ms": [], "epoch_s": [], "agree_us": [], "agrees": [], "first_ms": [], "last_ms": []} for k in cases}
    order = [pairs[0][0]] + [c for _ in range(rounds) for a, b in pairs for c in (a, b, b, a)]
    for i, name in enumerate(order):
        mode, loader = cases[name]
        strategy = ls.SyncDDPStrategy(seed=0, uneven_batches=mode)
        part = strategy.part(UnevenBatchPart)
        assert part is not None
        spent = [0.0, 0]
        agree = part._agree

        def timed(strategy_: object, record: list[int], agree=agree, spent=spent) -> list[list[int]]:  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return agree(strategy_, record)
            finally:
                spent[0] += time.perf_counter() - t0
                spent[1] += 1

        part._agree = timed  # type: ignore[method-assign]
        model = MLP()
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, loader(int(__import__("os").environ.get("LOCAL_RANK", "0"))))
        if i > 0:
            r = results[name]
            r["step_ms"].append(statistics.median(model.times[10:]) * 1e3)
            r["epoch_s"].append(sum(model.times))
            r["agree_us"].append(spent[0] / max(1, spent[1]) * 1e6)
            r["agrees"].append(spent[1])
            # 60/40: rank 1 runs out after 2/3 of the steps; the steps before and after, apart
            cut = len(model.times) * 2 // 3
            r["first_ms"].append(statistics.median(model.times[10:cut - 5]) * 1e3)
            r["last_ms"].append(statistics.median(model.times[cut + 5:]) * 1e3)
        if trainer.global_rank == 0:
            (out / "uneven.json").write_text(json.dumps(results))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("outputs/bench_uneven"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run(args.steps, args.rounds, args.out)
    import lightning_sync  # noqa: F401

    if int(__import__("os").environ.get("LOCAL_RANK", "0")) != 0:
        return
    r = json.loads((args.out / "uneven.json").read_text())
    med = {k: {m: statistics.median(v[m]) for m in v if v[m]} for k, v in r.items() if v["step_ms"]}
    print(f"bench_uneven: 2 gloo ranks, {args.steps} steps of batch {BATCH} a rank, {args.rounds} ABBA rounds "
          "(medians over fits)")
    for a, b in (("map error", "map join"), ("stream error", "stream join")):
        print(f"  {b:>17}: {med[b]['step_ms']:.3f} ms a step vs {a} {med[a]['step_ms']:.3f}: steps/s ratio "
              f"{med[a]['step_ms'] / med[b]['step_ms']:.3f} (target >= 0.97); exchanges a fit: "
              f"{med[b]['agrees']:.0f} ({med[b]['agree_us']:.0f} us each, the wait for the other rank included) vs "
              f"{med[a]['agrees']:.0f} ({med[a]['agree_us']:.0f} us)")
    a, b = "even longest join", "60/40 join"
    print(f"  60/40 stream, join: epoch {med[b]['epoch_s']:.3f} s vs {med[a]['epoch_s']:.3f} s for the longest "
          f"rank's share on both ranks: {med[b]['epoch_s'] / med[a]['epoch_s']:.3f}x (target <= 1.0x + noise); "
          f"a step while both ranks have data {med[b]['first_ms']:.3f} ms ({med[a]['first_ms']:.3f} even), "
          f"once rank 1 runs stand-ins {med[b]['last_ms']:.3f} ms ({med[a]['last_ms']:.3f} even)")

if __name__ == "__main__":
    main()
