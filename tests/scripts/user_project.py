"""A user's own small project, written the way Lightning's tutorials do (defaults on: progress bar,
model summary, logger), run under one strategy name on 2 CPU ranks; each rank writes OUT/rank{r}.json.

python tests/scripts/user_project.py --out DIR --strategy ddp|ddp_sync [--gather-rows]
    [--namespace=lightning|pytorch_lightning]

torchmetrics Accuracy, a sync_dist loss, a sum-reduced sample count, ModelCheckpoint, EarlyStopping,
LearningRateMonitor, CSVLogger, gradient accumulation and clipping, fit -> validate -> test -> predict,
101 validation and 77 test samples (odd: Lightning's padded sampler repeats one), and
``self.all_gather`` in ``validation_step`` (of a per-batch value; with --gather-rows of the per-sample
logits, whose last batch differs in size across ranks under exact evaluation).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if "--namespace=pytorch_lightning" in sys.argv:  # the standalone package, as older projects import it
    import pytorch_lightning as L
    from pytorch_lightning.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
    from pytorch_lightning.loggers import CSVLogger
else:
    import lightning as L
    from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

import lightning_sync  # noqa: F401, E402  (registers ddp_sync, in pytorch_lightning's registry too once imported)


def blobs(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 8, generator=g) + 1.5 * nn.functional.one_hot(y, 8).float()
    return TensorDataset(x, y)


class Classifier(L.LightningModule):
    def __init__(self, gather_rows: bool = False, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
        self.gathered_shapes: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.log("val_acc", self.val_acc, prog_bar=True)
        self.log("val_count", float(len(y)), reduce_fx="sum", sync_dist=True)
        gathered = self.all_gather(logits if self.hparams.gather_rows else logits.detach().mean())
        self.gathered_shapes.append(list(gathered.shape))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc)
        self.log("test_count", float(len(y)), reduce_fx="sum", sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(blobs(256, 0), batch_size=16, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(blobs(101, 1), batch_size=16)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(blobs(77, 2), batch_size=16)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(blobs(77, 2), batch_size=16)


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: round(float(v), 6) for k, v in sorted(metrics.items())}


def main() -> str:
    """Run the project; return the strategy's name."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--strategy", required=True)
    p.add_argument("--gather-rows", action="store_true")
    p.add_argument("--namespace", choices=["lightning", "pytorch_lightning"], default="lightning")
    args = p.parse_args()
    L.seed_everything(3, verbose=False)
    model = Classifier(gather_rows=args.gather_rows)
    ckpt = ModelCheckpoint(dirpath=args.out / "ckpt", monitor="val_loss", save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=args.strategy, max_epochs=2,
                        accumulate_grad_batches=2, gradient_clip_val=1.0, default_root_dir=args.out,
                        logger=CSVLogger(args.out, name="csv"),
                        callbacks=[ckpt, EarlyStopping("val_loss", patience=5), LearningRateMonitor()])
    report: dict[str, Any] = {"rank": -1}
    try:
        trainer.fit(model)
        report["fit"] = scalars(trainer.callback_metrics)
        with warnings.catch_warnings(record=True) as caught:  # Lightning's own filters stay as they are
            report["validate"] = scalars(trainer.validate(model, verbose=False)[0])
            report["test"] = scalars(trainer.test(model, verbose=False)[0])
        report["eval_warnings"] = sorted(str(w.message)[:90] for w in caught)  # as often as each was shown
        predictions = trainer.predict(model)
        report["predicted"] = sum(len(p) for p in predictions)
        report["best"] = Path(ckpt.best_model_path).name if ckpt.best_model_path else None
        report["global_step"] = trainer.global_step
        report["lr_logged"] = any("lr-SGD" in k for k in trainer.callback_metrics) or (
            trainer.is_global_zero and "lr-SGD" in (args.out / "csv").joinpath(
                "version_0", "metrics.csv").read_text())
        report["error"] = None
    except Exception as err:  # noqa: BLE001 - the outcome is compared, whatever it is
        report["error"] = {"type": type(err).__name__, "message": str(err)}
    report["rank"] = trainer.global_rank
    report["gathered_shapes"] = model.gathered_shapes[-3:]
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report, indent=1))
    return args.strategy


if __name__ == "__main__":
    from _baseline_exit import end_baseline  # (tests/scripts/: on the path of a script run)

    if not main().startswith("ddp_sync"):
        end_baseline()
