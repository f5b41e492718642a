"""Training steps/s of SyncModelParallelStrategy (guard on) vs Lightning's ModelParallelStrategy, FSDP2 on
2 CPU ranks (gloo), one ``sync_dist`` log per step; rounds alternate the two (ABBA), each a fresh
2-process fit; per fit the median step time after a warm-up, then the ratio of the medians.

    .venv/bin/python bench/bench_fsdp2.py [--rounds 4] [--steps 120]

(One fit: ``python bench/bench_fsdp2.py --one model_parallel_sync --steps N`` prints its median.)
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any


def one(strategy: str, steps: int) -> None:
    import lightning as L
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_sync as ls

    class Model(L.LightningModule):
        def configure_model(self) -> None:
            if hasattr(self, "net"):
                return
            self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0

        def on_train_batch_start(self, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.times.append(time.perf_counter() - self.start)

    sizes = {"data_parallel_size": 2, "tensor_parallel_size": 1}
    if strategy.startswith("model_parallel_sync"):
        chosen: Any = ls.SyncModelParallelStrategy(seed=1, guard=not strategy.endswith("guard_off"), **sizes)
        if strategy.endswith("no_confirm"):
            chosen.guard.confirm_first = False
    else:
        chosen = L.pytorch.strategies.ModelParallelStrategy(**sizes)
    clock = Clock()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=chosen, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[clock])
    x = torch.randn(64 * steps, 64)
    trainer.fit(Model(), DataLoader(TensorDataset(x, x[:, :1]), batch_size=32))
    if trainer.global_rank == 0:
        print(f"median_step_s {statistics.median(clock.times[steps // 5:]):.6f}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--one", default=None)
    args = p.parse_args()
    if args.one:
        one(args.one, args.steps)
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    medians: dict[str, list[float]] = {"model_parallel": [], "model_parallel_sync": []}
    for r in range(args.rounds):
        order = ["model_parallel", "model_parallel_sync"]
        for strategy in (order if r % 2 == 0 else order[::-1]):
            out = subprocess.run([sys.executable, __file__, "--one", strategy, "--steps", str(args.steps)],
                                 capture_output=True, text=True, env=env, timeout=600)
            m = re.search(r"median_step_s ([\d.]+)", out.stdout)
            if not m:
                print(out.stdout[-2000:], out.stderr[-3000:], file=sys.stderr)
                return 1
            medians[strategy].append(float(m.group(1)))
    base, ours = statistics.median(medians["model_parallel"]), statistics.median(medians["model_parallel_sync"])
    print(f"FSDP2, 2 CPU ranks, {args.steps} steps x {args.rounds} fits each (ABBA), one sync_dist log a step")
    print(f"  ModelParallelStrategy      {base * 1e3:7.2f} ms/step  ({', '.join(f'{v * 1e3:.2f}' for v in medians['model_parallel'])})")
    print(f"  SyncModelParallelStrategy  {ours * 1e3:7.2f} ms/step  ({', '.join(f'{v * 1e3:.2f}' for v in medians['model_parallel_sync'])})")
    print(f"  steps/s ratio (sync / Lightning): {base / ours:.3f}  (target >= 0.97)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
