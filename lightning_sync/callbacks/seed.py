"""``SeedBroadcast``: the seed guarantees of ``ddp_sync`` for users who keep Lightning's ``"ddp"``."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_sync.collectives import MAX_SEED
from lightning_sync.seeding import CHECKPOINT_KEY, SeedLineage

__all__ = ["SeedBroadcast"]


class SeedBroadcast(pl.Callback):
    """Agree on rank 0's seed, then give every rank its own RNG stream.

    In ``setup`` (after the process group exists, before the model is configured and wrapped) every
    rank adopts rank 0's root seed, so samplers shard disjointly and layers built in
    ``setup``/``configure_model`` start identical. At ``on_train_start`` each rank switches to its
    own derived stream (dropout, augmentation differ). Data-loader workers are seeded through
    Lightning's ``PL_SEED_WORKERS`` mechanism. RNG states of every rank are stored in checkpoints.

    With ``strategy="ddp_sync"`` this callback is redundant: the strategy does all of it.

    Args:
        seed: the root seed (rank 0's wins); ``None``: rank 0's ``seed_everything`` seed, else OS entropy.
    """

    def __init__(self, seed: int | None = None) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
            raise ValueError(f"SeedBroadcast(seed={seed!r}): the seed must be an int in [0, {MAX_SEED}] or None.")
        self.seed = seed
        self.lineage: SeedLineage | None = None
        self._pending: dict[str, Any] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_sync.strategy import SyncDDPStrategy

        if isinstance(trainer.strategy, SyncDDPStrategy):
            rank_zero_warn("SeedBroadcast is redundant with strategy='ddp_sync', which already broadcasts the seed.")
            self.lineage = trainer.strategy.seed_lineage
            return
        self.lineage = SeedLineage.agree(self.seed)
        os.environ.setdefault("PL_SEED_WORKERS", "1")
        rank_zero_info(self.lineage.describe())

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_sync.strategy import SyncDDPStrategy

        if self.lineage is not None and not isinstance(trainer.strategy, SyncDDPStrategy):
            self.lineage.load_checkpoint_state(self._pending, trainer.global_rank)
            self._pending = None
            self.lineage.seed_rank_streams(trainer.global_rank)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        from lightning_sync.strategy import SyncDDPStrategy

        if self.lineage is not None and not isinstance(trainer.strategy, SyncDDPStrategy):
            state = self.lineage.checkpoint_state()  # every rank calls on_save_checkpoint
            if state is not None:
                checkpoint[CHECKPOINT_KEY] = state

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._pending = checkpoint.get(CHECKPOINT_KEY)
