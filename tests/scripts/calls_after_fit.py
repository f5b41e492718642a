"""fit, then validate, test, predict and validate again in one process, on 2 ranks; each rank writes
OUT/rank{r}.json with every call's metrics, its predictions and how many torch.distributed collectives
the call issued (counted at ``torch.distributed``'s functions, so on gloo: what went through gloo).

python tests/scripts/calls_after_fit.py --out DIR --strategy ddp|ddp_sync [--mismatch]

``--mismatch``: in ``on_validation_epoch_end`` rank 0 calls ``trainer.strategy.barrier()`` and rank 1
``trainer.strategy.broadcast(1)``; the report holds the exception each rank got.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync  # noqa: F401  (registers ddp_sync)
from lightning_sync.guard.intercept import GUARDED_OPS

calls = 0


def _counting(fn: Any) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        global calls
        calls += 1
        return fn(*args, **kwargs)

    return counted


for _name in GUARDED_OPS:  # every collective the guard knows; before any strategy exists: it wraps these wrappers
    if hasattr(dist, _name):
        setattr(dist, _name, _counting(getattr(dist, _name)))


class Model(L.LightningModule):
    def __init__(self, mismatch: bool = False) -> None:
        super().__init__()
        self.net = nn.Linear(5, 1)
        self.mismatch = mismatch
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(101, 5, generator=g), torch.randn(101, 1, generator=g))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)
        self.log("val_max", self.net(batch[0]).max(), sync_dist=True, reduce_fx="max")

    def on_validation_epoch_end(self) -> None:
        if self.mismatch and not self.trainer.sanity_checking:
            if self.global_rank == 0:
                self.trainer.strategy.barrier()
            else:
                self.trainer.strategy.broadcast(1)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def _loader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _loader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", default="ddp_sync")
    parser.add_argument("--mismatch", action="store_true")
    args = parser.parse_args()
    L.seed_everything(3)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=args.strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    model = Model(args.mismatch)
    report: dict[str, Any] = {}
    started = time.monotonic()
    try:
        trainer.fit(model)
        for name in ("validate", "test", "predict", "validate_again"):
            started, before = time.monotonic(), calls
            if name == "predict":
                out = trainer.predict(model)
                value: Any = torch.cat(out).reshape(-1).tolist()
            else:
                call = trainer.test if name == "test" else trainer.validate
                value = call(model, verbose=False)
            report[name] = {"value": value, "collectives": calls - before}
    except Exception as err:  # noqa: BLE001 - the report says what each rank got
        report["error"] = {"type": type(err).__name__, "message": str(err), "trace": traceback.format_exc()[-3000:],
                           "seconds": time.monotonic() - started}  # the failing call's (fit's, under --mismatch)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
