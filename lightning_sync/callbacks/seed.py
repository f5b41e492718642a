"""``SeedBroadcast``: the seed guarantees of ``ddp_sync`` for users who keep Lightning's ``"ddp"``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_sync.collectives import validate_seed
from lightning_sync.seeding import CHECKPOINT_KEY, SeedLineage, WorkerSeeder

__all__ = ["SeedBroadcast"]


def _dataloaders(iterables: object) -> Iterator[Any]:
    """The loaders in what ``trainer.train_dataloader`` / ``val_dataloaders`` return (one, a list or a dict)."""
    if isinstance(iterables, dict):
        iterables = list(iterables.values())
    if isinstance(iterables, (list, tuple)):
        for item in iterables:
            yield from _dataloaders(item)
    elif iterables is not None:
        yield iterables


class SeedBroadcast(pl.Callback):
    """Agree on rank 0's seed, then give every rank its own RNG stream.

    In ``setup`` (after the process group exists, before the model is configured and wrapped) every
    rank adopts rank 0's root seed, so samplers shard disjointly and layers built in
    ``setup``/``configure_model`` start identical. At ``on_fit_start`` each rank switches to its
    own derived stream (dropout, augmentation differ). Data-loader workers get the same worker
    seeder as with ``ddp_sync`` (:class:`~lightning_sync.seeding.WorkerSeeder`) on every loader
    without a ``worker_init_fn`` of its own, from the start of its stage (training loaders from the
    first epoch; an evaluation loader from its stage's start hook). RNG states of every rank are
    stored in checkpoints.

    Lightning's ``"ddp"`` shuffles its ``DistributedSampler`` with ``PL_GLOBAL_SEED``, so this
    callback sets that variable to the root seed for the run and restores it in ``teardown``.
    With ``strategy="ddp_sync"`` this callback is redundant: the strategy does all of it.

    Args:
        seed: the root seed (rank 0's wins); ``None``: rank 0's ``seed_everything`` seed, else OS entropy.
    """

    def __init__(self, seed: int | None = None) -> None:
        validate_seed(seed, "SeedBroadcast(seed=...)")
        self.seed = seed
        self.lineage: SeedLineage | None = None
        self._pending: dict[str, Any] | None = None
        self._active = False  # True while this callback (not ddp_sync) owns the run's seeding
        self._saved_env: str | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy_lineage = getattr(trainer.strategy, "seed_lineage", None)
        if strategy_lineage is not None:
            rank_zero_warn("SeedBroadcast is redundant with strategy='ddp_sync', which already broadcasts the seed.")
            self.lineage = strategy_lineage
            return
        self.lineage = SeedLineage.agree(self.seed)
        if not self._active:
            self._saved_env = os.environ.get("PL_GLOBAL_SEED")
            self._active = True
        self._publish_root()
        rank_zero_info(self.lineage.describe())

    def _publish_root(self) -> None:
        # Lightning's DDPStrategy gives its DistributedSampler no seed; the data connector then reads
        # PL_GLOBAL_SEED. Restored in teardown.
        assert self.lineage is not None
        os.environ["PL_GLOBAL_SEED"] = str(self.lineage.root)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self._active:
            return
        self._active = False
        if self._saved_env is None:
            os.environ.pop("PL_GLOBAL_SEED", None)
        else:
            os.environ["PL_GLOBAL_SEED"] = self._saved_env

    def _seed_workers(self, trainer: pl.Trainer, *iterables: object) -> None:
        if not self._active or self.lineage is None:
            return
        for loader in _dataloaders(list(iterables)):
            if getattr(loader, "worker_init_fn", "absent") is None:
                loader.worker_init_fn = WorkerSeeder(self.lineage, trainer.global_rank)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the model is set up and wrapped and the checkpoint's callback states are loaded,
        # before the training data (and its sampler) is set up: the same moment as ddp_sync.
        if self._active and self.lineage is not None:
            self.lineage.load_checkpoint_state(self._pending, trainer.global_rank)
            self._pending = None
            self._publish_root()
            self.lineage.seed_rank_streams(trainer.global_rank)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seed_workers(trainer, trainer.train_dataloader, trainer.val_dataloaders)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seed_workers(trainer, trainer.val_dataloaders)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seed_workers(trainer, trainer.test_dataloaders)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seed_workers(trainer, trainer.predict_dataloaders)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self._active and self.lineage is not None:
            state = self.lineage.checkpoint_state()  # every rank calls on_save_checkpoint
            if state is not None:
                checkpoint[CHECKPOINT_KEY] = state

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._pending = checkpoint.get(CHECKPOINT_KEY)
