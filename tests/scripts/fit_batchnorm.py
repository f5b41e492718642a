"""A 2-process CPU fit of a small BatchNorm model, for tests/test_batchnorm_trainer.py.

    python tests/scripts/fit_batchnorm.py OUT_DIR MODE      # MODE: callback | plugin | ddp_sync

Lightning's subprocess launcher re-runs this file for rank 1. Each rank writes OUT_DIR/rank{r}.pt
(state dict after fit, BatchNorm classes during and after fit); rank 0 also saves a checkpoint
OUT_DIR/final.ckpt during fit (the layers are converted at that point).
"""

from __future__ import annotations

import gc
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SAMPLES, BATCH_PER_RANK, WORLD = 64, 8, 2


class BNModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16),
                                 nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 4, generator=g) * torch.tensor([1.0, 5.0, 0.1, 2.0]) + 3.0
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


def main(out_dir: str, mode: str) -> None:
    import lightning.pytorch as pl
    import torch.distributed as dist

    import lightning_sync  # noqa: F401  (registers "ddp_sync" once it exists)
    from lightning_sync.batchnorm import SyncBatchNorm
    from lightning_sync.callbacks.batchnorm import PortableSyncBatchNorm, SyncBatchNormConversion

    classes_in_fit: list[str] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = BNModel()

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            if batch_idx == 0:
                classes_in_fit.extend(type(m).__name__ for m in self.model.modules())
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self) -> DataLoader:
            # Lightning's own sampler always shuffles training data; this one gives rank r the rows
            # r, r + 2, ... so each step covers a known contiguous block of the dataset.
            sampler = DistributedSampler(dataset(), num_replicas=self.trainer.world_size, rank=self.global_rank,
                                         shuffle=False)
            return DataLoader(dataset(), batch_size=BATCH_PER_RANK, sampler=sampler)

    kwargs: dict = {}
    if mode == "callback":
        kwargs = {"strategy": "ddp", "callbacks": [SyncBatchNormConversion()]}
    elif mode == "plugin":
        kwargs = {"strategy": "ddp", "plugins": [PortableSyncBatchNorm()]}
    elif mode == "ddp_sync":
        kwargs = {"strategy": "ddp_sync", "sync_batchnorm": True}
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    callbacks = kwargs.pop("callbacks", [])
    callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=out_dir, filename="final", save_top_k=1))
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, max_epochs=1, logger=False,
                         use_distributed_sampler=False, callbacks=callbacks, **kwargs)
    module = Module()
    trainer.fit(module)
    rank = trainer.global_rank
    assert SyncBatchNorm.__name__ in classes_in_fit, classes_in_fit
    torch.save({"state": module.model.state_dict(), "classes_in_fit": classes_in_fit,
                "classes_after": [type(m).__name__ for m in module.model.modules()]},
               os.path.join(out_dir, f"rank{rank}.pt"))
    # docs/strategy.md: gloo processes may SIGABRT at exit after a DDP backward unless everything is released
    # and the group destroyed on every rank first.
    del trainer, module
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
