"""``WorldSizeInvariantPart``: N ranks train the one-process model (``world_size_invariant=True``).

The training loader is rebuilt over :class:`~lightning_sync.invariance.GlobalBatchSampler` (its ``batch_size``
read as the global batch) with per-sample keyed randomness; dropout layers key their masks by the global batch's rows;
a step whose ranks hold different row counts is weighted by ``lightning_sync.parts.uneven`` (the loader
queues each step's share where that part reads it). The position inside an epoch is Lightning's own batch
count, kept with the plan in ``checkpoint["lightning_sync"]["world_size_invariant"]``: a resume on any
number of ranks continues at the same global batch. See ``lightning_sync.invariance``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from lightning_sync._compat import lightning_api as _compat
from lightning_sync.batchnorm import per_rank_batchnorm
from lightning_sync.errors import ResumeError
from lightning_sync.invariance import (GENERATORS, GlobalBatchSampler, InvariantLoader, KeyedSampleDataset,
                                       make_dropout_invariant, set_dropout_step)
from lightning_sync.parts.base import Part
from lightning_sync.seeding import CHECKPOINT_KEY

__all__ = ["STATE_KEY", "WorldSizeInvariantPart"]

#: The key of the plan and position in ``checkpoint["lightning_sync"]``.
STATE_KEY = "world_size_invariant"


class WorldSizeInvariantPart(Part):
    """``world_size_invariant=True`` (see the module doc)."""

    def __init__(self) -> None:
        self.loader: InvariantLoader | None = None
        self.pending: dict[str, Any] | None = None  # a checkpoint's plan and position, until the loader exists
        self._quiet: Any = None

    def setup(self, strategy: Any, trainer: Any) -> None:
        module = strategy.lightning_module
        _converted, left = make_dropout_invariant(module)
        per_rank = per_rank_batchnorm(module)
        if per_rank and strategy.world_size > 1 and strategy.global_rank == 0:
            warnings.warn(
                f"world_size_invariant=True: BatchNorm layers {', '.join(per_rank[:5])}"
                f"{', ...' if len(per_rank) > 5 else ''} normalise by each rank's slice of the batch, so training "
                "depends on the number of ranks. Pass Trainer(sync_batchnorm=True) (or "
                "lightning_sync.convert_sync_batchnorm(model)) for statistics over the global batch.", stacklevel=2)
        if left and strategy.global_rank == 0:
            warnings.warn(
                f"world_size_invariant=True: the dropout of {', '.join(left[:5])}{', ...' if len(left) > 5 else ''} "
                "is drawn per rank (only nn.Dropout and nn.Dropout1d/2d/3d layers key their masks by the global "
                "batch's rows): training with it depends on the number of ranks.", stacklevel=2)

    def callbacks(self, strategy: Any) -> tuple[pl.Callback, ...]:
        return (_InvariantSteps(self, strategy),)

    def process_dataloader(self, strategy: Any, dataloader: Any, trainer: Any) -> Any:
        if trainer is None or not trainer.training:
            return dataloader
        shards = strategy.distributed_sampler_kwargs
        replicas = int(shards.get("num_replicas", strategy.world_size))
        rank = int(shards.get("rank", strategy.global_rank))
        loader = invariant_loader(dataloader, replicas, rank, strategy.seed or 0, strategy.seed_lineage)
        pending, self.pending = self.pending, None
        if pending is not None:
            _check_plan(pending, loader.plan)
            loader.plan.resume_at(int(pending["epoch"]), int(pending["batches"]))
        else:
            loader.plan.set_epoch(trainer.current_epoch)
        if self.loader is None:
            keyed = cast(KeyedSampleDataset, loader.dataset)
            rank_zero_info(describe_plan(loader.plan, keyed.generators, keyed.declared_by))
        self.loader = loader
        return loader

    def on_save_checkpoint(self, strategy: Any, checkpoint: dict[str, Any], directory: Path | None) -> None:
        trainer = _compat.attached_trainer(strategy.lightning_module)
        if self.loader is None or trainer is None:
            return
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # global batches trained this epoch
        entry = checkpoint.setdefault(CHECKPOINT_KEY, {})
        entry[STATE_KEY] = {**self.loader.plan.state(), "epoch": trainer.current_epoch, "batches": int(done)}

    def on_load_checkpoint(self, strategy: Any, checkpoint: dict[str, Any], fitting: bool,
                           directory: Path | None) -> None:
        if not fitting:
            return
        state = (checkpoint.get(CHECKPOINT_KEY) or {}).get(STATE_KEY)
        self.pending = state if isinstance(state, dict) else None
        if self.pending is not None and self._quiet is None:
            self._quiet = _compat.silence_not_resumable_warning()  # the position is ours, not the loader's

    def after_teardown(self, strategy: Any) -> None:
        set_dropout_step(None)
        if self._quiet is not None:
            _compat.restore_warning(self._quiet)
            self._quiet = None


def invariant_loader(dataloader: Any, world_size: int, rank: int, seed: int, root: Any) -> InvariantLoader:
    """``dataloader`` (the one-process training loader, or Lightning's distributed version of it) rebuilt as this
    rank's :class:`~lightning_sync.invariance.InvariantLoader`. ``root``: the seed (or an object with a ``root``)
    that keys per-sample randomness.

    Raises:
        ValueError: a loader whose one-process order cannot be known (an ``IterableDataset``, a sampler or batch
            sampler of the user's own).
    """
    if isinstance(dataloader, InvariantLoader):
        return dataloader
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        raise ValueError(
            f"world_size_invariant=True needs a map-style training set (len(dataset) and dataset[i]) in a torch "
            f"DataLoader; this fit's training loader is {type(dataloader).__name__} over "
            f"{type(getattr(dataloader, 'dataset', None)).__name__}: its order is its own, so N ranks cannot take "
            "the one-process run's batches. Use a map-style Dataset, or world_size_invariant=False.")
    shuffle = _shuffle_of(dataloader)
    batch_size = dataloader.batch_size
    if batch_size is None:
        raise ValueError(
            f"world_size_invariant=True: the training loader has a batch sampler of its own "
            f"({type(dataloader.batch_sampler).__name__}), which decides the batches per rank. Give the DataLoader "
            "batch_size= (the global batch) and shuffle= instead, or use world_size_invariant=False.")
    plan = GlobalBatchSampler(len(dataloader.dataset), batch_size, world_size, rank, shuffle, seed,  # type: ignore[arg-type]
                              dataloader.drop_last)
    workers = dataloader.num_workers
    return InvariantLoader(
        KeyedSampleDataset(dataloader.dataset, root), batch_sampler=plan, num_workers=workers,
        collate_fn=dataloader.collate_fn, pin_memory=dataloader.pin_memory, timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context if workers else None,
        generator=dataloader.generator, prefetch_factor=dataloader.prefetch_factor if workers else None,
        persistent_workers=dataloader.persistent_workers, pin_memory_device=dataloader.pin_memory_device)


def describe_plan(plan: GlobalBatchSampler, generators: tuple[str, ...] = GENERATORS,
                  declared_by: str | None = None) -> str:
    """One line for the log: the global batch and how the ranks split it (the mistake it shows: a loader whose
    ``batch_size`` was divided by the number of ranks, as under ``ddp``, trains a smaller global batch), and the
    global generators seeded for each sample."""
    n, g, world, last = plan.num_samples, plan.batch_size, plan.world_size, plan.num_samples % plan.batch_size
    whose = " and ".join(f"{name}'s" for name in generators)
    said = f"as {declared_by or 'the data set'} says"
    keyed = ("torch's, numpy's and random's generators" + (f", {said}" if declared_by else "")
             if generators == GENERATORS else
             f"only {whose} generator{'s' if len(generators) > 1 else ''}, {said}" if generators else
             f"no generator, {said}")
    epoch = f"{len(plan)} steps an epoch" + (f", the last of {last} rows" if last and not plan.drop_last else "")
    return (f"lightning_sync: world_size_invariant=True: global batch {g} (the training DataLoader's batch_size, "
            f"as one process would train it) split over {world} rank{'s' if world > 1 else ''} "
            f"({' + '.join(map(str, plan.sizes(0)))} rows); {n} samples, {epoch}, shuffle={plan.shuffle}; random "
            f"numbers drawn while loading a sample are keyed by the sample ({keyed}).")


def _shuffle_of(dataloader: DataLoader) -> bool:  # type: ignore[type-arg]
    sampler = getattr(dataloader.batch_sampler, "sampler", None) or dataloader.sampler
    if type(sampler) is DistributedSampler:
        return bool(sampler.shuffle)
    if type(sampler) is SequentialSampler:
        return False
    if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == len(sampler.data_source):
        return True
    what = ("a sampler of your own (Lightning wrapped it in DistributedSamplerWrapper)"
            if type(sampler).__name__ == "DistributedSamplerWrapper" else
            f"{type(sampler).__name__}, a sampler of your own (or one drawing with replacement)")
    raise ValueError(
        f"world_size_invariant=True: the training loader's sampler is {what}: its order decides which samples form a batch, and N ranks cannot "
        "reproduce it. Use shuffle=True or shuffle=False on the DataLoader (the order then is torch's randperm of "
        "the root seed + epoch, the same on any number of ranks), or world_size_invariant=False.")


def _check_plan(saved: dict[str, Any], plan: GlobalBatchSampler) -> None:
    now = plan.state()
    differ = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    if differ:
        shown = "; ".join(f"{k}: checkpoint {old!r}, this run {new!r}" for k, (old, new) in differ.items())
        raise ResumeError(
            f"resume (world_size_invariant=True): the checkpoint's training plan differs from this run's ({shown}): "
            "its position would point at other samples. Resume with the same data set, batch_size (the global "
            "batch), shuffle and drop_last, or start a new run from the weights only "
            "(LightningModule.load_from_checkpoint).")


class _InvariantSteps(pl.Callback):
    """Keys each training step's dropout masks: the global batch, this rank's rows of it."""

    def __init__(self, part: WorldSizeInvariantPart, strategy: Any) -> None:
        self.part, self.strategy = part, strategy

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        loader = self.part.loader
        if loader is None:
            return
        set_dropout_step(loader.plan.dropout_step(batch_idx, self.strategy.seed or 0))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        set_dropout_step(None)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        set_dropout_step(None)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        set_dropout_step(None)
