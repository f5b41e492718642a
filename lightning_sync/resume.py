"""Exact mid-epoch resume of the training data path under ``ddp_sync``.

What a checkpoint must hold so that ``trainer.fit(ckpt_path=...)`` continues with exactly the
batches, and exactly the random numbers, of the uninterrupted run:

* the **sampler position**: which epoch, and how far into it. :class:`ResumableDistributedSampler`
  describes the epoch as one global order (the permutation of ``seed + epoch``, as torch's
  ``DistributedSampler``) and a cursor into it, so the same state also re-shards the rest of the
  epoch over another number of ranks;
* the **data-loader iterator**, worker processes included: torchdata's ``StatefulDataLoader`` (which
  Lightning saves and restores by itself) keeps the base seed of the workers, which worker yields
  next and a snapshot every ``SNAPSHOT_EVERY`` batches. ``ResumableDataLoader`` adds the **RNG
  state of every worker** to those snapshots (a worker's random augmentation continues where it
  stopped);
* **every rank's** loader state: Lightning writes rank 0's only, so ``SyncDDPStrategy.save_checkpoint``
  gathers all of them into ``checkpoint["lightning_sync"]["loader_states"]`` and
  :func:`select_loader_state` hands each rank its own on load;
* each rank's global RNG states (``lightning_sync.seeding``), restored after the resumed iterator
  was created (creating one draws a seed from the global generator).

torchdata is a requirement of the package; an environment without it (installed with ``--no-deps``)
trains as before, and a mid-epoch checkpoint resumes at the right epoch but not at the right batch.
"""

from __future__ import annotations

import logging
import math
import operator
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence, Sized

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, IterableDataset

from lightning_sync.errors import ResumeError
from lightning_sync.sampling import EpochOrder
from lightning_sync.seeding import CHECKPOINT_KEY, _collect_rng_state, _restore_rng_state

__all__ = [
    "ResumableDistributedSampler",
    "resumable_loader_class",
    "make_resumable",
    "torchdata_available",
    "find_resume_checkpoint",
]

log = logging.getLogger(__name__)

STATE_KEY = "lightning_sync"  # inside each loader state: our metadata beside torchdata's
# With workers, torchdata snapshots the main process's and every worker's state (its RNG state
# included, ~0.1 ms) every N batches and, on resume, fetches the batches since the last snapshot
# again (with the restored RNG states they come out the same). A snapshot per batch cost 1.3-1.5x
# per step with 2 workers on 2 cores (bench_resume.py); one per 16 costs nothing measurable and
# at most 15 batches to fetch again on resume.
SNAPSHOT_EVERY = 16
SAMPLER_NAME = "ResumableDistributedSampler"


def torchdata_available() -> bool:
    try:
        import torchdata.stateful_dataloader  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------------------- sampler


class ResumableDistributedSampler(DistributedSampler):  # type: ignore[type-arg]
    """torch's ``DistributedSampler`` (same order, same shards) that can stop and resume mid-epoch.

    The epoch is one global order: ``randperm(len(dataset))`` seeded with ``seed + epoch`` (or
    ``range`` without shuffling). A *segment* of it, starting at global position ``start``, is padded
    (or cut, with ``drop_last``) to a multiple of the world size and dealt out: rank ``r`` takes
    positions ``start + r, start + r + W, ...``. After every rank took ``k`` samples, positions
    ``start .. start + k*W - 1`` are consumed. On the same world size a resumed sampler continues
    the same segment (bit-identical); on another one the rest of the epoch becomes a new segment
    starting at the first unconsumed position, so every remaining sample is seen once, plus at most
    ``W - 1`` repeats to give every rank the same number of steps.
    """

    def __init__(self, dataset: Dataset[Any], num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.dataset_len = len(dataset)  # type: ignore[arg-type]
        self.start = 0  # global position where the current segment of this epoch begins
        self._skip: int | None = None  # set by load_state_dict: samples to skip at the next __iter__
        # The running epoch's iterator is a plain list iterator (no Python frame per index): how far it
        # got is its length minus what is left in it.
        self._iterator: Iterator[int] | None = None
        self._iterator_start = self._iterator_len = 0
        self.yielded = 0

    @property
    def yielded(self) -> int:
        """Samples of the current segment this rank has handed out."""
        if self._iterator is None:
            return self._iterator_start
        return self._iterator_start + self._iterator_len - operator.length_hint(self._iterator)

    @yielded.setter
    def yielded(self, value: int) -> None:
        self._iterator, self._iterator_start, self._iterator_len = None, value, 0

    def _segment_len(self) -> int:
        remaining = max(0, self.dataset_len - self.start)
        if self.drop_last:
            return remaining // self.num_replicas
        return math.ceil(remaining / self.num_replicas)

    def __len__(self) -> int:
        return self._segment_len()

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:  # a new epoch starts from its beginning; the same one keeps its position
            self.start, self.yielded, self._skip = 0, 0, None
        self.epoch = epoch

    def epoch_order(self) -> EpochOrder:
        """The epoch's global order (:class:`~lightning_sync.sampling.EpochOrder`, as the evaluation sampler's)."""
        return EpochOrder.of(self.dataset_len, self.shuffle, self.seed + self.epoch)

    def _pieces(self, skip: int) -> Iterator[Sequence[int]]:
        # Sample k of this rank is position j = rank + k * W of the segment; the segment is the
        # epoch's order from `start`, padded with its own first positions (cyclically) up to W * per_rank.
        order = self.epoch_order()
        if not isinstance(order, EpochOrder):  # a subclass's own epoch_order() returning a list
            order = EpochOrder(len(order), list(order))
        rest = self.dataset_len - self.start
        per_rank, world = self._segment_len(), self.num_replicas
        unpadded = min(per_rank, max(0, math.ceil((rest - self.rank) / world)))  # samples with j < rest
        if skip < unpadded:
            first = self.start + self.rank + skip * world
            yield from order.pieces(first, self.start + self.rank + (unpadded - 1) * world + 1, world)
        padded = [self.start + (self.rank + k * world) % rest for k in range(max(skip, unpadded), per_rank)]
        if padded:
            yield order.at(padded)

    def shard(self) -> list[int]:
        """This rank's indices of the current segment (the whole epoch unless resumed elsewhere)."""
        return [i for piece in self._pieces(0) for i in piece]

    def __iter__(self) -> Iterator[int]:
        # A generator, so the position moves only once iteration starts: torchdata and Lightning
        # create iterators they do not use (e.g. after load_state_dict), and those must not take
        # the pending skip. The order is read in pieces (a range, or lists of 65536 indices), never
        # as one list; how far the running piece got is its length minus what is left in it.
        skip = self._skip or 0
        self._skip = None
        self.yielded = skip
        for piece in self._pieces(skip):
            iterator = iter(piece)
            self._iterator, self._iterator_len = iterator, len(piece)
            yield from iterator  # delegated per index without a Python-level loop body
            self._iterator, self._iterator_start, self._iterator_len = None, self._iterator_start + len(piece), 0

    @property
    def consumed(self) -> int:
        """Global positions of this epoch's order consumed by all ranks together."""
        return min(self.dataset_len, self.start + self.yielded * self.num_replicas)

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": SAMPLER_NAME, "epoch": self.epoch, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "dataset_len": self.dataset_len, "world_size": self.num_replicas,
                "start": self.start, "yielded": self.yielded, "segment_len": self._segment_len()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_sampler_state(state, self.dataset_len, self.shuffle)
        self.seed = int(state["seed"])
        self.drop_last = bool(state["drop_last"])
        self.epoch = int(state["epoch"])
        if state["yielded"] >= state["segment_len"]:  # the epoch was complete: the next one starts fresh
            self.epoch += 1
            self.start, self._skip = 0, 0
        elif state["world_size"] == self.num_replicas:  # same shards: continue the same segment
            self.start, self._skip = int(state["start"]), int(state["yielded"])
        else:  # re-shard what is left of the epoch over this world size
            self.start = min(self.dataset_len, int(state["start"]) + int(state["yielded"]) * int(state["world_size"]))
            self._skip = 0
        self.yielded = self._skip


def check_sampler_state(state: dict[str, Any], dataset_len: int, shuffle: bool) -> None:
    if state.get("sampler") != SAMPLER_NAME:
        raise ResumeError(f"resume: the checkpoint's training sampler state is from {state.get('sampler')!r}, this "
                          f"run uses {SAMPLER_NAME}. Resume with the sampler the checkpoint was written with.")
    if state["dataset_len"] != dataset_len:
        raise ResumeError(
            f"resume: the training data set has {dataset_len} samples, the checkpoint's had {state['dataset_len']}: "
            "the position inside the interrupted epoch would point at other samples. Resume with the same data "
            "set, or start a new run (load only the weights: LightningModule.load_from_checkpoint).")
    if bool(state["shuffle"]) != shuffle:
        raise ResumeError(f"resume: training shuffle={shuffle}, the checkpoint's sampler had shuffle="
                          f"{state['shuffle']}. Resume with the same shuffle setting.")


# ------------------------------------------------------------------------- worker RNG in snapshots


class _WorkerRNGDataset(Dataset[Any]):
    """Wraps a map-style data set; in a worker process its state is the worker's RNG state.

    torchdata snapshots a data set's ``state_dict`` inside each worker at its last batch before every
    ``SNAPSHOT_EVERY``-th step and restores it after ``worker_init_fn`` on resume (then fetches the
    batches since the snapshot again), so random augmentation drawn in ``__getitem__`` or
    ``collate_fn`` continues exactly. The state is plain bytes and lists, not tensors: tensors would
    travel through shared memory with every snapshot. Attribute access falls through to the wrapped
    data set.
    """

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling): avoid recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def state_dict(self) -> dict[str, Any]:
        inner = self.dataset.state_dict() if hasattr(self.dataset, "state_dict") else None
        in_worker = torch.utils.data.get_worker_info() is not None
        return {"worker_rng": _collect_rng_state(compact=True) if in_worker else None, "inner": inner}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("inner") is not None and hasattr(self.dataset, "load_state_dict"):
            self.dataset.load_state_dict(state["inner"])
        if torch.utils.data.get_worker_info() is None:
            return
        rng = state.get("worker_rng") or state.get("rng")  # ("rng": written before the compact encoding)
        if rng is not None:
            _restore_rng_state(rng)


# ---------------------------------------------------------------------------------- data loader


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
    if not isinstance(dataloader, DataLoader) or not torchdata_available():
        return dataloader
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
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return _build(dataloader, dataset, new_sampler, workers)


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


# ------------------------------------------------------------------------------- checkpoint side


def _fit_loop_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    state = loop.get("state_dict") if isinstance(loop, dict) else None
    return state if isinstance(state, dict) else None


def local_loader_states(checkpoint: dict[str, Any]) -> list[dict[str, Any]] | None:
    """This rank's data-loader states in a checkpoint dict being saved (Lightning's fit loop put them there)."""
    state = _fit_loop_state(checkpoint)
    return state.get("combined_loader") if state is not None else None


def select_loader_state(checkpoint: dict[str, Any], states: list[Any] | None, world_size: int,
                        rank: int) -> dict[str, Any] | None:
    """Put this rank's own loader state where Lightning reads it; return its sampler state (or None).

    ``states`` is every rank's list from ``checkpoint["lightning_sync"]["loader_states"]``. On the
    same world size rank ``r`` gets rank ``r``'s (bit-identical continuation, workers included); on
    another one every rank gets rank 0's, marked to re-shard the rest of the epoch.
    """
    fit_state = _fit_loop_state(checkpoint)
    if fit_state is None or not fit_state.get("combined_loader"):
        return None
    if states and len(states) == world_size and states[rank] is not None:
        fit_state["combined_loader"] = states[rank]
    else:
        resharded = []
        for loader_state in fit_state["combined_loader"]:
            if isinstance(loader_state, dict) and STATE_KEY in loader_state:
                loader_state = {**loader_state, STATE_KEY: {**loader_state[STATE_KEY], "mode": "reshard"}}
            resharded.append(loader_state)
        fit_state["combined_loader"] = resharded
    first = fit_state["combined_loader"][0]
    if isinstance(first, dict) and STATE_KEY in first:
        sampler_state = first[STATE_KEY]["sampler"]
        return sampler_state if isinstance(sampler_state, dict) else None
    return None


def adjust_progress_for_reshard(checkpoint: dict[str, Any], sampler_state: dict[str, Any], world_size: int) -> None:
    """On another world size the interrupted epoch continues as a new, shorter segment: count its batches from 0."""
    if sampler_state["world_size"] == world_size or sampler_state["yielded"] >= sampler_state["segment_len"]:
        return
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    batch_progress = loop.get("epoch_loop.batch_progress") if isinstance(loop, dict) else None
    if isinstance(batch_progress, dict) and isinstance(batch_progress.get("current"), dict):
        # Shift, not zero: Lightning adds one to "completed" itself when the save came at a batch's end.
        current = batch_progress["current"]
        done = int(current["ready"])
        for key in ("ready", "started", "processed", "completed"):
            current[key] = int(current[key]) - done


def is_mid_epoch(sampler_state: dict[str, Any] | None) -> bool:
    return bool(sampler_state) and 0 < sampler_state["yielded"] < sampler_state["segment_len"]  # type: ignore[index]


def describe_reshard(sampler_state: dict[str, Any], world_size: int) -> str:
    old = int(sampler_state["world_size"])
    consumed = min(sampler_state["dataset_len"],
                   int(sampler_state["start"]) + int(sampler_state["yielded"]) * old)
    left = sampler_state["dataset_len"] - consumed
    return (f"lightning_sync: resuming epoch {sampler_state['epoch']} on {world_size} ranks (checkpoint: {old}); "
            f"{consumed} of {sampler_state['dataset_len']} samples were seen, the other {left} are dealt out "
            f"again over {world_size} ranks. Per-rank RNG streams start anew from the checkpoint's root seed.")


# ------------------------------------------------------------------------------------ auto-resume


def find_resume_checkpoint(directories: list[Path]) -> Path | None:
    """The newest complete checkpoint under ``directories`` (newest by modification time): a file, or a
    sharded checkpoint's directory (``SyncModelParallelStrategy``'s DCP checkpoints).

    A file cut short when its writer died (only possible outside ``AtomicCheckpointIO``, which
    renames complete files into place) fails :func:`~lightning_sync.checkpoint_io.is_complete_checkpoint`
    and is skipped with a log line; nothing is deleted.
    """
    from lightning_sync.checkpoint_io import DCP_METADATA, RANK_FILES, SHARDED_META, checkpoint_problem

    candidates: list[Path] = []
    for directory in directories:
        if directory.is_dir() and not (directory / SHARDED_META).is_file():
            # one-file checkpoints, and sharded ones: directories named *.ckpt (DCP shards + meta.pt)
            candidates += [p for p in directory.rglob("*.ckpt") if p.is_file() or (p / SHARDED_META).exists()
                           or (p / DCP_METADATA).exists()]
        elif directory.exists():
            candidates.append(directory)

    def written(path: Path) -> int:  # a sharded checkpoint: when its last file was written
        if not path.is_dir():
            return path.stat().st_mtime_ns
        return max((p.stat().st_mtime_ns for p in [path, *path.iterdir(), *path.glob(f"{RANK_FILES}/*")]), default=0)

    for path in sorted(candidates, key=written, reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        log.warning("lightning_sync: resume skips %s: %s.", path, problem)
    return None


# ------------------------------------------------------------------------------- strategy's helper


class ResumeHooks:
    """What ``SyncDDPStrategy`` calls at save, load and train start (keeps the strategy's edits small)."""

    def __init__(self) -> None:
        self._rng_after_iterator: dict[str, Any] | None = None
        self._expects_resumable_loader = False

    def check_training_loader(self, dataloader: object) -> None:
        """Refuse a training loader that cannot take the checkpoint's mid-epoch state (before any step)."""
        if self._expects_resumable_loader and not isinstance(getattr(dataloader, "sampler", None),
                                                              ResumableDistributedSampler):
            self._expects_resumable_loader = False
            sampler = getattr(dataloader, "sampler", None)
            raise ResumeError(
                "resume: the checkpoint holds the position of ddp_sync's resumable training loader (a map-style "
                "data set, the default batch sampler over Lightning's DistributedSampler), but this run's training "
                f"loader has sampler {type(sampler).__name__} / batch sampler "
                f"{type(getattr(dataloader, 'batch_sampler', None)).__name__}"
                f"{'' if torchdata_available() else ' and torchdata is not installed'}. Resume with the loader "
                "the checkpoint was written with (and torchdata installed: pip install 'torchdata>=0.10').")
        self._expects_resumable_loader = False

    @staticmethod
    def loader_payload(checkpoint: dict[str, Any]) -> Any:
        """This rank's loader states, to be gathered beside its RNG state."""
        return local_loader_states(checkpoint)

    def on_load(self, checkpoint: dict[str, Any], world_size: int, rank: int, fitting: bool = True) -> None:
        self._expects_resumable_loader = False
        self._rng_after_iterator = None
        if not fitting:  # validate/test/predict from a checkpoint: no training loader to resume
            return
        ours = checkpoint.get(CHECKPOINT_KEY) or {}
        sampler_state = select_loader_state(checkpoint, ours.get("loader_states"), world_size, rank)
        self._rng_after_iterator = None
        if sampler_state is None:
            return
        self._expects_resumable_loader = True
        if sampler_state["world_size"] != world_size and is_mid_epoch(sampler_state):
            adjust_progress_for_reshard(checkpoint, sampler_state, world_size)
            if rank == 0:
                log.warning(describe_reshard(sampler_state, world_size))
        rng_states = ours.get("rng_states") or []
        if is_mid_epoch(sampler_state) and ours.get("world_size") == world_size and rank < len(rng_states):
            # Lightning creates the resumed iterator (one draw from the global generator) before training
            # continues; the uninterrupted run made that draw at the epoch's start, before the checkpoint.
            self._rng_after_iterator = rng_states[rank]

    def on_train_start(self, trainer: Any = None) -> None:
        if trainer is not None:
            from lightning_sync._compat.lightning_api import load_pending_train_loader_state

            load_pending_train_loader_state(trainer)  # before the RNG states: a new iterator draws a seed
        if self._rng_after_iterator is not None:
            _restore_rng_state(self._rng_after_iterator)
            self._rng_after_iterator = None


class EpochLengthSync:
    """Keeps Lightning's batch count in step with a re-sharded epoch.

    After a resume on another world size the interrupted epoch is shorter or longer than a normal
    one, and Lightning counts batches once, when it sets up the loader. At the start of each later
    epoch the count is set from the loader again (only with the default ``limit_train_batches``).
    """

    @staticmethod
    def on_train_epoch_start(trainer: Any) -> None:
        from lightning_sync._compat.lightning_api import train_combined_loader

        fit_loop = trainer.fit_loop
        combined = train_combined_loader(trainer)
        if combined is None or trainer.limit_train_batches != 1.0:
            return
        loaders = combined.flattened
        if not any(isinstance(getattr(dl, "sampler", None), ResumableDistributedSampler) for dl in loaders):
            return
        limits = [len(dl) if isinstance(dl, Sized) else float("inf") for dl in loaders]
        combined.limits = limits
        if fit_loop.max_batches == len(combined):
            return
        fit_loop.max_batches = len(combined)
        if isinstance(trainer.val_check_interval, float) and trainer.val_check_batch is not None:
            trainer.val_check_batch = max(1, int(fit_loop.max_batches * trainer.val_check_interval))


def install_auto_resume(launcher: Any, directories: Any) -> None:
    """Make ``launcher.launch`` resume ``fit`` without ``ckpt_path`` from the newest complete checkpoint.

    The launcher object stays what it is (Lightning checks its type); only its ``launch`` gains a
    step. Each rank searches the same ``directories(trainer)`` before the process group exists
    (after an elastic restart every rank starts again).
    """
    import inspect

    from lightning_sync._compat.lightning_api import FIT_IMPL_NAME

    inner = launcher.launch

    def launch(function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is not None and getattr(function, "__name__", "") == FIT_IMPL_NAME:
            bound = inspect.signature(function).bind(*args, **kwargs)
            if bound.arguments.get("ckpt_path") is None:
                dirs = directories(trainer)
                chosen = find_resume_checkpoint(dirs) if dirs else None
                where = ", ".join(map(str, dirs))
                if chosen is not None:
                    log.warning("lightning_sync: resume: resuming from %s (the newest complete checkpoint under "
                                "%s).", chosen, where)
                    bound.arguments["ckpt_path"] = str(chosen)
                elif dirs:
                    log.info("lightning_sync: resume: no checkpoint under %s; starting fresh.", where)
                args, kwargs = bound.args, bound.kwargs
        return inner(function, *args, trainer=trainer, **kwargs)

    setattr(launcher, "launch", launch)


def auto_resume_directories(resume: str) -> Any:
    """Where ``resume`` looks: ``"auto"``: every ModelCheckpoint's ``dirpath`` and Lightning's SLURM
    ``hpc_ckpt_*.ckpt`` files in ``default_root_dir``; else the directory given."""

    def directories(trainer: Any) -> list[Path]:
        if resume != "auto":
            return [Path(resume)]
        dirs = [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
        # Lightning's own SLURM preemption checkpoints (SIGUSR1 -> hpc_ckpt_N.ckpt in default_root_dir)
        hpc = sorted(Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt"))
        if not dirs and not hpc and _global_rank() == 0:  # the same on every rank: said once
            log.warning("lightning_sync: resume='auto' has nowhere to look: no ModelCheckpoint(dirpath=...). A "
                        "restarted run starts fresh; set dirpath, or pass resume=<directory>.")
        return dirs + hpc

    return directories


def _global_rank() -> int:
    """The global rank the launcher announced (before the process group exists); 0 if none did."""
    from lightning_sync.config import global_rank  # imports Hydra: only when resume="auto" is used

    return global_rank()


# ------------------------------------------------------------------------------- elastic restarts


def init_process_group_after_restart(backend: str, timeout: Any, device_id: Any = None) -> bool:
    """Under torchrun, from the second attempt on: join the process group under a per-attempt store prefix.

    torchrun's agent keeps one store for all attempts; measured with torch 2.13, gloo's rendezvous
    of a restarted worker group then reads the dead group's addresses from it ("Connection
    refused", or a hang in ``init_process_group``). A fresh key prefix per attempt avoids that.
    Returns whether it initialised the group (Lightning then skips its own ``init_process_group``).
    """
    import os
    from datetime import timedelta

    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if (attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not dist.is_available()
            or dist.is_initialized()):
        return False
    c10d: Any = dist  # the store classes are exported without declarations (mypy)
    wait = timeout if isinstance(timeout, timedelta) else timedelta(minutes=30)
    client = c10d.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=wait)
    store = c10d.PrefixStore(f"lightning_sync/attempt_{attempt}", client)
    from lightning_sync._compat.torch_api import init_process_group_kwargs

    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=wait,
                            **init_process_group_kwargs(device_id))
    log.warning("lightning_sync: torchrun restart %s: process group joined under a fresh store prefix.", attempt)
    return True
