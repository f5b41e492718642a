"""A new user's 2-rank fit with one of the classic mistakes (a collective on rank 0 only), every Lightning default
on (logger, checkpointing, sanity check, progress bar), ``strategy="ddp_sync"`` as a string and the error left
uncaught, as a user's own script leaves it. Run by tests/test_guard.py:

    python user_mistake.py OUT SCENARIO [STRATEGY]      # STRATEGY: ddp_sync (default), or ddp to compare

Writes ``OUT/mistake_at`` (when rank 0 made the mistake) and ``OUT/ended_rank<r>`` (when rank ``r``'s
interpreter exited, after its traceback was printed).
"""

from __future__ import annotations

import atexit
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync  # noqa: F401 - registers "ddp_sync"

OUT, SCENARIO = Path(sys.argv[1]), sys.argv[2]
STRATEGY = sys.argv[3] if len(sys.argv) > 3 else "ddp_sync"


def mistake() -> None:
    (OUT / "mistake_at").write_text(repr(time.time()))


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))

    def setup(self, stage: str) -> None:
        atexit.register(lambda rank=self.global_rank: (OUT / f"ended_rank{rank}").write_text(repr(time.time())))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)
        if self.global_rank == 0 and batch_idx == 2:
            if SCENARIO in ("train_all_reduce", "train_all_reduce_bn"):
                mistake()
                dist.all_reduce(loss.detach().clone())  # mistake: train
            elif SCENARIO == "train_barrier":
                mistake()
                dist.barrier()  # mistake: barrier
            elif SCENARIO == "train_log":
                mistake()
                self.log("rank0_loss", loss, sync_dist=True)  # mistake: log
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)
        if SCENARIO == "val_all_reduce" and self.global_rank == 0 and batch_idx == 1:
            mistake()
            dist.all_reduce(loss.detach().clone())  # mistake: val
        self.log("val_loss", loss, sync_dist=True)

    def on_train_epoch_end(self) -> None:
        if SCENARIO == "epoch_end_all_reduce" and self.global_rank == 0:
            mistake()
            dist.all_reduce(torch.ones(2))  # mistake: epoch end

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=STRATEGY, max_epochs=2, default_root_dir=str(OUT),
                        sync_batchnorm=SCENARIO.endswith("_bn"))
    trainer.fit(Model(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
