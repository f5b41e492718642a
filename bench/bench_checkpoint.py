"""Checkpoint save at 2, 4 and 8 gloo ranks: what the per-rank state (RNG state + loader position) costs
rank 0, gathered into one file (``ddp_sync``; FSDP2 before per-rank files) or written by each rank into
the sharded checkpoint (``model_parallel_sync`` now), beside Lightning's strategies that store none.

    .venv/bin/python bench/bench_checkpoint.py [--worlds 2,4,8] [--saves 8]

Each configuration is a fresh N-process fit (Lightning's launcher) of a small MLP over a map-style set
with 2 loader workers per rank; after step 4 a callback saves ``--saves`` mid-epoch checkpoints and
records, on every rank, the wall time of each ``trainer.save_checkpoint`` and the bytes rank 0 held for
the per-rank state (the gathered entry, serialized). Printed: the median save time on rank 0, the
slowest rank's median, rank 0's state bytes, and their ratios to Lightning's save at the same size.
The per-rank state is what is measured; the model is kept small so that it shows.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

CONFIGS = {  # name -> (strategy, how rank 0 holds the per-rank state)
    "ddp": ("ddp", "none"),
    "ddp_sync": ("ddp_sync", "gathered into the file"),
    "model_parallel": ("model_parallel", "none"),
    "model_parallel_sync (gather, before)": ("model_parallel_sync_gather", "gathered into meta.pt"),
    "model_parallel_sync (per-rank files)": ("model_parallel_sync", "one file per rank"),
}


def one(strategy_name: str, world: int, saves: int, out: Path) -> None:
    import time

    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    import lightning_sync as ls

    class Points(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 4096

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            return torch.randn(32, generator=g), torch.randn(1, generator=g)

    sharded = strategy_name.startswith("model_parallel")

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if not sharded:
                self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

        def configure_model(self) -> None:
            if not sharded or hasattr(self, "net"):
                return
            from torch.distributed.fsdp import fully_shard

            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Saves(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.state_bytes = 0

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step != 4:
                return
            for i in range(saves):
                trainer.strategy.barrier()
                t0 = time.perf_counter()
                trainer.save_checkpoint(out / f"c{i}.ckpt")
                self.times.append(time.perf_counter() - t0)
            path = out / "c0.ckpt"
            if trainer.global_rank == 0:
                ckpt = torch.load(path / "meta.pt" if path.is_dir() else path, weights_only=False)
                entry = ckpt.get("lightning_sync")
                buffer = io.BytesIO()
                torch.save(entry, buffer)
                self.state_bytes = buffer.tell() if entry is not None else 0
            trainer.should_stop = True

    kwargs: dict[str, Any] = {"data_parallel_size": world, "tensor_parallel_size": 1}
    if strategy_name == "model_parallel":
        strategy: Any = L.pytorch.strategies.ModelParallelStrategy(**kwargs)
    elif strategy_name == "model_parallel_sync":
        strategy = ls.SyncModelParallelStrategy(**kwargs)
    elif strategy_name == "model_parallel_sync_gather":
        class Gathering(ls.SyncModelParallelStrategy):
            """Before per-rank files: every rank's state gathered into meta.pt by rank 0."""

            def sharded_checkpoint_directory(self, path: Any, saving: bool) -> None:
                return None

        strategy = Gathering(**kwargs)
    else:
        strategy = strategy_name
    saver = Saves()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[saver])
    trainer.fit(Model(), DataLoader(Points(), batch_size=16, shuffle=True, num_workers=2))
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"times": saver.times,
                                                                    "state_bytes": saver.state_bytes}))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("--configs", default=None, help="comma-separated names of CONFIGS' strategies (default: all)")
    p.add_argument("--one", nargs=3, metavar=("STRATEGY", "WORLD", "OUT"))
    args = p.parse_args()
    if args.one:
        one(args.one[0], int(args.one[1]), args.saves, Path(args.one[2]))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"checkpoint save, {args.saves} mid-epoch saves per fit, 2 loader workers per rank, CPU/gloo")
    print(f"{'ranks':>5}  {'configuration':38} {'rank 0 ms':>9} {'slowest ms':>10} {'rank-0 state':>12}  per-rank state")
    for world in [int(w) for w in args.worlds.split(",")]:
        base: dict[str, float] = {}
        for label, (name, where) in CONFIGS.items():
            if args.configs and name not in args.configs.split(","):
                continue
            with tempfile.TemporaryDirectory() as tmp:
                proc = subprocess.run([sys.executable, __file__, "--saves", str(args.saves), "--one", name,
                                       str(world), tmp], capture_output=True, text=True, env=env, timeout=900)
                reports = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("rank*.json"))]
            if proc.returncode != 0 or len(reports) != world:
                print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                return 1
            rank0 = statistics.median(reports[0]["times"])
            slowest = max(statistics.median(r["times"]) for r in reports)
            family = "ddp" if name.startswith("ddp") else "model_parallel"
            base.setdefault(family, rank0)
            print(f"{world:>5}  {label:38} {rank0 * 1e3:9.2f} {slowest * 1e3:10.2f} {reports[0]['state_bytes']:>10} B"
                  f"  {where}; {rank0 / base[family]:.2f}x Lightning's save")
    return 0


if __name__ == "__main__":
    sys.exit(main())
