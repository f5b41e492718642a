"""``DigitsCNN``: the main job's model, a small CNN with BatchNorm for 1x8x8 images.

Validation metrics are not computed here: ``validation_step`` returns per-sample rows and
``ls.ValidationGather`` (conf/callbacks) computes them once on the exact validation set.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import nn

__all__ = ["DigitsCNN", "gathered_mean"]


def gathered_mean(outputs: dict[str, Any], key: str = "loss") -> torch.Tensor:
    """The mean of one per-sample key of ``ValidationGather``'s outputs (a ``metrics`` entry)."""
    rows: torch.Tensor = outputs[key]
    return rows.float().mean()


class DigitsCNN(L.LightningModule):
    """conv-BN-ReLU x2, max-pool, conv-BN-ReLU, global average pool, linear; Nesterov SGD with a
    one-cycle schedule over the whole run. A run without a known length (``max_epochs=-1`` with
    ``max_time``, or until stopped) warms up linearly over its first epoch, then keeps ``lr``.

    Args:
        channels: width of the first convolution (the others use twice that).
        num_classes: output classes.
        lr: peak learning rate.
        momentum: SGD momentum.
        weight_decay: SGD weight decay.
        dropout: dropout before the classifier (draws differ across ranks under ``ddp_sync``).
    """

    def __init__(self, channels: int = 32, num_classes: int = 10, lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 5e-4, dropout: float = 0.1) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"DigitsCNN(lr={lr}): the learning rate must be > 0.")
        self.save_hyperparameters()
        c = channels

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

        self.net = nn.Sequential(*block(1, c), *block(c, 2 * c), nn.MaxPool2d(2), *block(2 * c, 2 * c),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout),
                                 nn.Linear(2 * c, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                        batch_idx: int) -> dict[str, torch.Tensor]:
        index, x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y, reduction="none")
        return {"index": index, "preds": logits.argmax(-1), "target": y, "loss": loss}

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        opt = torch.optim.SGD(self.parameters(), lr=hp["lr"], momentum=hp["momentum"],
                              weight_decay=hp["weight_decay"], nesterov=True)
        steps = self.trainer.estimated_stepping_batches  # inf when the run ends on time or on Ctrl-C
        sched: torch.optim.lr_scheduler.LRScheduler
        if math.isfinite(steps):
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=hp["lr"], total_steps=max(1, int(steps)))
        else:
            warmup = max(1, int(self.trainer.num_training_batches)
                         if math.isfinite(self.trainer.num_training_batches) else 100)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
