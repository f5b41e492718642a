"""LightningModules and loaders for the world-size invariance checker's tests (importable: the checker's runs
import them in new processes). ``good`` is invariant; each other model carries one cause the checker names."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler


class Points(Dataset):
    def __init__(self, n: int = 203) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(6, generator=g)
        return x + 0.1 * torch.randn(6), torch.tensor(float(x[:3].sum() > 0))  # augmentation: keyed per sample


class Model(L.LightningModule):
    reduction = "mean"
    own_noise = False
    log_unsynced = False

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.own_noise:
            x = x + 0.1 * torch.randn_like(x)  # drawn from each rank's own stream
        loss = nn.functional.binary_cross_entropy_with_logits(self.net(x).squeeze(-1), y, reduction=self.reduction)
        self.log("train_loss", loss, sync_dist=not self.log_unsynced)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def good() -> Model:
    return Model()


def train_loader() -> DataLoader:
    return DataLoader(Points(), batch_size=12, shuffle=True)


def val_loader() -> DataLoader:
    return DataLoader(Points(61), batch_size=8)


class _PlainPoints(Points):
    def __getitem__(self, i: int):
        x = torch.randn(6, generator=torch.Generator().manual_seed(i))
        return x, torch.tensor(float(x[:3].sum() > 0))  # no augmentation: nothing drawn while loading


def val_plain_loader() -> DataLoader:
    return DataLoader(_PlainPoints(61), batch_size=8)


class _OwnNoise(Model):
    own_noise = True


class _Summed(Model):
    reduction = "sum"


class _LogUnsynced(Model):
    log_unsynced = True


def own_noise() -> Model:
    return _OwnNoise()


class _Jitter(nn.Module):
    def forward(self, x):
        return nn.functional.dropout(x, 0.2, training=self.training)  # drawn from each rank's own stream


def forward_noise() -> Model:
    model = Model()
    model.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), _Jitter(), nn.Linear(16, 1))
    return model


def summed_loss() -> Model:
    return _Summed()


def log_unsynced() -> Model:
    return _LogUnsynced()


class _TorchOnlyDeclared(Points):
    """Declares torch as its only generator (so only torch's is seeded per sample) but draws numpy noise too."""

    keyed_generators = ("torch",)

    def __getitem__(self, i: int):
        import numpy as np

        x, y = super().__getitem__(i)
        return x + 0.1 * torch.from_numpy(np.random.randn(6)).float(), y


def numpy_undeclared_loader() -> DataLoader:
    return DataLoader(_TorchOnlyDeclared(), batch_size=12, shuffle=True)


def weighted_loader() -> DataLoader:
    return DataLoader(Points(), batch_size=12, sampler=WeightedRandomSampler([1.0] * 203, 203))


class _Validated(Model):
    """Logs a validation loss: the validation set (``val_loader``) draws its augmentation while loading, which is
    not keyed by the sample (only the training set's samples are)."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.binary_cross_entropy_with_logits(self.net(x).squeeze(-1), y)
        self.log("val_loss", loss, sync_dist=True)


def validated() -> Model:
    return _Validated()


class _HangsOnRank1(Model):
    """On 2 ranks, rank 1 never reaches its third step (a hang); every rank writes its pid into
    ``$LSYNC_TEST_PIDS`` first."""

    def on_fit_start(self) -> None:
        import os
        from pathlib import Path

        Path(os.environ["LSYNC_TEST_PIDS"], f"{self.trainer.world_size}-{self.global_rank}").write_text(
            str(os.getpid()))

    def training_step(self, batch, batch_idx):
        import time

        if self.trainer.world_size == 2 and self.global_rank == 1 and batch_idx == 2:
            time.sleep(3600)
        return super().training_step(batch, batch_idx)


def hangs_on_rank1() -> Model:
    return _HangsOnRank1()
