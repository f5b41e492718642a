"""Runs PredictionWriter through several trainer.predict calls on N ranks; each rank writes OUT/<phase>.rank{r}.json.

python tests/scripts/predict_parquet.py --out DIR [--strategy ddp_sync] [--devices 2] [--phase main|kill|resume]
    [--big 2000003]

``main``: N=7 (strings, ragged tokens, a 2x2 tensor per row; the user's own padded, shuffled
DistributedSampler) -> N=1001 shuffled with 2 workers -> N=1001 custom sampler, write_interval="epoch"
-> N=1001 batch 8 (the configuration of ``kill``/``resume``, for the checksum) -> N=``--big`` rows,
batch 8192 (under ddp a lazy strided sampler), every rank's RSS sampled every 2 ms -> errors: an existing target, a bad batch on rank 1,
an extra key on rank 1. ``kill``: rank 1 SIGKILLs itself at its batch 40. ``resume``: the same run
with resume=True. The test compares every file with a one-process forward pass.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

import lightning_sync as ls

DIM = 16


def features(index: torch.Tensor) -> torch.Tensor:
    """Deterministic rows from dataset indices, vectorised (2M rows in milliseconds)."""
    x = index.to(torch.float32).unsqueeze(1) * (1e-3 * torch.arange(1, DIM + 1, dtype=torch.float32))
    x += torch.arange(DIM, dtype=torch.float32)
    return x.sin_()  # in place: no batch-sized temporaries beyond the result


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(DIM, DIM)


class Rows(Dataset):
    """Row i: (features(i), i % 10, "s{i}"); ``__getitems__`` builds a whole batch at once."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, str]:
        return features(torch.tensor([i]))[0], i % 10, f"s{i}"


class BatchRows(Rows):
    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(indices, dtype=torch.int64)
        return features(index), index % 10


def as_batch(batch: Any) -> Any:  # collate_fn for BatchRows: __getitems__ already made the batch
    return batch


class Reversed(Sampler[int]):
    """A custom (non-distributed) sampler: Lightning wraps it in DistributedSamplerWrapper."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


class Strided(DistributedSampler):
    """Rank r takes r, r + world, ... lazily: torch's DistributedSampler builds list(range(N)) first
    (~100 bytes per row, 200 MB at 2M rows), which would hide the writer's own memory."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, len(self.dataset), self.num_replicas))  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(range(self.rank, len(self.dataset), self.num_replicas))  # type: ignore[arg-type]


class Model(L.LightningModule):
    def __init__(self, rich: bool = False, bad: str = "", kill_at: int = -1) -> None:
        super().__init__()
        self.net = model()
        self.rich, self.bad, self.kill_at = rich, bad, kill_at

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if self.global_rank == 1 and batch_idx == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a rank dies mid-predict (preemption, OOM killer)
        if len(batch) == 2:
            x, label = batch
            names = None
        else:
            x, label, names = batch
        out: dict[str, Any] = {"emb": self.net(x), "label": label}
        if self.rich:
            assert names is not None
            out["name"] = list(names)
            out["tokens"] = [torch.arange(int(n[1:]) % 4) for n in names]  # ragged
            out["square"] = x[:, :4].reshape(-1, 2, 2)
        if self.global_rank == 1 and self.bad == "batch_dim" and batch_idx == 0:
            out["emb"] = out["emb"][:-1]
        if self.global_rank == 1 and self.bad == "extra_key":
            out["extra"] = label.float()
        return out


class PeakRSS(L.Callback):
    """Rank's resident memory, sampled every 2 ms from ``setup`` (the process group and the model
    are ready; nothing of predict has run) until :meth:`stop` (ru_maxrss cannot be reset)."""

    def __init__(self) -> None:
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.now())

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.base = self.peak = self.now()
        self._thread.start()

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())
        return {"base": self.base, "peak": self.peak}


def trainer(args: argparse.Namespace, callbacks: list[L.Callback]) -> L.Trainer:
    strategy: Any = args.strategy
    if args.strategy == "ddp_sync":
        strategy = ls.SyncDDPStrategy(seed=1234, guard_timeout=20)
    return L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy, logger=False,
                     callbacks=callbacks)


def predict(args: argparse.Namespace, loader: DataLoader, path: Path, model: Model | None = None,
            probe: PeakRSS | None = None, **kwargs: Any) -> dict[str, Any]:
    writer = ls.PredictionWriter(path, **kwargs)
    trainer(args, [probe, writer] if probe else [writer]).predict(model or Model(), loader, return_predictions=False)
    assert writer.manifest is not None
    return writer.manifest


def error_of(fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test checks type and message on every rank
        return {"type": type(err).__name__, "message": str(err), "seconds": time.monotonic() - start}
    return {"type": None, "message": "", "seconds": time.monotonic() - start}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", default="ddp_sync")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="cpu", help="gpu: the tests' gpu tier (one process per GPU)")
    p.add_argument("--phase", default="main")
    p.add_argument("--big", type=int, default=2_000_003)
    p.add_argument("--errors", default="exists,batch_dim,extra_key", help="the error cases to run, in this order")
    p.add_argument("--only-big", action="store_true", help="only the big run (to measure memory)")
    args = p.parse_args()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    out = Path(args.out)
    report: dict[str, Any] = {}

    def save() -> None:
        (out / f"{args.phase}.rank{rank}.json").write_text(json.dumps(report))

    def resumable(**kwargs: Any) -> dict[str, Any]:  # the kill / resume / reference configuration
        return predict(args, DataLoader(Rows(1001), batch_size=8), out / "resumable.parquet",
                       row_group_size=16, **kwargs)

    if args.phase == "kill":
        predict(args, DataLoader(Rows(1001), batch_size=8), out / "resumable.parquet", Model(kill_at=40),
                row_group_size=16)
        return
    if args.phase == "resume":
        report["resume"] = resumable(resume=True)
        save()
        return

    world = args.devices
    if not args.only_big:
        padded = DistributedSampler(Rows(7), num_replicas=world, rank=rank, shuffle=True, seed=3)  # repeats samples
        report["n7"] = predict(args, DataLoader(Rows(7), batch_size=2, sampler=padded), out / "n7.parquet",
                               Model(rich=True))
        report["shuffled"] = predict(args, DataLoader(Rows(1001), batch_size=16, shuffle=True, num_workers=2),
                                     out / "shuffled.parquet", Model(rich=True), row_group_size=100,
                                     compression="zstd")
        report["custom"] = predict(args, DataLoader(Rows(1001), batch_size=16, sampler=Reversed(1001)),
                                   out / "custom.parquet", write_interval="epoch", keys=["label", "emb"])
        report["reference_run"] = predict(args, DataLoader(Rows(1001), batch_size=8), out / "reference.parquet",
                                          row_group_size=16)
    big = BatchRows(args.big)
    # ddp_sync: the sampler Lightning injects (its exact-evaluation re-cut holds no index list); ddp: a
    # lazy sampler, since Lightning's DistributedSampler and index wrapper hold the epoch's indices
    lazy = Strided(big, world, rank, shuffle=False) if args.strategy == "ddp" else None
    loader = DataLoader(big, batch_size=8192, collate_fn=as_batch, sampler=lazy)
    probe = PeakRSS()
    report["big"] = predict(args, loader, out / "big.parquet", probe=probe)
    report["big_rss"] = probe.stop()

    # errors, raised on every rank: an existing target; a bad batch on rank 1; an extra key on rank 1
    small = DataLoader(Rows(7), batch_size=2)
    cases = {"exists": lambda: predict(args, small, out / "big.parquet"),
             "batch_dim": lambda: predict(args, small, out / "bad1.parquet", Model(bad="batch_dim")),
             "extra_key": lambda: predict(args, small, out / "bad2.parquet", Model(bad="extra_key"))}
    for case in filter(None, args.errors.split(",")):
        report[case] = error_of(cases[case])
    report["bad_exists"] = (out / "bad1.parquet").exists() or (out / "bad2.parquet").exists()
    save()


if __name__ == "__main__":
    main()
