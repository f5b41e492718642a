"""An evaluation epoch under ``ddp_sync`` (exact shards) vs Lightning's ``ddp`` (padded sampler), same loader.

    .venv/bin/python bench/bench_eval.py [--samples 20001] [--batch 64] [--repeats 5] [--devices 2]

One launch; rank 0 re-runs ``trainer.validate`` alternately under each strategy (round-robin, so a
load spike on a shared machine hits both alike). Timed on every rank from
``on_validation_epoch_start`` to ``on_validation_end`` (the steps, the epoch-end ``sync_dist``
reduction and the torchmetrics sync; not process-group set-up), the slowest rank counts. The step
is ordinary code: an MLP forward, ``self.log("val_loss", ..., sync_dist=True)`` and a logged
torchmetrics ``Accuracy``. Prints the medians, their ratio (target: ``ddp_sync`` <= 1.02x ``ddp``)
and the logged values, which differ: ``ddp`` counts padded samples twice.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightning_sync as ls  # noqa: E402


class Timer(L.Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0 = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        elapsed = torch.tensor([time.perf_counter() - self._t0], dtype=torch.float64)
        self.seconds.append(float(trainer.strategy.reduce(elapsed, reduce_op="max")))


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        self.acc = torchmetrics.Accuracy("multiclass", num_classes=10)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.acc(logits.argmax(-1), y)
        self.log("val_acc", self.acc)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=20_001)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--devices", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(args.samples, 32, generator=g), torch.randint(0, 10, (args.samples,), generator=g))
    loader = DataLoader(data, batch_size=args.batch)
    timers = {"ddp_sync": Timer(), "ddp": Timer()}
    values: dict[str, dict[str, float]] = {}
    for _ in range(args.repeats):
        for name in ("ddp_sync", "ddp"):  # ddp last in each round: it leaves its process group behind
            strategy: Any = ls.SyncDDPStrategy() if name == "ddp_sync" else "ddp"
            trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, logger=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=[timers[name]])
            trainer.validate(Model(), loader, verbose=False)
            values[name] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return
    med = {name: statistics.median(t.seconds) for name, t in timers.items()}
    print(f"evaluation epoch, {args.samples} samples, batch {args.batch}, {args.devices} gloo ranks, "
          f"median of {args.repeats} (slowest rank):")
    for name in timers:
        print(f"  {name:<9} {med[name]:.3f} s   val_loss {values[name]['val_loss']:.6f}   val_acc {values[name]['val_acc']:.6f}")
    print(f"  ddp_sync / ddp: {med['ddp_sync'] / med['ddp']:.3f}x (target <= 1.02x)")
    print(json.dumps({"median_s": med, "ratio": med["ddp_sync"] / med["ddp"], "values": values,
                      "all_s": {k: t.seconds for k, t in timers.items()}}))


if __name__ == "__main__":
    main()
