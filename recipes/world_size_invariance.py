"""N ranks train the one-process model: world_size_invariant=True, and the checker that proves it for your code.

    python recipes/world_size_invariance.py                  # 1 vs 2 vs 3 CPU ranks, 30 steps: OK
    python recipes/world_size_invariance.py --show-mistake   # the same module with a summed loss: FAILED, and why

The module has what makes a 2-GPU run differ from a 1-GPU run at the same global batch: BatchNorm, augmentation
in __getitem__, dropout, momentum SGD, a shuffled set with a partial last batch (203 samples, global batch 24).
Under `SyncDDPStrategy(world_size_invariant=True)` the loader's batch_size is the global batch (each rank takes its
slice), augmentation is keyed by the sample, dropout by the global batch's rows; BatchNorm needs
`sync_batchnorm=True`. The checker trains each world size in real processes and compares every step's loss,
gradient norm and logged metrics and the final weights (in tests: `assert_world_size_invariant`).
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_sync.testing import check_world_size_invariance


class Points(Dataset):
    keyed_generators = ("torch",)  # what __getitem__ draws from: only it is seeded per sample (the checker checks)

    def __init__(self, n: int, augment: bool = True) -> None:
        self.n, self.augment = n, augment

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.randn(6, generator=torch.Generator().manual_seed(i))
        y = (x[:3].sum() > 0).float()
        if self.augment:
            x = x + 0.2 * torch.randn(6)  # drawn from the global generator: keyed by (seed, epoch, i)
        return x, y


class Model(L.LightningModule):
    summed = False  # --show-mistake: the loss summed over the batch

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.binary_cross_entropy_with_logits(self.net(x).squeeze(-1), y,
                                                  reduction="sum" if self.summed else "mean")
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.binary_cross_entropy_with_logits(self.net(x).squeeze(-1), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def model() -> Model:
    return Model()


def summed_model() -> Model:
    return type("SummedModel", (Model,), {"summed": True})()


def train_loader() -> DataLoader:
    return DataLoader(Points(203), batch_size=24, shuffle=True)  # the one-process loader: 24 is the global batch


def val_loader() -> DataLoader:
    return DataLoader(Points(61, augment=False), batch_size=16)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world-sizes", default="1,2,3")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--show-mistake", action="store_true")
    args = p.parse_args()
    sizes = tuple(int(s) for s in args.world_sizes.split(","))
    report = check_world_size_invariance(model, train_loader, val_loader, world_sizes=sizes,
                                         max_steps=args.max_steps, sync_batchnorm=True)
    print(report)
    for n, gaps in report.gaps.items():
        print(f"{n} ranks vs {sizes[0]}: " + ", ".join(f"{k} {v:.2e}" for k, v in gaps.items()), flush=True)
    if args.show_mistake:
        print("now the same module with its loss summed over the batch (reduction='sum') ...", flush=True)
        print(check_world_size_invariance(summed_model, train_loader, val_loader, world_sizes=sizes[:2],
                                          max_steps=args.max_steps, sync_batchnorm=True), flush=True)


if __name__ == "__main__":
    main()
