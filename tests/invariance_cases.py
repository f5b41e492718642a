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


class _OwnNoise(Model):
    own_noise = True


class _Summed(Model):
    reduction = "sum"


class _LogUnsynced(Model):
    log_unsynced = True


def own_noise() -> Model:
    return _OwnNoise()


def summed_loss() -> Model:
    return _Summed()


def log_unsynced() -> Model:
    return _LogUnsynced()


def weighted_loader() -> DataLoader:
    return DataLoader(Points(), batch_size=12, sampler=WeightedRandomSampler([1.0] * 203, 203))
