"""Progress output that reads well in a terminal and in a log file.

``progress_bar()`` (conf/callbacks/default.yaml) returns Lightning's ``TQDMProgressBar`` when stdout is
a terminal, else a :class:`LineProgressBar`: a carriage-return bar redirected to a file becomes one
endless line, so a log gets plain lines instead, one every ``every_n_steps`` training steps and one
per epoch with the epoch's metrics. Like every progress bar, it prints on global rank 0 only.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar

__all__ = ["LineProgressBar", "progress_bar"]


def progress_bar(refresh_rate: int = 10, every_n_steps: int = 50) -> ProgressBar:
    """TQDM on a terminal (refreshed every ``refresh_rate`` steps), else :class:`LineProgressBar`."""
    isatty = getattr(sys.stdout, "isatty", None)
    if isatty is not None and isatty():
        return TQDMProgressBar(refresh_rate=refresh_rate)
    return LineProgressBar(every_n_steps=every_n_steps)


class LineProgressBar(ProgressBar):
    """Plain lines on stdout: every ``every_n_steps`` training steps (0: never) and at each epoch end.

    Args:
        every_n_steps: training steps between two lines within an epoch.
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        super().__init__()
        if not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(f"LineProgressBar(every_n_steps={every_n_steps!r}): must be an int >= 0.")
        self.every_n_steps = every_n_steps
        self._enabled = True
        self._epoch_started = 0.0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def _metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        shown = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_started = time.monotonic()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        done = batch_idx + 1
        if not self._enabled or not self.every_n_steps or done % self.every_n_steps:
            return
        total = self.total_train_batches
        of = f"/{total}" if isinstance(total, int) else ""
        print(f"epoch {trainer.current_epoch} step {done}{of} | {self._metrics(trainer, pl_module)}", flush=True)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._enabled:
            return
        seconds = time.monotonic() - self._epoch_started
        print(f"epoch {trainer.current_epoch} done in {seconds:.1f} s | global step {trainer.global_step} | "
              f"{self._metrics(trainer, pl_module)}", flush=True)
