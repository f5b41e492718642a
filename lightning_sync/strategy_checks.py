"""The ``ddp_sync`` guard's Lightning-level checks: a callback the strategy adds, beside the strategy.

:class:`GuardChecks` (added by ``strategy="ddp_sync"`` while its guard is on) checks the training
sampler, per-rank batch counts and the set of logged keys. The user-facing consistency callbacks
(``ParameterConsistencyCheck``) live in :mod:`lightning_sync.callbacks.consistency`.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DistributedSampler

from lightning_sync import collectives
from lightning_sync._compat import lightning_api as _compat
from lightning_sync.errors import RankMismatchError, format_ranks

__all__ = ["GuardChecks"]


def _loaders(trainer: pl.Trainer) -> list[Any]:
    """The processed training loaders (``trainer.train_dataloader``: one, a list or a dict of them)."""
    found: list[Any] = []
    pending: list[Any] = [trainer.train_dataloader]
    while pending:
        item = pending.pop(0)
        if isinstance(item, dict):
            pending[:0] = list(item.values())
        elif isinstance(item, (list, tuple)):
            pending[:0] = list(item)
        elif item is not None:
            found.append(item)
    return found


class GuardChecks(pl.Callback):
    """The ``ddp_sync`` guard's Lightning-level checks (added by the strategy; no need to add it).

    * train start: a training loader whose sampler is not distributed (every rank would see the
      whole data set) gets a warning with the fix;
    * every training epoch start: per-rank batch counts are gathered; uneven counts raise (or,
      with ``uneven_batches="stop_together"``, every rank stops when the shortest runs out);
    * every epoch end: the sets of logged keys are compared; differing keys raise.

    Args:
        uneven_batches: ``"error"`` or ``"stop_together"``.
    """

    def __init__(self, uneven_batches: str = "error") -> None:
        self.uneven_batches = uneven_batches

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.world_size < 2:
            return
        for i, loader in enumerate(_loaders(trainer)):
            sampler = getattr(loader, "sampler", None)
            batch_sampler = getattr(loader, "batch_sampler", None)
            inner = getattr(batch_sampler, "sampler", None)
            if sampler is None or isinstance(sampler, DistributedSampler) or isinstance(inner, DistributedSampler):
                continue
            if type(sampler).__name__ in ("RandomSampler", "SequentialSampler") and (
                    inner is None or type(inner).__name__ in ("RandomSampler", "SequentialSampler")):
                rank_zero_warn(
                    f"Training dataloader {i} uses a {type(sampler).__name__}, not a DistributedSampler, so every rank "
                    f"iterates over the whole data set ({len(loader.dataset) if hasattr(loader.dataset, '__len__') else '?'} "
                    f"samples each on {trainer.world_size} ranks): an epoch is {trainer.world_size} x longer than "
                    "necessary and each sample is used once per rank. Let Lightning insert a DistributedSampler "
                    "(Trainer(use_distributed_sampler=True), the default) or pass "
                    "DistributedSampler(dataset, shuffle=True) yourself. Ignore this if each rank's dataset is its "
                    "own shard."
                )

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.world_size < 2:
            return
        mine = trainer.num_training_batches
        counts = collectives.gather_objects(mine, safe=True)
        assert counts is not None
        if len(set(counts)) == 1:
            return
        shown = {r: c for r, c in enumerate(counts)}
        if self.uneven_batches == "stop_together" and all(math.isfinite(c) for c in counts):
            interval = trainer.val_check_interval
            val_check_batch = None
            if isinstance(interval, float) and trainer.val_check_batch not in (None, float("inf")):
                # Validation runs on "the last batch" (or a fraction of the epoch): a cut-short rank must
                # validate exactly when the naturally shortest one does, or DDP's buffer broadcast in the
                # validation forward of one rank waits for the other.
                val_check_batch = max(1, int(min(counts) * interval))
            _compat.stop_epoch_after(trainer, int(min(counts)), val_check_batch)
            rank_zero_info(f"ddp_sync: ranks have different numbers of training batches ({format_ranks(shown)}); "
                           f"every rank stops after {int(min(counts))} this epoch (uneven_batches='stop_together').")
            return
        raise RankMismatchError(
            f"ranks have different numbers of training batches this epoch: {format_ranks(shown)}. A rank with more "
            "batches would wait forever in DDP's gradient all-reduce once the others have finished. Shard with a "
            "DistributedSampler (it pads to equal counts; Lightning inserts one unless use_distributed_sampler=False), "
            "give every rank the same number of samples (drop_last=True), or pass "
            "SyncDDPStrategy(uneven_batches='stop_together') to end the epoch on every rank when the first runs out.",
            shown,
        )

    def _compare_keys(self, trainer: pl.Trainer, stage: str) -> None:
        if trainer.world_size < 2 or trainer.sanity_checking:
            return
        keys = _compat.logged_keys(trainer)
        gathered = collectives.gather_objects(keys, safe=True)
        assert gathered is not None
        if all(k == gathered[0] for k in gathered):
            return
        union = set().union(*map(set, gathered))
        missing = {r: sorted(k.split(".", 1)[-1] for k in union - set(g)) or "-" for r, g in enumerate(gathered)}
        extra = {r: sorted(k.split(".", 1)[-1] for k in set(g) - set.intersection(*map(set, gathered))) or "-"
                 for r, g in enumerate(gathered)}
        raise RankMismatchError(
            f"ranks logged different keys during this {stage} epoch: only on that rank: {format_ranks(extra)}; missing "
            f"on that rank: {format_ranks(missing)}. Per-rank keys give per-rank metrics that no logger can combine, "
            "and with sync_dist=True they pair up different metrics across ranks (or hang). Log the same keys on every "
            "rank (put the rank in the value, not the name) or log rank-specific values with rank_zero_only=True.",
            extra,
        )

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._compare_keys(trainer, "training")

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._compare_keys(trainer, "validation")
