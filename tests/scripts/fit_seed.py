"""A tiny 2-rank fit that records what the seed tests check; each rank writes OUT/rank{r}.json.

python tests/scripts/fit_seed.py --out DIR [--strategy ddp_sync] [--seed N] [--local-seed-per-rank]
       [--epochs N] [--save-ckpt] [--resume CKPT] [--workers N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_sync as ls

N = 24


class Indexed(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return i, torch.randn(8, generator=g), torch.tensor(float(i % 3))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module | None = None
        self.seen: list[int] = []
        self.noise: list[float] = []
        self.init_digest = ""
        self.ys: list[float] = []

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 1))
            self.init_digest = digest(torch.cat([p.flatten() for p in self.net.parameters()]))

    def validation_step(self, batch, batch_idx):
        idx, x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(-1), y), sync_dist=True)

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        self.seen += idx.tolist()
        self.ys += y.tolist()
        self.noise.append(float(torch.rand(())))
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class WorkerDraw(Dataset):
    """Returns a torch draw made inside the worker: differs across ranks and workers iff seeded so."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        import numpy as np

        return i, torch.randn(8), torch.tensor(float(np.random.rand()))


class Report(L.Callback):
    """Writes each rank's record at the end of fit, inside the rank's own process (spawn too)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_end(self, trainer: L.Trainer, model: Model) -> None:
        seed = getattr(trainer.strategy, "seed", None)
        for cb in trainer.callbacks:
            if isinstance(cb, ls.SeedBroadcast) and cb.lineage is not None:
                seed = cb.lineage.root
        report = {
            "rank": trainer.global_rank,
            "seed": seed,
            "seen": model.seen,
            "noise": model.noise,
            "ys": model.ys,
            "init_digest": model.init_digest,
            "final_digest": digest(torch.cat([p.flatten() for p in model.parameters()])),
        }
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def main() -> str:
    """Run the fit; return the strategy's name."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", default="ddp_sync")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--local-seed-per-rank", action="store_true")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--save-ckpt", action="store_true")
    p.add_argument("--resume", default=None)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--then-validate", action="store_true")
    p.add_argument("--seed-callback", action="store_true")
    args = p.parse_args()
    if args.local_seed_per_rank:  # what users do by accident: a different seed on every rank
        L.seed_everything(100 + int(os.environ.get("LOCAL_RANK", 0)), verbose=False)
    strategy = (ls.SyncDDPStrategy(seed=args.seed, start_method="spawn" if args.strategy.endswith("spawn") else "popen")
                if args.strategy.startswith("ddp_sync") and args.seed is not None else args.strategy)
    callbacks: list[L.Callback] = [Report(args.out)]
    if args.seed_callback:
        callbacks.append(ls.SeedBroadcast(seed=args.seed))
    if args.save_ckpt:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=args.out, save_last=True, save_top_k=0))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=args.epochs, logger=False,
                        enable_checkpointing=args.save_ckpt,
                        callbacks=callbacks)
    model = Model()
    data = WorkerDraw() if args.workers else Indexed()
    loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=args.workers)
    trainer.fit(model, loader, ckpt_path=args.resume)
    if args.then_validate:
        trainer.validate(model, loader, verbose=False)
        Path(args.out, f"validated{trainer.global_rank}").write_text("ok")
    return args.strategy


if __name__ == "__main__":
    from _baseline_exit import end_baseline  # (tests/scripts/: on the path of a script run)

    if not main().startswith("ddp_sync"):
        end_baseline()
