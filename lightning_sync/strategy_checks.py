"""The ``ddp_sync`` strategy's Lightning-level checks: callbacks the strategy adds, beside the strategy.

:class:`SamplerCheck` (while the guard is on) warns about a training sampler that is not
distributed; :class:`UnevenBatchCheck` compares per-rank batch counts. Whether ranks synchronise the
same logged metrics is the guard's job at the reduction itself (the metric's name is part of each
``sync_dist`` collective's fingerprint); keys logged without ``sync_dist`` may differ per rank, as
Lightning allows. The user-facing consistency callbacks (``ParameterConsistencyCheck``) live in
:mod:`lightning_sync.callbacks.consistency`.
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

__all__ = ["SamplerCheck", "UnevenBatchCheck"]


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


class SamplerCheck(pl.Callback):
    """At train start, warns with the fix when a training loader's sampler is not distributed (every rank
    would see the whole data set). Added by ``strategy="ddp_sync"`` while its guard is on."""

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


class UnevenBatchCheck(pl.Callback):
    """At every training epoch start, compares the ranks' batch counts (one small gather).

    Uneven counts raise :class:`~lightning_sync.RankMismatchError` with every rank's count, or, with
    ``uneven_batches="stop_together"``, every rank's epoch ends when the shortest runs out. Added by
    ``strategy="ddp_sync"`` whatever its guard setting: a rank with more batches would otherwise wait
    in DDP's gradient all-reduce until the process group's timeout.

    Args:
        uneven_batches: ``"error"``, ``"stop_together"`` or ``"join"`` (the loader then has the longest
            rank's length on every rank: the counts agree).
    """

    def __init__(self, uneven_batches: str = "error") -> None:
        self.uneven_batches = uneven_batches

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
            "give every rank's sampler the same length, pass SyncDDPStrategy(uneven_batches='join') "
            "to train on every batch of every rank (a rank that ran out joins the others' collectives with a zero "
            "contribution), or uneven_batches='stop_together' to end the epoch on every rank when the first runs out.",
            shown,
        )
