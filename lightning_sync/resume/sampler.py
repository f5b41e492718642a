"""``ResumableDistributedSampler``: one epoch's global order and a cursor into it (the sampler position a
checkpoint holds), and the checks a checkpoint's sampler state must pass."""

from __future__ import annotations

import math
import operator
from typing import Any, Iterator, Sequence

from torch.utils.data import Dataset, DistributedSampler

from lightning_sync.errors import ResumeError
from lightning_sync.sampling import SHUFFLE_ORDERS, EpochOrder, shuffle_order

__all__ = ["SAMPLER_NAME", "ResumableDistributedSampler", "check_sampler_state"]

SAMPLER_NAME = "ResumableDistributedSampler"


class ResumableDistributedSampler(DistributedSampler):  # type: ignore[type-arg]
    """torch's ``DistributedSampler`` (same order and shards up to 2**24 samples) that resumes mid-epoch.

    The epoch is one global order: ``randperm(len(dataset))`` seeded with ``seed + epoch`` (or
    ``range`` without shuffling; above :data:`~lightning_sync.sampling.IN_MEMORY_SHUFFLE_MAX` samples
    a :class:`~lightning_sync.sampling.RandomPermutation` of the same seed, computed as it is read:
    other batches than torch's sampler, no memory per sample). ``order`` says which; a checkpoint
    keeps it, so a resumed run goes on with the order it started with. A *segment* of it, starting at
    global position ``start``, is padded (or cut, with ``drop_last``) to a multiple of the world size
    and dealt out: rank ``r`` takes positions ``start + r, start + r + W, ...``. After every rank took ``k`` samples, positions
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
        self.order = shuffle_order(self.dataset_len)  # how a shuffled epoch is drawn (SHUFFLE_ORDERS)
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
        return EpochOrder.of(self.dataset_len, self.shuffle, self.seed + self.epoch, self.order)

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
                "start": self.start, "yielded": self.yielded, "segment_len": self._segment_len(), "order": self.order}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_sampler_state(state, self.dataset_len, self.shuffle)
        self.order = str(state.get("order", "randperm"))  # states written before "order" existed: randperm
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
    order = state.get("order", "randperm")
    if order not in SHUFFLE_ORDERS:
        raise ResumeError(f"resume: the checkpoint's training sampler drew its shuffled order as {order!r}; this "
                          f"version of lightning_sync knows {list(SHUFFLE_ORDERS)}. Resume with the version that "
                          "wrote the checkpoint.")
    if bool(state["shuffle"]) != shuffle:
        raise ResumeError(f"resume: training shuffle={shuffle}, the checkpoint's sampler had shuffle="
                          f"{state['shuffle']}. Resume with the same shuffle setting.")
