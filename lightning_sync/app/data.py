"""``DigitsDataModule``: the 8x8 handwritten digits (1797 images, 16 grey levels), shipped inside
this package as ``assets/digits.npz`` (45 KB): nothing is downloaded and no extra package is needed.
Split once with a fixed generator so every rank sees the same split. Items are ``(index, image,
label)``: the dataset index lets validation outputs be gathered exactly (each sample once, however
the sampler pads).

The file holds ``images`` (uint8, 1797 x 64, values 0..16) and ``labels`` (uint8, 1797), the same
arrays in the same order as scikit-learn's ``load_digits()`` (written once from scikit-learn 1.9.1;
tests/test_wheel.py compares them). The data is the UCI "Optical Recognition of Handwritten Digits"
test set (E. Alpaydin, C. Kaynak, 1998; CC BY 4.0).
"""

from __future__ import annotations

from importlib.resources import files

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["DigitsDataModule", "IndexedTensors", "load_digits"]


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The shipped digits: ``(images, labels)``, uint8 tensors of shape (1797, 64) and (1797,)."""
    with files("lightning_sync").joinpath("assets/digits.npz").open("rb") as f, np.load(f) as arrays:
        return torch.from_numpy(arrays["images"].copy()), torch.from_numpy(arrays["labels"].copy())


class IndexedTensors(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """``(index, x, y)`` rows of two aligned tensors."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if len(x) != len(y):
            raise ValueError(f"IndexedTensors: {len(x)} inputs but {len(y)} targets.")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


class DigitsDataModule(L.LightningDataModule):
    """The 8x8 digits as ``(index, 1x8x8 float image in [0, 1], label)``.

    Args:
        batch_size: per-rank batch size.
        val_fraction: share of the 1797 images held out for validation.
        split_seed: seed of the train/validation split (independent of the run's root seed, so a
            seed sweep compares runs on the same held-out set).
        num_workers: data-loader workers per rank.
    """

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2, split_seed: int = 0,
                 num_workers: int = 0) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"DigitsDataModule(batch_size={batch_size}): must be >= 1.")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"DigitsDataModule(val_fraction={val_fraction}): must be in (0, 1).")
        self.batch_size, self.val_fraction = batch_size, val_fraction
        self.split_seed, self.num_workers = split_seed, num_workers
        self.train_set: IndexedTensors | None = None
        self.val_set: IndexedTensors | None = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        images, labels = load_digits()
        x = images.to(torch.float32).view(-1, 1, 8, 8) / 16.0
        y = labels.to(torch.int64)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.split_seed))
        n_val = round(len(x) * self.val_fraction)
        val, train = order[:n_val], order[n_val:]
        self.train_set, self.val_set = IndexedTensors(x[train], y[train]), IndexedTensors(x[val], y[val])

    def train_dataloader(self) -> DataLoader[tuple[int, torch.Tensor, torch.Tensor]]:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader[tuple[int, torch.Tensor, torch.Tensor]]:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=2 * self.batch_size, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)
