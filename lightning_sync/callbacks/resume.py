"""Internal callback that ``SyncDDPStrategy`` adds for mid-epoch resume (see ``lightning_sync.resume``)."""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_sync.resume.checkpoint import EpochLengthSync


class ResumeEpochLength(L.Callback):
    """Re-counts the training batches of each epoch after a resume on another world size."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        EpochLengthSync.on_train_epoch_start(trainer)
