"""Internal callback that ``SyncDDPStrategy`` adds for mid-epoch resume (see ``lightning_sync.resume``)."""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_sync.resume import EpochLengthSync


class ResumeEpochLength(L.Callback):
    """Re-counts the training batches of each epoch after a resume on another world size, and writes
    SLURM's requeue checkpoint at the end of the step every rank agreed on (``lightning_sync.preemption``)."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        EpochLengthSync.on_train_epoch_start(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        requeue = getattr(trainer.strategy, "_requeue", None)
        if requeue is not None:
            requeue.on_train_batch_end()
