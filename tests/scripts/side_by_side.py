"""The same Lightning features under one strategy name, on 2 ranks; each rank writes OUT/rank{r}.json.

python tests/scripts/side_by_side.py --out DIR --strategy ddp|ddp_sync

Run once with ``ddp`` and once with ``ddp_sync`` by tests/test_dropin.py, which compares the reports:
LightningCLI with ``--trainer.strategy NAME``; fit with checkpoints, validate, test, predict; resume
from the last checkpoint; ``find_unused_parameters=True`` and ``static_graph=True``; the tuner's
batch-size finder. Every step records its outcome (values or the exception's type and message).
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.tuner import Tuner
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync  # noqa: F401  (registers ddp_sync)

SEED = 7


class Model(L.LightningModule):
    def __init__(self, unused_branch: bool = False, batch_size: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        self.unused = nn.Linear(6, 1) if unused_branch else None  # never used: find_unused_parameters
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(40, 6, generator=g), torch.randn(40, 1, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def _loader(self, shuffle: bool) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=shuffle)

    def train_dataloader(self) -> DataLoader:
        return self._loader(True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(False)


def checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def outcome(step: Callable[[], Any]) -> dict[str, Any]:
    try:
        return {"ok": step()}
    except Exception as exc:  # the outcome is compared, whatever it is
        return {"error": type(exc).__name__, "message": str(exc).splitlines()[0][:300],
                "where": traceback.format_exc(limit=-2)[-600:]}


def kwargs(trainer_args: dict[str, Any]) -> dict[str, Any]:
    return dict(accelerator="cpu", devices=2, logger=False,
                **trainer_args)


def main() -> str:
    """Run the project; return the strategy's name."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--strategy", required=True)
    args = p.parse_args()
    name = args.strategy
    report: dict[str, Any] = {}
    L.seed_everything(SEED, verbose=False)

    # 1. LightningCLI: the strategy by its registry name on the command line; fit with checkpoints.
    ckpt_dir = args.out / "ckpt"
    cli = LightningCLI(Model, run=False, save_config_kwargs={"overwrite": True}, args=[
        f"--trainer.strategy={name}", "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_epochs=2",
        "--trainer.logger=false",
        f"--trainer.default_root_dir={args.out}"])
    trainer = cli.trainer
    trainer.callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True))
    rank = trainer.global_rank

    def fit() -> dict[str, Any]:
        trainer.fit(cli.model)
        return {"strategy": type(trainer.strategy).__name__, "step": trainer.global_step,
                "checksum": round(checksum(cli.model), 6),
                "metrics": {k: round(float(v), 6) for k, v in sorted(trainer.callback_metrics.items())}}
    report["cli_fit"] = outcome(fit)
    report["validate"] = outcome(lambda: [{k: round(v, 6) for k, v in d.items()} for d in trainer.validate(cli.model)])
    report["test"] = outcome(lambda: [{k: round(v, 6) for k, v in d.items()} for d in trainer.test(cli.model)])
    report["predict"] = outcome(lambda: sum(len(b) for b in trainer.predict(cli.model) or []))

    # 2. Resume from the last checkpoint to a third epoch.
    def resume() -> dict[str, Any]:
        L.seed_everything(SEED, verbose=False)
        model = Model()
        t = L.Trainer(strategy=name, max_epochs=3, default_root_dir=args.out, **kwargs({}))
        t.fit(model, ckpt_path=str(ckpt_dir / "last.ckpt"))
        return {"step": t.global_step, "epoch": t.current_epoch, "checksum": round(checksum(model), 6)}
    report["resume"] = outcome(resume)

    # 3. DDP options through the strategy object's constructor.
    def ddp_option(**options: Any) -> Callable[[], Any]:
        def run() -> dict[str, Any]:
            from lightning.pytorch.strategies import StrategyRegistry

            entry = StrategyRegistry[name]
            strategy = entry["strategy"](**{**entry["init_params"], **options})
            L.seed_everything(SEED, verbose=False)  # the model starts from the same weights under both strategies
            model = Model(unused_branch=bool(options.get("find_unused_parameters")))
            t = L.Trainer(strategy=strategy, max_epochs=1, **kwargs({"enable_checkpointing": False}))
            t.fit(model)
            return {"step": t.global_step, "checksum": round(checksum(model), 6)}
        return run
    report["find_unused_parameters"] = outcome(ddp_option(find_unused_parameters=True))
    report["static_graph"] = outcome(ddp_option(static_graph=True))

    # 4. The tuner's batch-size finder (Lightning refuses it for distributed strategies).
    def tune() -> Any:
        t = L.Trainer(strategy=name, max_epochs=1, **kwargs({"enable_checkpointing": False}))
        return Tuner(t).scale_batch_size(Model(), max_trials=2)
    report["batch_size_finder"] = outcome(tune)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    return name


if __name__ == "__main__":
    from _baseline_exit import end_baseline  # (tests/scripts/: on the path of a script run)

    if not main().startswith("ddp_sync"):
        end_baseline()
