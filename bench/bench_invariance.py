"""Cost of ``world_size_invariant=True``, measured side by side in one run.

    python bench/bench_invariance.py            # 2 CPU ranks, --rounds 3 --steps 150 --workers 0

A tiny MLP (batch 64 a rank, one ``self.log(..., sync_dist=True)`` a step) on 2 gloo ranks through
Lightning's launcher, ``SyncDDPStrategy(world_size_invariant=True)`` (a loader of batch 128, the global
batch) against ``world_size_invariant=False`` (a loader of batch 64 a rank), the same samples a step; every
fit in the same two processes, the first dropped (warm-up), then ABBA. Median loop iteration (batch start to
the next batch start). ``--workers 0`` (default): the main process loads, so the keyed seeding of each sample
(~8 us a sample) is on the step's path; ``--workers 2`` moves it into the workers.

1. ``light``: a sample is a stored vector plus ``torch.randn`` noise (~1 us of work): the worst case for the
   per-sample keyed seeding.
2. ``image``: a random 28x28 crop and flip of a stored 3x32x32 image (torch), a common augmentation.
3. ``dropout``: ``light`` data, the MLP with two ``nn.Dropout(0.1)`` layers: each rank hashes its own rows'
   mask elements (counter-based, keyed by the element's place in the global batch).
4. ``declared``: ``light`` data whose class says ``keyed_generators = ("torch",)``: only torch's generator is
   seeded per sample (~5.5 us a trivial sample instead of ~17 for all three).
Target: >= 0.95x the steps/s.

Then, in one process, one dropout layer's forward on a rank's rows of a global batch of 256 x 1024 as N = 1, 2,
4, 8, 16 ranks would run it: the invariant layer against ``nn.Dropout`` (the per-rank mask), microseconds a call;
both should fall as 1/N (a rank's cost is its own rows').
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCH, DIM = 64, 32
KINDS = ("light", "image", "dropout", "declared")


def run(steps: int, rounds: int, workers: int, out: Path) -> None:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    import lightning_sync as ls

    class Light(Dataset):  # type: ignore[type-arg]
        def __init__(self, n: int) -> None:
            self.x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
            return self.x[i] + 0.1 * torch.randn(DIM), self.x[i, 0]

    class Declared(Light):
        keyed_generators = ("torch",)  # what it draws from: only torch's generator is seeded per sample

    class Image(Dataset):  # type: ignore[type-arg]
        def __init__(self, n: int) -> None:
            self.x = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
            top, left = torch.randint(0, 5, (2,)).tolist()
            crop = self.x[i, :, top:top + 28, left:left + 28]
            if torch.rand(()) < 0.5:
                crop = crop.flip(-1)
            return crop.mean(0).flatten()[:DIM], self.x[i, 0, 0, 0]

    class MLP(L.LightningModule):
        def __init__(self, dropout: float) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(DIM, 128), nn.ReLU(), nn.Dropout(dropout), nn.Linear(128, 128),
                                     nn.ReLU(), nn.Dropout(dropout), nn.Linear(128, 1))
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
    n = BATCH * 2 * steps
    data = {"light": Light(n), "image": Image(n), "declared": Declared(n)}
    cases = {f"{kind} {mode}": (kind, mode) for kind in KINDS for mode in ("off", "on")}
    pairs = [(f"{k} off", f"{k} on") for k in KINDS]
    results: dict[str, list[float]] = {k: [] for k in cases}
    order = [pairs[0][0]] + [c for _ in range(rounds) for a, b in pairs for c in (a, b, b, a)]
    for i, name in enumerate(order):
        kind, mode = cases[name]
        invariant = mode == "on"
        loader = DataLoader(data["light" if kind == "dropout" else kind], batch_size=BATCH * (2 if invariant else 1),
                            shuffle=True, num_workers=workers, persistent_workers=workers > 0)
        model = MLP(0.1 if kind == "dropout" else 0.0)
        trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
                            strategy=ls.SyncDDPStrategy(seed=0, world_size_invariant=invariant),
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, loader)
        if i > 0:
            results[name].append(statistics.median(model.times[10:]) * 1e3)
        if trainer.global_rank == 0:
            (out / "invariance.json").write_text(json.dumps(results))


def dropout_layer(rows: int = 256, width: int = 1024, calls: int = 30) -> None:
    import torch
    from torch import nn

    from lightning_sync.invariance import DropoutStep, dropout_step, make_dropout_invariant

    torch.set_num_threads(1)
    plain, keyed = nn.Dropout(0.1), nn.Dropout(0.1)
    make_dropout_invariant(keyed)
    print(f"  one dropout layer's forward, rank 0's rows of a global batch of {rows} x {width} (median of {calls}):")
    for n in (1, 2, 4, 8, 16):
        local = rows // n
        x = torch.randn(local, width)
        times = {}
        for name, layer in (("nn.Dropout", plain), ("invariant", keyed)):
            samples = []
            for call in range(calls + 3):
                with dropout_step(DropoutStep(root=0, epoch=0, step=call, rows=rows, offset=0, local=local)):
                    start = time.perf_counter()
                    layer(x)
                    samples.append(time.perf_counter() - start)
            times[name] = statistics.median(samples[3:]) * 1e6
        print(f"    N={n:>2} ({local:>3} rows): invariant {times['invariant']:8.1f} us, nn.Dropout "
              f"{times['nn.Dropout']:8.1f} us: {times['invariant'] / times['nn.Dropout']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=0, help="data-loader workers a rank (0: the main process loads)")
    p.add_argument("--out", type=Path, default=Path("outputs/bench_invariance"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run(args.steps, args.rounds, args.workers, args.out)
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    r = json.loads((args.out / "invariance.json").read_text())
    print(f"bench_invariance: 2 gloo ranks, {args.steps} steps of batch {BATCH} a rank, num_workers={args.workers}, "
          f"{args.rounds} ABBA rounds (median loop iteration over fits)")
    for kind in KINDS:
        off, on = statistics.median(r[f"{kind} off"]), statistics.median(r[f"{kind} on"])
        print(f"  {kind:>8}: world_size_invariant=True {on:.3f} ms a step vs False {off:.3f}: steps/s ratio "
              f"{off / on:.3f} (target >= 0.95)")
    dropout_layer()


if __name__ == "__main__":
    main()
