"""Trainer runs on one GPU for tests/test_gpu.py; each case writes OUT/<case>.json (and weights).

python tests/scripts/gpu_trainer.py --out DIR --case syncbn|bf16

``syncbn``: a BatchNorm model fitted twice from the same weights and batches (the same root seed),
under ``Trainer(strategy=SyncDDPStrategy(seed=5), sync_batchnorm=True, accelerator="gpu", devices=1)``
(NCCL; the layers become lightning_sync.SyncBatchNorm) and without ``sync_batchnorm`` (plain BatchNorm).
``bf16``: ``precision="bf16-mixed"`` under ``ddp_sync``; a ``sync_dist`` validation loss over 1001
samples (ragged last batch) against the per-sample losses summed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync as ls
from lightning_sync._compat.torch_api import flight_recorder_dump


def data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g) * 3 + 1
    return TensorDataset(x, (x[:, :1] * 0.5 - x[:, 1:2]).squeeze(1))


class BNModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.bn_classes: set[str] = set()
        self.losses: list[float] = []
        self.val_sum = 0.0
        self.val_count = 0
        self.backend: str | None = None

    def on_train_start(self) -> None:
        self.bn_classes = {f"{type(m).__module__}.{type(m).__name__}" for m in self.modules()
                           if isinstance(m, nn.modules.batchnorm._BatchNorm)}
        dist = torch.distributed
        self.backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.losses.append(float(loss))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        per_sample = (self.net(x).squeeze(-1).float() - y) ** 2
        self.val_sum += float(per_sample.double().sum())
        self.val_count += len(y)
        self.log("val_loss", per_sample.mean(), sync_dist=True, batch_size=len(y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


ACCELERATOR = "gpu"  # --accelerator cpu: the same runs on CPU (to try the script where there is no GPU)


def fit(strategy: Any, initial: dict[str, torch.Tensor], **kwargs: Any) -> tuple[BNModel, L.Trainer]:
    model = BNModel()
    model.load_state_dict(initial)
    trainer = L.Trainer(accelerator=ACCELERATOR, devices=1, strategy=strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, **kwargs)
    trainer.fit(model, DataLoader(data(256), batch_size=32), DataLoader(data(1001, seed=1), batch_size=64))
    return model, trainer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--case", required=True, choices=["syncbn", "bf16"])
    p.add_argument("--accelerator", default="gpu")
    args = p.parse_args()
    global ACCELERATOR
    ACCELERATOR = args.accelerator
    device = "cuda" if args.accelerator == "gpu" else "cpu"
    torch.manual_seed(0)
    initial = BNModel().state_dict()
    report: dict[str, Any] = {}
    if args.case == "syncbn":
        # the same root seed: the same shuffled batches (Lightning shuffles training data under DDP)
        for name, sync in (("syncbn", True), ("plain", False)):
            model, trainer = fit(ls.SyncDDPStrategy(seed=5), initial, sync_batchnorm=sync)
            report[name] = {"bn_classes": sorted(model.bn_classes), "device": str(trainer.strategy.root_device),
                            "backend": model.backend, "strategy": type(trainer.strategy).__name__}
            if name == "syncbn":  # the guard turned NCCL's flight recorder on before the group existed
                dump = flight_recorder_dump()
                entries = pickle.loads(dump).get("entries", []) if dump else []
                report["flight_recorder"] = {"buffer": os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"),
                                             "entries": len(entries)}
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, args.out / f"{name}.pt")
    else:
        model, trainer = fit("ddp_sync", initial, precision="bf16-mixed")
        model.val_sum, model.val_count = 0.0, 0
        with torch.autocast(device, dtype=torch.bfloat16):
            loss_dtype = str(model.to(device).net(data(2)[:][0].to(device)).dtype)
        result = trainer.validate(model, DataLoader(data(1001, seed=1), batch_size=64))[0]
        report = {"precision": trainer.precision, "loss_dtype": loss_dtype, "val_loss": result["val_loss"],
                  "val_loss_by_hand": model.val_sum / model.val_count, "val_count": model.val_count,
                  "train_loss_first": model.losses[0], "train_loss_last": model.losses[-1]}
    (args.out / f"{args.case}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
