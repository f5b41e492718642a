"""Exact evaluation sharding: every dataset index on exactly one rank, once, in equal step counts.

Lightning's evaluation ``DistributedSampler`` pads each rank to the same length by repeating
samples (1001 samples on 2 ranks: one is evaluated twice), so epoch values of ``self.log`` and of
torchmetrics objects differ from one process on the whole set. Under ``ddp_sync`` with
``exact_eval=True`` the strategy hands every evaluation loader (validate, test, fit's validation,
predict) to :func:`exact_eval_dataloader`, which keeps the loader's sample order (shuffled or not,
the user's own ``DistributedSampler``, a custom sampler inside Lightning's
``DistributedSamplerWrapper``; a shuffled order of more than :data:`IN_MEMORY_SHUFFLE_MAX` samples
is another one, computed as it is read: :class:`RandomPermutation`) and replaces only how it is cut:

* rank ``r`` gets a contiguous block of that order, ``N // W`` samples or one more (no padding);
* every rank runs the same number of steps, ``ceil(N / (W * B))``, wherever that is possible
  (``N >= W`` and ``B > 1``): the last batches of some ranks are smaller;
* where it is impossible (batch size 1 and ``N % W != 0``) the ranks' step counts differ by one;
  :class:`ExactEvaluation` knows every rank's count without communicating, and a per-step
  collective inside an evaluation step raises :class:`~lightning_sync.UnevenEvaluationError` on
  every rank at once instead of hanging. Epoch-end values stay exact.

The planning functions (:func:`shard_sizes`, :func:`batch_sizes`, :func:`plan_steps`,
:func:`global_order`) work on plain torch samplers and are meant to be reused (training-sampler
state, prediction writing); Lightning's private loader names live in ``lightning_sync._compat``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from lightning_sync._compat import lightning_api as _compat
from lightning_sync.errors import UnevenEvaluationError, format_ranks

__all__ = [
    "EVALUATION_STEP_HOOKS",
    "IN_MEMORY_SHUFFLE_MAX",
    "SHUFFLE_ORDERS",
    "EpochOrder",
    "ExactEvalBatchSampler",
    "RandomPermutation",
    "ExactEvaluation",
    "StepPlan",
    "batch_sizes",
    "exact_eval_dataloader",
    "global_order",
    "plan_steps",
    "shard_sizes",
    "shuffle_order",
]

EVALUATION_STEP_HOOKS = ("validation_step", "test_step", "predict_step")


def shard_sizes(num_samples: int, world_size: int) -> list[int]:
    """Balanced contiguous shard sizes: ``num_samples // world_size``, the first ranks one more."""
    base, extra = divmod(num_samples, world_size)
    return [base + (rank < extra) for rank in range(world_size)]


def batch_sizes(count: int, steps: int, batch_size: int) -> list[int]:
    """Cut ``count`` samples into exactly ``steps`` batches of at most ``batch_size``, none empty.

    Full batches first; the last ones shrink so that every batch keeps at least one sample.
    Requires ``steps <= count <= steps * batch_size``.
    """
    if not steps <= count <= steps * batch_size:
        raise ValueError(f"batch_sizes: {count} samples cannot fill {steps} batches of 1..{batch_size}.")
    sizes = []
    remaining = count
    for step in range(steps):
        size = min(batch_size, remaining - (steps - step - 1))
        sizes.append(size)
        remaining -= size
    return sizes


@dataclass(frozen=True)
class StepPlan:
    """How ``num_samples`` are cut across ranks.

    Attributes:
        counts: samples per rank (contiguous blocks of the epoch's order, in rank order).
        batches: batch sizes per rank.
        even: every rank runs the same number of steps.
    """

    num_samples: int
    batch_size: int
    counts: tuple[int, ...]
    batches: tuple[tuple[int, ...], ...]

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(len(b) for b in self.batches)

    @property
    def even(self) -> bool:
        return len(set(self.steps)) == 1

    def start(self, rank: int) -> int:
        return sum(self.counts[:rank])


def plan_steps(num_samples: int, world_size: int, batch_size: int) -> StepPlan:
    """Plan exact sharding with equal step counts wherever possible.

    Equal counts need every rank to hold at least ``ceil(N / (W * B))`` samples, which holds for
    every ``N >= W`` when ``B >= 2``; otherwise each rank cuts its block into full batches.
    """
    if world_size < 1 or batch_size < 1 or num_samples < 0:
        raise ValueError(f"plan_steps: need world_size >= 1, batch_size >= 1, num_samples >= 0; got "
                         f"{world_size}, {batch_size}, {num_samples}.")
    counts = shard_sizes(num_samples, world_size)
    steps = math.ceil(num_samples / (world_size * batch_size))
    if min(counts) >= steps:
        batches = [tuple(batch_sizes(c, steps, batch_size)) for c in counts]
    else:
        batches = [tuple([batch_size] * (c // batch_size) + ([c % batch_size] if c % batch_size else []))
                   for c in counts]
    return StepPlan(num_samples, batch_size, tuple(counts), tuple(batches))


#: Shuffled orders of at most this many samples are torch's ``DistributedSampler`` order (``randperm``,
#: held as one int32 tensor: 64 MiB at this size); larger ones are computed on the fly
#: (:class:`RandomPermutation`, nothing held per sample), a different order of the same samples.
IN_MEMORY_SHUFFLE_MAX = 2**24
#: How a shuffled epoch order is drawn from its seed (recorded in the training sampler's checkpoint state).
SHUFFLE_ORDERS = ("randperm", "feistel")


def shuffle_order(num: int) -> str:
    """The shuffled order used for ``num`` samples: ``"randperm"`` up to :data:`IN_MEMORY_SHUFFLE_MAX`, else ``"feistel"``."""
    return "randperm" if num <= IN_MEMORY_SHUFFLE_MAX else "feistel"


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: the multiply-shift hash's odd multiplier


class RandomPermutation:
    """A seeded permutation of ``range(num)``, computed position by position: O(1) memory at any size.

    A 6-round unbalanced Feistel network on the bit width of ``num - 1`` (at most ``2 * num``
    values), with cycle walking: a value ``>= num`` is permuted again until it falls in range, so
    every position maps to one index and every index to one position. Each round splits the value
    into two parts and xors one with a multiply-shift hash of the other and a 64-bit round key; the
    keys come from a ``torch.Generator`` seeded with ``seed``, so the order is a function of
    ``(num, seed)`` alone, the same on every rank and machine. Reading ``perm[a:b:c]`` or
    ``perm[positions]`` returns an int64 tensor (vectorised numpy: ~40 ns a sample here).
    """

    ROUNDS = 6

    def __init__(self, num: int, seed: int) -> None:
        if num < 1:
            raise ValueError(f"RandomPermutation: need at least one sample, got {num}")
        self.num = num
        bits = max(2, (num - 1).bit_length())
        g = torch.Generator()
        g.manual_seed(seed)
        keys = [np.uint64(int(k)) for k in torch.randint(0, 2**62, (self.ROUNDS,), generator=g)]
        high, low = bits // 2, bits - bits // 2  # the part a round changes, the part it hashes
        self._rounds = []
        for key in keys:
            self._rounds.append((key, np.uint64((1 << low) - 1), np.uint64(low), np.uint64(high), np.uint64(64 - high)))
            high, low = low, high

    def __len__(self) -> int:
        return self.num

    def _feistel(self, x: Any) -> Any:
        for key, low_mask, low_bits, high_bits, shift in self._rounds:
            low = x & low_mask
            high = x >> low_bits
            mixed = low ^ key
            mixed *= _GOLDEN  # wraps modulo 2**64 (numpy arrays do not warn)
            mixed >>= shift  # the product's top high_bits bits
            high ^= mixed
            low <<= high_bits  # the hashed part goes on top, the changed part below: the next round's split
            low |= high
            x = low
        return x

    def __getitem__(self, key: slice | torch.Tensor) -> torch.Tensor:
        if isinstance(key, slice):
            positions = np.arange(*key.indices(self.num), dtype=np.uint64)
        else:
            wanted = torch.as_tensor(key, dtype=torch.int64)
            if wanted.numel() and (int(wanted.min()) < 0 or int(wanted.max()) >= self.num):
                raise IndexError(f"RandomPermutation: positions must lie in 0..{self.num - 1}")
            positions = wanted.numpy().astype(np.uint64)
        out = self._feistel(positions)
        walking = np.flatnonzero(out >= np.uint64(self.num))
        while walking.size:
            out[walking] = self._feistel(out[walking])
            walking = walking[out[walking] >= np.uint64(self.num)]
        return torch.from_numpy(out.astype(np.int64))


class EpochOrder:
    """One epoch's order of dataset indices, without a Python list of them.

    ``range(n)`` is arithmetic (nothing is held). A shuffled order of up to
    :data:`IN_MEMORY_SHUFFLE_MAX` samples is torch's ``DistributedSampler`` order,
    ``torch.randperm(n)`` from a generator seeded with ``seed + epoch``, held as one int32 tensor:
    4 bytes a sample instead of the ~36 of a list of Python ints (``randperm``'s values do not depend
    on its dtype). A larger one is a :class:`RandomPermutation` of the same seed, computed as it is
    read. The indices of a wrapped sampler are held as a tensor when they are integers, as the
    sampler's own list otherwise. Positions are read in slices (:meth:`take`, :meth:`pieces`), so
    iterating costs one small list per batch or per piece.
    """

    def __init__(self, num: int, values: torch.Tensor | RandomPermutation | list[Any] | None = None) -> None:
        self.num = num
        self.values = values

    @classmethod
    def of(cls, num: int, shuffle: bool, seed: int, order: str | None = None) -> EpochOrder:
        """``range(num)``, or the epoch's permutation drawn from ``seed`` (``order``: one of
        :data:`SHUFFLE_ORDERS`, by default :func:`shuffle_order` of ``num``)."""
        if not shuffle:
            return cls(num)
        if (order or shuffle_order(num)) == "feistel" and num > 0:
            return cls(num, RandomPermutation(num, seed))
        g = torch.Generator()
        g.manual_seed(seed)
        return cls(num, torch.randperm(num, generator=g, dtype=torch.int32 if num < 2**31 else torch.int64))

    def __len__(self) -> int:
        return self.num

    def take(self, start: int, stop: int, step: int = 1) -> list[Any]:
        """The indices at positions ``start:stop:step`` (clipped to the order, like a list slice)."""
        if self.values is None:
            return list(range(*slice(start, stop, step).indices(self.num)))
        if isinstance(self.values, list):
            return self.values[start:stop:step]
        return self.values[start:stop:step].tolist()

    def at(self, positions: Sequence[int]) -> list[Any]:
        """The indices at the given positions."""
        if self.values is None:
            return list(positions)
        if isinstance(self.values, list):
            return [self.values[p] for p in positions]
        return self.values[torch.as_tensor(positions, dtype=torch.int64)].tolist()

    def pieces(self, start: int, stop: int, step: int = 1, size: int = 1 << 16) -> Iterator[Sequence[Any]]:
        """Positions ``start:stop:step`` as consecutive sequences of at most ``size`` indices.

        Without shuffling one ``range`` covers them all; otherwise each piece is a list (iterating
        a list or a range runs in C, with no Python frame per index).
        """
        positions = range(*slice(start, stop, step).indices(self.num))
        if self.values is None:
            if positions:
                yield positions
            return
        for first in range(0, len(positions), size):
            part = positions[first:first + size]
            yield self.take(part.start, part.stop, part.step)

    def tolist(self) -> list[Any]:
        return self.take(0, self.num)

    def __iter__(self) -> Iterator[Any]:
        for piece in self.pieces(0, self.num):
            yield from piece

    def __getitem__(self, key: int | slice) -> Any:
        """One index (``order[i]``) or a list of them (``order[a:b:c]``), as from a list."""
        if isinstance(key, slice):
            return self.at(range(self.num)[key])
        position = range(self.num)[key]  # IndexError past the end, negative positions from the end
        return self.take(position, position + 1)[0]


def global_order(sampler: DistributedSampler[Any]) -> EpochOrder:
    """The order of the whole epoch that ``sampler`` shards (identical on every rank).

    A plain ``DistributedSampler``: ``range(N)``, or a permutation drawn from ``seed + epoch``.
    Lightning's sampler wrappers: the wrapped sampler's indices, materialised under an RNG seeded
    from ``seed + epoch`` (so a sampler drawing from the global RNG agrees across ranks, whose own
    streams differ under ``ddp_sync``), then permuted the same way when the wrapper shuffles.
    """
    inner = _compat.wrapped_sampler(sampler)
    num = len(sampler.dataset)  # type: ignore[arg-type]
    if isinstance(inner, RandomSampler) and not inner.replacement and inner.num_samples == len(inner.data_source):
        inner, shuffle = None, True
    elif isinstance(inner, SequentialSampler):
        inner, shuffle = None, bool(sampler.shuffle)
    else:
        shuffle = bool(sampler.shuffle)
    positions = EpochOrder.of(num, shuffle, sampler.seed + sampler.epoch)
    if inner is None:
        return positions
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(sampler.seed + sampler.epoch)
        materialised = list(inner)
    values: torch.Tensor | list[Any] | None = None
    if all(type(i) is int for i in materialised):
        try:
            values = torch.tensor(materialised, dtype=torch.int64)
        except (OverflowError, RuntimeError, ValueError):  # keys beyond int64: the list below
            values = None
        if values is not None and isinstance(positions.values, RandomPermutation):
            values = values[positions.values[0:num]]
        elif values is not None and isinstance(positions.values, torch.Tensor):
            values = values[positions.values.long()]
    if values is None:  # indices that are not int64 integers (a sampler of keys): the sampler's own list
        values = materialised if positions.values is None else [materialised[p] for p in positions.tolist()]
    return EpochOrder(num, values)


class ExactEvalBatchSampler:
    """Yields this rank's batches of the exact plan; ``sampler`` is the distributed sampler it shards.

    Lightning's ``set_epoch`` reaches ``sampler`` (``dataloader.batch_sampler.sampler``), so a
    shuffled evaluation order changes per epoch exactly as with the sampler alone.
    """

    def __init__(self, sampler: DistributedSampler[Any], batch_size: int, rank: int, world_size: int,
                 monitor: ExactEvaluation | None = None, name: str = "") -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = False
        self.rank = rank
        self.world_size = world_size
        self.monitor = monitor
        self.name = name
        self.plan = plan_steps(len(sampler.dataset), world_size, batch_size)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self.plan.steps[self.rank]

    def __iter__(self) -> Iterator[list[int]]:
        if self.monitor is not None:
            self.monitor.started(self)
        order = global_order(self.sampler)
        position = self.plan.start(self.rank)
        for size in self.plan.batches[self.rank]:
            yield order.take(position, position + size)
            position += size


class ExactEvaluation:
    """The exact-evaluation state of one strategy: which loader runs, and whether steps pair.

    The batch sampler of the running loader reports here when its epoch starts (in the main
    process, also with workers); :meth:`check_step_collective` raises when a per-step collective
    in an evaluation step could not pair because the ranks' step counts differ.
    """

    def __init__(self) -> None:
        self.current: ExactEvalBatchSampler | None = None
        self.limits: Sequence[int | float] = ()

    def started(self, batch_sampler: ExactEvalBatchSampler) -> None:
        self.current = batch_sampler

    def check_step_collective(self, what: str, fx_name: str | None, limit: int | float | None = None) -> None:
        """Raise :class:`UnevenEvaluationError` if ``what`` runs in an evaluation step whose ranks differ in steps.

        Args:
            what: the collective, for the message (``"self.log(..., sync_dist=True)"``).
            fx_name: the LightningModule hook running now.
            limit: the trainer's batch limit for this loader (``limit_val_batches`` or the
                sanity-check steps); step counts are compared after it.
        """
        if fx_name not in EVALUATION_STEP_HOOKS or self.current is None:
            return
        plan = self.current.plan
        steps = [_limited(s, limit) for s in plan.steps]
        if len(set(steps)) == 1:
            return
        raise UnevenEvaluationError(
            f"{what} in {fx_name}: ranks run different numbers of evaluation steps ({format_ranks(steps)}): "
            f"{plan.num_samples} samples in batches of {plan.batch_size} cannot be cut into equal step counts "
            f"on {len(steps)} ranks without repeating a sample, so this per-step collective would hang. "
            "Epoch values stay exact. Fix: log with on_step=False (the default in evaluation; the epoch value "
            "is reduced once, exactly), use a batch size of 2 or more, or pass "
            "SyncDDPStrategy(exact_eval=False) for Lightning's padded sampler (some samples counted twice).",
            values=dict(enumerate(steps)),
        )


def _limited(steps: int, limit: int | float | None) -> int:
    # Lightning's limit_*_batches: an int caps the steps, a float in (0, 1] keeps that fraction of them.
    if limit is None or isinstance(limit, float) and (limit >= 1.0 or math.isinf(limit)):
        return steps
    if isinstance(limit, float):
        return int(steps * limit)
    return min(steps, int(limit))


def _distributed_sampler(dataloader: DataLoader[Any]) -> tuple[DistributedSampler[Any] | None, Any]:
    """The loader's distributed sampler and its plain ``BatchSampler`` (unwrapping Lightning's index wrapper)."""
    inner_batch_sampler = _compat.unwrap_index_batch_sampler(dataloader.batch_sampler)
    if type(inner_batch_sampler) is not BatchSampler or inner_batch_sampler.drop_last:
        return None, None
    sampler = inner_batch_sampler.sampler
    if not isinstance(sampler, DistributedSampler):
        return None, None
    return sampler, inner_batch_sampler


def _shardable(sampler: DistributedSampler[Any], rank: int, world_size: int) -> bool:
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler, UnrepeatedDistributedSamplerWrapper

    known_iters = {cls.__iter__ for cls in (DistributedSampler, DistributedSamplerWrapper, UnrepeatedDistributedSampler,
                                            UnrepeatedDistributedSamplerWrapper)}
    return (type(sampler).__iter__ in known_iters and not sampler.drop_last
            and sampler.num_replicas == world_size and sampler.rank == rank)


def exact_eval_dataloader(dataloader: object, rank: int, world_size: int, predicting: bool = False,
                          monitor: ExactEvaluation | None = None) -> object:
    """Return ``dataloader`` re-cut by :class:`ExactEvalBatchSampler`, or unchanged if it cannot be.

    Unchanged: not a ``DataLoader``, no ``DistributedSampler`` (iterable datasets, a user's sharding),
    a custom batch sampler or ``drop_last=True`` (batches are the user's), a ``DistributedSampler``
    subclass with its own ``__iter__``, or one built for another rank/world size.

    Raises:
        UnevenEvaluationError: fewer samples than ranks (a rank would have none), on every rank.
    """
    if not isinstance(dataloader, DataLoader):
        return dataloader
    sampler, inner_batch_sampler = _distributed_sampler(dataloader)
    if sampler is None or not _shardable(sampler, rank, world_size):
        return dataloader
    num = len(sampler.dataset)  # type: ignore[arg-type]
    if 0 < num < world_size:
        raise UnevenEvaluationError(
            f"exact evaluation: the evaluation dataset has {num} samples for {world_size} ranks: "
            f"{world_size - num} rank(s) would get none, and Lightning cannot run an evaluation loop on an empty "
            f"shard. Fix: evaluate on at most {num} devices, or pass SyncDDPStrategy(exact_eval=False) for "
            "Lightning's padded sampler (samples repeated).",
            values=dict(enumerate(shard_sizes(num, world_size))),
        )
    batch_sampler: Any = ExactEvalBatchSampler(sampler, inner_batch_sampler.batch_size, rank, world_size, monitor)
    if predicting:  # Lightning's prediction index tracking, holding only the batches its loop has not read
        in_flight = dataloader.num_workers * (dataloader.prefetch_factor or 2) if dataloader.num_workers else 0
        batch_sampler = _compat.index_batch_sampler(batch_sampler, window=in_flight + 16)
    return _compat.dataloader_with_batch_sampler(dataloader, batch_sampler)


def evaluation_limit(trainer: Any) -> int | float | None:
    """The batch limit the running evaluation loop applies per rank (sanity steps or ``limit_*_batches``)."""
    if trainer is None:
        return None
    if trainer.sanity_checking:
        return int(trainer.num_sanity_val_steps)
    if trainer.testing:
        return trainer.limit_test_batches  # type: ignore[no-any-return]
    if trainer.predicting:
        return trainer.limit_predict_batches  # type: ignore[no-any-return]
    return trainer.limit_val_batches  # type: ignore[no-any-return]


def is_integer_mean(tensor: torch.Tensor, reduce_op: Any) -> bool:
    """``self.log``'s sample count reduced with "mean": an integer tensor Lightning would truncate.

    Lightning's epoch mean is ``reduce(sum of value * batch_size) / reduce(sum of batch_size)``, both
    with ``reduce_op="mean"``; on gloo the integer count's mean is truncated (1001 samples on 2 ranks:
    500, not 500.5; Lightning #21859), which skews the epoch value. Reducing it as a float is exact.
    """
    op = reduce_op if isinstance(reduce_op, str) else str(reduce_op).rsplit(".", 1)[-1]
    return op.lower() in ("mean", "avg") and not (tensor.is_floating_point() or tensor.is_complex())
