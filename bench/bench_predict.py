"""trainer.predict of 1e6 rows (16 float32 + int64 label) on 2 ranks to ONE ordered file, three ways.

    .venv/bin/python bench/bench_predict.py [--rows 1000000] [--batch 4096] [--repeats 3] [--devices 2]
        [--strategy ddp_sync]

Each way is a full ``trainer.predict`` (a Linear(16, 16), rows built from their index in
``__getitems__``) in the same two rank processes, ending with one file that holds every dataset
index once, in order, on rank 0's disk:

* ``PredictionWriter``: ``ls.PredictionWriter(path)`` (Parquet, snappy): parts streamed per rank,
  k-way merged by rank 0.
* ``BasePredictionWriter + torch.save``: Lightning's documented pattern, ``write_interval="epoch"``:
  every rank ``torch.save``s its predictions and batch indices; after a barrier rank 0 loads every
  rank's file, concatenates, drops duplicates by index, orders and ``torch.save``s the result.
* ``ValidationGather(stages=["predict"], rank_zero_only=True)``: the rows gathered to rank 0 in
  memory at epoch end, then ``torch.save``d.

Figures per way (median of ``--repeats``, the ways alternate their order): rows/s on rank 0 from
``trainer.predict`` to the final file, and rank 0's peak RSS growth over the RSS before the call
(a thread samples ``/proc/self/statm`` every 2 ms) relative to the predictions' bytes
(rows x (8 + 64 + 8)). Ratios are what hold: absolute times on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightning_sync as ls  # noqa: E402
from bench._memory import PeakRSS  # noqa: E402

DIM = 16


class Rows(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.__getitems__([i])

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(indices, dtype=torch.int64)
        x = torch.sin(index.unsqueeze(1).float() * 1e-3 + torch.arange(DIM, dtype=torch.float32))
        return x, index % 10


def as_batch(batch: Any) -> Any:
    return batch


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(DIM, DIM)

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, label = batch
        return {"emb": self.net(x), "label": label}


class TorchSaveWriter(BasePredictionWriter):
    """Lightning's documented per-rank writer."""

    def __init__(self, directory: Path) -> None:
        super().__init__(write_interval="epoch")
        self.directory = directory
        self.rows = 0

    def write_on_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, predictions: Any,
                           batch_indices: Any) -> None:
        torch.save({"predictions": predictions, "batch_indices": batch_indices},
                   self.directory / f"rank{trainer.global_rank}.pt")
        trainer.strategy.barrier()  # every rank's file is complete
        if trainer.global_rank == 0:
            self.rows = hand_merge(self.directory, trainer.world_size, self.directory / "preds.pt")


def hand_merge(directory: Path, world: int, out: Path) -> int:
    index, emb, label = [], [], []
    for r in range(world):
        saved = torch.load(directory / f"rank{r}.pt", weights_only=False)
        preds, indices = saved["predictions"], saved["batch_indices"]
        if preds and isinstance(preds[0], list):  # nested per dataloader
            preds = preds[0]
        if indices and indices[0] and isinstance(indices[0][0], list):
            indices = indices[0]
        for batch, ids in zip(preds, indices):
            index.append(torch.as_tensor(ids))
            emb.append(batch["emb"])
            label.append(batch["label"])
    all_index = torch.cat(index).numpy()
    unique, first = np.unique(all_index, return_index=True)  # sorted, first copy in rank order
    pick = torch.from_numpy(first)
    torch.save({"index": torch.from_numpy(unique), "emb": torch.cat(emb)[pick], "label": torch.cat(label)[pick]}, out)
    return len(unique)


def trainer(args: argparse.Namespace, callbacks: list[Any]) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=args.devices, strategy=args.strategy, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)


def run(way: str, args: argparse.Namespace, work: Path) -> float:
    loader = DataLoader(Rows(args.rows), batch_size=args.batch, collate_fn=as_batch)
    target = work / way
    if target.exists() and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        shutil.rmtree(target)
    target.mkdir(parents=True, exist_ok=True)
    model = Model()
    start = time.perf_counter()
    if way == "PredictionWriter":
        writer = ls.PredictionWriter(target / "preds.parquet", overwrite=True)
        trainer(args, [writer]).predict(model, loader, return_predictions=False)
        assert writer.manifest is not None and writer.manifest["rows"] == args.rows
    elif way == "BasePredictionWriter + torch.save":
        writer = TorchSaveWriter(target)
        t = trainer(args, [writer])
        t.predict(model, loader, return_predictions=False)
        if t.global_rank == 0:
            assert writer.rows == args.rows
    else:
        gather = ls.ValidationGather(stages=["predict"], rank_zero_only=True)
        t = trainer(args, [gather])
        t.predict(model, loader, return_predictions=False)
        if t.global_rank == 0:
            assert len(gather.gathered[0]["index"]) == args.rows
            torch.save(gather.gathered[0], target / "preds.pt")
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--strategy", default="ddp_sync")
    p.add_argument("--work", default=None, help="directory for the files (default: a temporary one, removed)")
    args = p.parse_args()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    work = Path(args.work or os.environ.setdefault("LSYNC_BENCH_DIR", tempfile.mkdtemp(prefix="bench_predict_")))
    ways = ["PredictionWriter", "BasePredictionWriter + torch.save", "ValidationGather(predict)"]
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    growth: dict[str, list[int]] = {w: [] for w in ways}
    for repeat in range(args.repeats):
        order = ways[repeat % 3:] + ways[:repeat % 3]
        for way in order:
            with PeakRSS() as mem:
                elapsed = run(way, args, work)
            seconds[way].append(elapsed)
            growth[way].append(mem.peak - mem.base)
    if rank != 0:
        return
    size = args.rows * (8 + DIM * 4 + 8)
    base = statistics.median(seconds["PredictionWriter"])
    print(f"\n{args.rows} rows x (16 float32 + int64 label), {args.devices} ranks ({args.strategy}), batch {args.batch}; "
          f"predictions {size / 2**20:.0f} MiB; median of {args.repeats}")
    print(f"{'way':<36} {'rows/s':>10} {'time vs PW':>11} {'rank-0 peak RSS growth':>24}")
    result = {}
    for way in ways:
        med = statistics.median(seconds[way])
        mem = statistics.median(growth[way])
        result[way] = {"rows_per_s": args.rows / med, "time_ratio": med / base, "rss_growth_ratio": mem / size}
        print(f"{way:<36} {args.rows / med:>10.0f} {med / base:>10.2f}x {mem / 2**20:>10.0f} MiB = {mem / size:.2f}x")
    print(json.dumps(result))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
