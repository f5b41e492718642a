"""A user's own ``@hydra.main`` script (no lightning_sync config), swept with ``-m``: each job fits a tiny
model on 2 CPU ranks under the strategy named by ``+strategy=``; ``+fail=true`` makes rank 0 alone raise
inside training step 2 (rank 1 is left waiting in DDP's gradient all-reduce); ``+then_validate=true`` runs
``trainer.validate`` after the fit, with rank 0 holding on to the fit's process group meanwhile (as an object
that still references it does: its store server stays open). Each finished job writes ``done.json`` in its
output directory, with the ``MASTER_PORT`` of each trainer call.

python tests/scripts/hydra_user_sweep.py -m +strategy=ddp_sync +fail=true,false hydra.sweep.dir=DIR
"""

from __future__ import annotations

import json
from pathlib import Path

import os

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync  # noqa: F401 - registers "ddp_sync"


class Tiny(L.LightningModule):
    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.fail and self.global_rank == 0 and batch_idx == 2:
            raise RuntimeError("rank 0 fails in this job")
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def on_fit_start(self) -> None:
        self.ports = [os.environ["MASTER_PORT"]]
        if self.global_rank == 0:
            self.fit_group = torch.distributed.group.WORLD  # kept past the fit's teardown

    def on_validation_start(self) -> None:
        if not self.trainer.sanity_checking and self.trainer.state.fn == "validate":
            self.ports.append(os.environ["MASTER_PORT"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@hydra.main(version_base=None)
def main(cfg: DictConfig) -> None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=cfg.strategy, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_model_summary=False)
    model = Tiny(bool(cfg.fail))
    trainer.fit(model, DataLoader(data, batch_size=8))
    done = {"fail": bool(cfg.fail), "step": trainer.global_step}
    if cfg.get("then_validate"):
        done["val_loss"] = trainer.validate(model, DataLoader(data, batch_size=8), verbose=False)[0]["val_loss"]
        done["ports"] = model.ports
    if trainer.global_rank == 0:
        out = Path(HydraConfig.get().runtime.output_dir)
        (out / "done.json").write_text(json.dumps(done))


if __name__ == "__main__":
    main()
