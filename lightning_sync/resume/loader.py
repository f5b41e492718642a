"""The resumable training loader: torchdata's ``StatefulDataLoader`` over the resumable sampler, with
worker RNG snapshots and a checked, re-shardable state (``make_resumable`` builds it from Lightning's)."""

from __future__ import annotations

import logging
from typing import Any, Sized

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from lightning_sync._compat import lightning_api as _compat
from lightning_sync.errors import ResumeError
from lightning_sync.resume.sampler import ResumableDistributedSampler, check_sampler_state
from lightning_sync.resume.workers import _WorkerRNGDataset

__all__ = ["SNAPSHOT_EVERY", "STATE_KEY", "make_resumable", "resumable_loader_class", "torchdata_available"]

log = logging.getLogger(__name__)

STATE_KEY = "lightning_sync"  # inside each loader state: our metadata beside torchdata's
# With workers, torchdata snapshots the main process's and every worker's state (its RNG state
# included, ~0.1 ms) every N batches and, on resume, fetches the batches since the last snapshot
# again (with the restored RNG states they come out the same). A snapshot per batch cost 1.3-1.5x
# per step with 2 workers on 2 cores (bench_resume.py); one per 16 costs nothing measurable and
# at most 15 batches to fetch again on resume.
SNAPSHOT_EVERY = 16


def torchdata_available() -> bool:
    try:
        import torchdata.stateful_dataloader  # noqa: F401
    except ImportError:
        return False
    return True


def _stateful_dataloader_class() -> type:
    from torchdata.stateful_dataloader import StatefulDataLoader

    class ResumableDataLoader(StatefulDataLoader):  # type: ignore[misc]
        """torchdata's ``StatefulDataLoader`` with worker RNG snapshots and checked, re-shardable state."""

        def state_dict(self) -> dict[str, Any]:
            inner = super().state_dict()
            return {"torchdata": inner, STATE_KEY: {
                "batch_size": self.batch_size, "num_workers": self.num_workers, "dataset_len": len(self.dataset),
                "sampler": _current_sampler_state(inner, self.batch_size, self.drop_last) or self.sampler.state_dict()}}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            meta = state.get(STATE_KEY) if isinstance(state, dict) else None
            if meta is None:
                raise ResumeError(
                    "resume: the checkpoint's training data-loader state was not written by ddp_sync's resumable "
                    "loader (or is empty). Resume it with the strategy and data it was written with.")
            if meta["batch_size"] != self.batch_size:
                raise ResumeError(
                    f"resume: training batch size {self.batch_size}, the checkpoint's was {meta['batch_size']}: "
                    "the interrupted epoch's batches would not line up. Resume with "
                    f"batch_size={meta['batch_size']}, or start a new run from the weights only.")
            sampler_state = meta["sampler"]
            assert isinstance(self.sampler, ResumableDistributedSampler)
            check_sampler_state(sampler_state, self.sampler.dataset_len, self.sampler.shuffle)
            exact = (meta.get("mode", "exact") == "exact" and meta["num_workers"] == self.num_workers
                     and sampler_state["yielded"] < sampler_state["segment_len"])
            if exact:
                super().load_state_dict(state["torchdata"])
                # torchdata restores the sampler through its iterator; the epoch is needed before that
                # (Lightning creates the iterator before it calls set_epoch)
                self.sampler.epoch = int(sampler_state["epoch"])
                return
            if meta["num_workers"] != self.num_workers and sampler_state["yielded"] < sampler_state["segment_len"]:
                log.warning("lightning_sync: resuming with num_workers=%s (checkpoint: %s): the data continues at "
                            "the right sample, but the workers' random streams restart.", self.num_workers,
                            meta["num_workers"])
            self.sampler.load_state_dict(sampler_state)
            super().load_state_dict({})

    return ResumableDataLoader


_LOADER_CLASS: type | None = None


def resumable_loader_class() -> type:
    """``ResumableDataLoader``, the ``StatefulDataLoader`` subclass ddp_sync trains with (built on first
    use: torchdata is optional)."""
    global _LOADER_CLASS
    if _LOADER_CLASS is None:
        _LOADER_CLASS = _stateful_dataloader_class()
    return _LOADER_CLASS


def _current_sampler_state(torchdata_state: dict[str, Any], batch_size: int | None,
                           drop_last: bool = False) -> dict[str, Any] | None:
    """The sampler state as of the last yielded batch, from a StatefulDataLoader state.

    With workers torchdata keeps the state of its last snapshot (every ``SNAPSHOT_EVERY`` batches)
    and the number of batches yielded since, which it fetches again on resume; the position after
    them is the snapshot's plus those batches (the last batch of an epoch may be short: capped at
    the segment's end).
    """
    snapshot = torchdata_state.get("_snapshot")
    main = snapshot.get("_main_snapshot", {}) if isinstance(snapshot, dict) else torchdata_state
    batch_iter = main.get("_sampler_iter_state") or {}
    state = batch_iter.get("sampler_state") if isinstance(batch_iter, dict) else None
    if not isinstance(state, dict):
        return None
    since = int(torchdata_state.get("_steps_since_snapshot") or 0)
    if since and batch_size:
        state = {**state, "yielded": min(int(state["segment_len"]), int(state["yielded"]) + since * batch_size)}
    complete = bool(torchdata_state.get("_iterator_finished"))
    if drop_last and batch_size:  # the epoch ends at its last full batch (Lightning stops there)
        complete = complete or int(state["yielded"]) >= int(state["segment_len"]) // batch_size * batch_size
    if complete:
        state = {**state, "yielded": int(state["segment_len"])}
    return state


def make_resumable(dataloader: object, *, warn: bool = True) -> object:
    """Return the training ``dataloader`` rebuilt as a ``ResumableDataLoader``, or unchanged.

    Converted: a map-style data set, the default batch sampler over a ``DistributedSampler`` (what
    Lightning injects). Anything else (custom samplers, batch samplers, iterable data sets) is left
    as it is; Lightning then resumes it at the epoch, not at the batch.
    """
    from lightning_sync.invariance import InvariantLoader

    if not isinstance(dataloader, DataLoader) or isinstance(dataloader, InvariantLoader) or not torchdata_available():
        return dataloader  # (world_size_invariant's loader resumes through its own plan)
    sampler = dataloader.sampler
    if (isinstance(dataloader.dataset, IterableDataset) or type(dataloader.batch_sampler) is not BatchSampler
            or type(sampler) not in (DistributedSampler, ResumableDistributedSampler)
            or not isinstance(dataloader.dataset, Sized)):
        if warn:
            log.info("lightning_sync: the training data loader (sampler %s, batch sampler %s) is not converted to "
                     "a resumable one; a mid-epoch checkpoint resumes at the epoch's start.",
                     type(sampler).__name__, type(dataloader.batch_sampler).__name__)
        return dataloader
    assert isinstance(sampler, DistributedSampler)
    dataset = dataloader.dataset
    new_sampler = ResumableDistributedSampler(dataset, num_replicas=sampler.num_replicas, rank=sampler.rank,
                                              shuffle=sampler.shuffle, seed=sampler.seed, drop_last=sampler.drop_last)
    new_sampler.epoch = sampler.epoch
    workers = dataloader.num_workers
    # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13 (not catch_warnings: see ignore_in_place)
    quiet = _compat.ignore_in_place(".*set_vital.*", Warning)
    try:
        return _build(dataloader, dataset, new_sampler, workers)
    finally:
        _compat.restore_warning(quiet)


def _build(dataloader: DataLoader, dataset: Any, sampler: ResumableDistributedSampler, workers: int) -> object:  # type: ignore[type-arg]
    return resumable_loader_class()(
        _WorkerRNGDataset(dataset) if workers else dataset,
        batch_size=dataloader.batch_size, sampler=sampler, num_workers=workers,
        collate_fn=dataloader.collate_fn, pin_memory=dataloader.pin_memory, drop_last=dataloader.drop_last,
        timeout=dataloader.timeout, worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context if workers else None,
        generator=dataloader.generator, prefetch_factor=dataloader.prefetch_factor if workers else None,
        persistent_workers=dataloader.persistent_workers, pin_memory_device=dataloader.pin_memory_device,
        snapshot_every_n_steps=SNAPSHOT_EVERY,
    )
