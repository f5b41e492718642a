"""A 2-rank ``ddp_sync`` fit that writes a 64 MB checkpoint every step, for the SIGKILL-while-saving test.

python tests/scripts/fit_checkpoints.py --out DIR [--steps N] [--plain-io]

``--plain-io`` uses Lightning's own ``TorchCheckpointIO`` (staged in $TMPDIR, then moved) to show
the difference. Writes DIR/ckpt/{epoch=..-step=..,last}.ckpt.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync as ls


class Big(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4096, 4096)  # 16.8 M parameters: 64 MB of float32 per checkpoint

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        time.sleep(0.2)  # leave the killer time to see the previous save finish
        return self.net(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--plain-io", action="store_true")
    args = p.parse_args()
    strategy = ls.SyncDDPStrategy(checkpoint_io=TorchCheckpointIO() if args.plain_io else None)
    ckpt = ModelCheckpoint(dirpath=Path(args.out) / "ckpt", every_n_train_steps=1, save_top_k=2, monitor="step",
                           mode="max", save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                        callbacks=[ckpt])
    trainer.fit(Big(), DataLoader(TensorDataset(torch.randn(8 * args.steps, 4096)), batch_size=4))


if __name__ == "__main__":
    main()
