"""Training steps/s of SyncModelParallelStrategy (guard on) vs Lightning's ModelParallelStrategy, FSDP2 on
2 CPU ranks (gloo), one ``sync_dist`` log per step.

    .venv/bin/python bench/bench_fsdp2.py [--rounds 4] [--repeats 3] [--steps 150] [--labels lightning,sync]

Each round is one pair of processes (Lightning's launcher) that fits the labels alternately, ABBA,
after a warm-up fit that is dropped (the first fit of a process is slower), so the machine's drift
hits every label alike. The time per step is one loop iteration, a batch start to the next batch
start: the step and everything the strategy does around it (the per-step flag exchange included).
Labels: ``lightning`` (``ModelParallelStrategy``), ``sync`` (``SyncModelParallelStrategy``, default
guard), ``guard_off`` (``guard=False``), ``no_confirm`` (the guard without ``confirm_first``).
Printed: the median of the per-fit medians per label and each ratio to ``lightning``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _strategy(label: str) -> Any:
    import lightning as L

    import lightning_sync as ls

    sizes = {"data_parallel_size": 2, "tensor_parallel_size": 1}
    if label == "lightning":
        return L.pytorch.strategies.ModelParallelStrategy(**sizes)
    chosen = ls.SyncModelParallelStrategy(seed=1, guard=label != "guard_off", **sizes)
    if label == "no_confirm":
        chosen.guard.confirm_first = False
    return chosen


def _fits(steps: int, repeats: int, labels: list[str], out: Path) -> None:
    import lightning as L
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []
            self._t = 0.0

        def configure_model(self) -> None:
            if hasattr(self, "net"):
                return
            self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            now = time.perf_counter()
            if self._t:
                self.times.append(now - self._t)
            self._t = now

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.set_num_threads(1)
    x = torch.randn(64 * steps, 64)
    data = TensorDataset(x, x[:, :1])
    results: dict[str, list[float]] = {label: [] for label in labels}
    order = [labels[0]] + [label for _ in range(repeats) for label in (*labels, *reversed(labels))]
    for i, label in enumerate(order):
        model = Model()
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=_strategy(label), max_steps=steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, DataLoader(data, batch_size=32))
        if i > 0:
            results[label].append(statistics.median(model.times[steps // 5:]))
        if trainer.global_rank == 0:
            (out / "fit.json").write_text(json.dumps(results))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=4, help="pairs of processes")
    p.add_argument("--repeats", type=int, default=3, help="ABBA repeats within one pair")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--labels", default="lightning,sync")
    p.add_argument("--fit-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    labels = args.labels.split(",")
    if args.fit_out is not None:
        _fits(args.steps, args.repeats, labels, args.fit_out)
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    medians: dict[str, list[float]] = {label: [] for label in labels}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            out = subprocess.run([sys.executable, __file__, "--fit-out", tmp, "--steps", str(args.steps),
                                  "--repeats", str(args.repeats), "--labels", args.labels],
                                 capture_output=True, text=True, env=env, timeout=1800)
            if out.returncode != 0:
                print(out.stdout[-2000:], out.stderr[-3000:], file=sys.stderr)
                return 1
            for label, values in json.loads((Path(tmp) / "fit.json").read_text()).items():
                medians[label] += values
    base = statistics.median(medians["lightning"]) if "lightning" in medians else None
    print(f"FSDP2, 2 CPU ranks, {args.steps} steps a fit, {args.rounds} process pairs x {args.repeats} ABBA "
          "repeats, one sync_dist log a step; ms per loop iteration (batch start to batch start)")
    for label, values in medians.items():
        mid = statistics.median(values)
        ratio = f"  steps/s vs lightning {base / mid:.3f}" if base is not None and label != "lightning" else ""
        print(f"  {label:11s} {mid * 1e3:7.2f} ms/step{ratio}  (per fit: {', '.join(f'{v * 1e3:.2f}' for v in values)})")
    if base is not None and "sync" in medians:
        print(f"  target: sync >= 0.97 of lightning's steps/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
