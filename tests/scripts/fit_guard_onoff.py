"""A 3-rank ddp_sync fit with SyncBatchNorm and sync_dist logs, with the guard on or off.

    python tests/scripts/fit_guard_onoff.py OUT_DIR on|off

Lightning's subprocess launcher re-runs this file for ranks 1 and 2. Each rank writes OUT_DIR/rank{r}.pt:
the weights and BatchNorm statistics after fit and every value it logged with ``sync_dist=True`` (per
step and per epoch). Three ranks, because with two every order of a sum is the same one; uneven
batches per rank (10 samples on 3 ranks, batch 2), so the SyncBatchNorm statistics combine counts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync as ls


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        self.logged: list[tuple[str, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        # a value whose sum over 3 ranks depends on the order of additions in its last bits
        self.log("train_loss", loss * 1.1e-3 + 1e3, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.logged += [(k, float(v)) for k, v in sorted(self.trainer.callback_metrics.items())]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out: Path, guard: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 4, generator=g) * 3 + 1
    data = TensorDataset(x, x.sum(1, keepdim=True).cos())
    torch.manual_seed(0)  # the same initial weights in both runs (DDP copies rank 0's to the others)
    model = Model()
    trainer = L.Trainer(accelerator="cpu", devices=3, strategy=ls.SyncDDPStrategy(seed=11, guard=guard),
                        sync_batchnorm=True, max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=2, shuffle=True), DataLoader(data, batch_size=4))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    epoch_end = {k: float(v) for k, v in trainer.callback_metrics.items()}
    torch.save({"state": state, "logged": model.logged, "epoch_end": epoch_end},
               out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] == "on")
