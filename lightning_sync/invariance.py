"""World-size invariance: N ranks train the model one process trains, within float rounding.

Under ``SyncDDPStrategy(world_size_invariant=True)`` the training ``DataLoader`` describes the
one-process run (its ``batch_size`` is the *global* batch ``G``) and every step of N ranks is that
run's step, split:

* **the data plan** (:class:`GlobalBatchSampler`): the epoch's order is the one-process order
  (``randperm`` of ``seed + epoch``, or ``range``); step ``s`` is positions ``s*G .. s*G+G-1`` of it
  (the last one shorter, or dropped with ``drop_last``); rank ``r`` takes a contiguous slice of
  ``shard_sizes(len, N)[r]`` rows. No padding, no sample twice, the same steps on any N, and a
  resume on another N continues at the same global batch. A step whose last global batch has fewer
  samples than ranks gives the ranks without one a *stand-in* (their previous slice, counted zero).
* **the gradient**: DDP averages over ranks; a rank's loss is scaled by ``N * n_r / sum(n)`` in a step
  whose slices differ in size (:class:`~lightning_sync.joining.StepShare`), so the result is the mean
  over the global batch, as one process computes it.
* **per-sample randomness** (:class:`KeyedSampleDataset`): torch's, numpy's and ``random``'s global
  generators are seeded from ``(root seed, epoch, sample index)`` before each ``dataset[i]``, in the main
  process (torch's stream put back afterwards) or in any worker: an augmentation drawn in
  ``__getitem__`` is the same whichever rank or worker loads the sample. A data set that says
  ``keyed_generators = ("torch",)`` has only those seeded (:func:`keyed_generators`: a third of the
  cost).
* **dropout** (:func:`make_dropout_invariant`): an ``nn.Dropout``/``Dropout1d/2d/3d`` layer in training
  computes the mask of this rank's rows only, each element's draw a counter-based hash (SplitMix64) of its
  index in the global batch's mask and a key of ``(root, epoch, step, layer, call)``: the mask a sample gets
  does not depend on N, and a rank's cost and memory are those of its own rows (as per-rank dropout's),
  whatever N.

What stays per rank: random numbers a ``training_step`` draws itself (``torch.rand``...), a ``collate_fn``'s
batch-level randomness (it sees the rank's slice), dropout inside ``F.dropout`` calls of the user's own or
attention's ``dropout_p``. See ``docs/invariance.md``.

This module knows nothing of Lightning (the part in ``lightning_sync.parts.invariant`` wires it in).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import hashlib
import math
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_sync._compat.torch_api import current_autograd_node
from lightning_sync.joining import StepShare
from lightning_sync.sampling import EpochOrder, shard_sizes, shuffle_order
from lightning_sync.seeding import derive_key64, derive_seed, derive_seeds

__all__ = ["GENERATORS", "DropoutStep", "GlobalBatchSampler", "InvariantLoader", "KeyedSampleDataset", "SampleKey",
           "checkpoint_context", "dropout_step", "global_steps", "keyed_generators", "make_dropout_invariant",
           "rerun_dropout_step"]


def global_steps(num_samples: int, batch_size: int, drop_last: bool) -> int:
    """Steps of one epoch of ``num_samples`` in global batches of ``batch_size``."""
    return num_samples // batch_size if drop_last else math.ceil(num_samples / batch_size)


class SampleKey(NamedTuple):
    """What :class:`GlobalBatchSampler` yields for a sample: its index and the epoch (the randomness key)."""

    epoch: int
    sample: int  # the data set index


class GlobalBatchSampler:
    """A batch sampler: this rank's slice of each global batch of the one-process epoch (see the module doc).

    Args:
        num_samples: the data set's length.
        batch_size: the global batch ``G``.
        world_size, rank: the data-parallel ranks and this one.
        shuffle, seed: the one-process order: ``randperm`` seeded with ``seed + epoch``, or ``range``.
        drop_last: drop the epoch's last, partial global batch.
    """

    def __init__(self, num_samples: int, batch_size: int, world_size: int, rank: int, shuffle: bool, seed: int,
                 drop_last: bool) -> None:
        if batch_size < world_size:
            raise ValueError(
                f"world_size_invariant=True: the training DataLoader's batch_size is the global batch (what one "
                f"process trains on per step), and {batch_size} cannot be split over {world_size} ranks. Use a "
                f"batch_size of at least {world_size}.")
        steps = global_steps(num_samples, batch_size, drop_last)
        last = num_samples - (steps - 1) * batch_size if steps else 0
        if steps == 1 and last < world_size:
            raise ValueError(
                f"world_size_invariant=True: the training set has {num_samples} samples, fewer than the "
                f"{world_size} ranks: some rank would have no sample at all. Train on fewer ranks.")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.world_size, self.rank = world_size, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.order = shuffle_order(num_samples)
        self.epoch = 0
        self._skip = 0  # global batches of `epoch` already trained (a resumed epoch)
        self._cached: tuple[int, EpochOrder] | None = None

    # Lightning sets the epoch on ``loader.batch_sampler.sampler``: that is this object.
    @property
    def sampler(self) -> GlobalBatchSampler:
        return self

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._skip = 0
        self.epoch = epoch

    def resume_at(self, epoch: int, batches: int) -> None:
        """Continue ``epoch`` after its first ``batches`` global batches (the next epoch if it was complete)."""
        if batches >= len(self):
            epoch, batches = epoch + 1, 0
        self.epoch, self._skip = epoch, batches

    def __len__(self) -> int:
        return global_steps(self.num_samples, self.batch_size, self.drop_last)

    def sizes(self, step: int, world_size: int | None = None) -> tuple[int, ...]:
        """Every rank's real row count in ``step`` (0: a stand-in step on that rank); ``world_size``: split over
        that many ranks instead of this plan's."""
        rows = min(self.batch_size, self.num_samples - step * self.batch_size)
        return tuple(shard_sizes(rows, self.world_size if world_size is None else world_size))

    def share(self, step: int, world_size: int | None = None, rank: int | None = None) -> StepShare:
        """This rank's share of ``step`` (``world_size``, ``rank``: the global batch split over other ranks)."""
        sizes = self.sizes(step, world_size)
        done = tuple(None if n else step for n in sizes)  # a rank without rows "ran out" after `step` batches
        return StepShare(self.rank if rank is None else rank, step, sizes, done)

    def dropout_step(self, step: int, root: int, world_size: int | None = None,
                     rank: int | None = None) -> DropoutStep:
        """``step`` as the invariant dropout layers key it: the global batch's rows, this rank's of them
        (``world_size``, ``rank``: the global batch split over other ranks)."""
        sizes = self.sizes(step, world_size)
        rank = self.rank if rank is None else rank
        return DropoutStep(root=root, epoch=self.epoch, step=step, rows=sum(sizes), offset=sum(sizes[:rank]),
                           local=sizes[rank])

    def _epoch_order(self) -> EpochOrder:
        if self._cached is None or self._cached[0] != self.epoch:
            self._cached = (self.epoch, EpochOrder.of(self.num_samples, self.shuffle, self.seed + self.epoch,
                                                      self.order))
        return self._cached[1]

    def rows(self, step: int) -> list[SampleKey]:
        """This rank's samples in ``step`` (its previous step's again where it has none: a stand-in)."""
        return self.rows_among(step, self.world_size, self.rank)

    def rows_among(self, step: int, world_size: int, rank: int) -> list[SampleKey]:
        """Rank ``rank``'s samples of ``step`` were the global batch split over ``world_size`` ranks rather than this
        plan's (``ddp_sync_ft``'s live replica groups taking a missing group's share of the step); a stand-in (its
        slice of the previous step, weighted zero by :meth:`share`) where the step has fewer rows than ranks."""
        sizes = self.sizes(step, world_size)
        if sizes[rank] == 0:
            step, sizes = step - 1, self.sizes(step - 1, world_size)
        first = step * self.batch_size + sum(sizes[:rank])
        return [SampleKey(self.epoch, int(i)) for i in self._epoch_order().take(first, first + sizes[rank])]

    @property
    def first_step(self) -> int:
        """The step the next ``__iter__`` starts at."""
        return self._skip

    def __iter__(self) -> Iterator[list[SampleKey]]:
        skip, self._skip = self._skip, 0
        for step in range(skip, len(self)):
            yield self.rows(step)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps to check the resumed plan is this one (the position is Lightning's)."""
        return {"num_samples": self.num_samples, "batch_size": self.batch_size, "shuffle": self.shuffle,
                "seed": self.seed, "drop_last": self.drop_last, "order": self.order}


class InvariantLoader(DataLoader):  # type: ignore[type-arg]
    """A ``DataLoader`` over a :class:`GlobalBatchSampler` that queues each yielded batch's
    :class:`~lightning_sync.joining.StepShare` in ``shares`` (the loss scale and stand-in of its step, read by
    ``lightning_sync.parts.uneven`` when the step starts: Lightning fetches a batch ahead)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shares: collections.deque[StepShare | None] = collections.deque()

    @property
    def plan(self) -> GlobalBatchSampler:
        sampler = self.batch_sampler
        assert isinstance(sampler, GlobalBatchSampler)
        return sampler

    def load(self, keys: list[SampleKey]) -> Any:
        """The batch of ``keys``, drawn (keyed, as in a worker) and collated in this process."""
        dataset = self.dataset
        assert isinstance(dataset, KeyedSampleDataset)
        return self.collate_fn(dataset.__getitems__(keys))

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        plan = self.plan
        self.shares.clear()
        step = plan.first_step
        for batch in super().__iter__():
            share = plan.share(step)
            self.shares.append(share if share.applies else None)
            step += 1
            yield batch


#: The global generators :class:`KeyedSampleDataset` can seed before each sample (all of them by default).
GENERATORS = ("torch", "numpy", "random")

#: Set by :func:`lightning_sync.testing.check_world_size_invariance` in its runs: a directory where each loading
#: process notes which global generators each training sample moved (``NAME SAMPLE keyed|unkeyed`` lines).
CHECK_DRAWS_ENV = "LSYNC_CHECK_SAMPLE_DRAWS"


_ABSENT = object()


def keyed_generators(dataset: Any) -> tuple[str, ...]:
    """The global generators seeded before each of ``dataset``'s samples: its ``keyed_generators`` attribute (a
    tuple, list or set of names out of ``("torch", "numpy", "random")``; ``()``: none), on its class or the object
    itself, where it has one; else those of the data set a ``Subset`` takes from, the union of a
    ``ConcatDataset``'s parts'; else all three (any other wrapper without the attribute: all three).

    Raises:
        ValueError: an attribute that is not a tuple, list or set of those names (``None`` included).
    """
    return _declaration(dataset)[0]


def _declaration(dataset: Any) -> tuple[tuple[str, ...], str | None]:
    """:func:`keyed_generators`, and who declared them, in words (None: nobody, all three seeded)."""
    try:
        declared = getattr(dataset, "keyed_generators", _ABSENT)
    except Exception:  # noqa: BLE001 - a __getattr__ of the data set's own raising KeyError...: not declared
        declared = _ABSENT
    if declared is _ABSENT:
        if isinstance(dataset, torch.utils.data.Subset):
            return _declaration(dataset.dataset)
        if isinstance(dataset, torch.utils.data.ConcatDataset):
            parts = [_declaration(part) for part in dataset.datasets]
            if all(who is None for _, who in parts):
                return GENERATORS, None
            union = {name for names, _ in parts for name in names}
            owners = sorted({who if who is not None else f"{type(part).__name__} (no keyed_generators: all three)"
                             for (_, who), part in zip(parts, dataset.datasets)})
            return tuple(name for name in GENERATORS if name in union), f"its parts' ({', '.join(owners)})"
        return GENERATORS, None
    owner = _declared_on(dataset)
    if isinstance(declared, (tuple, list, set, frozenset)):
        unknown = [name for name in declared if not isinstance(name, str) or name not in GENERATORS]
        if not unknown:
            return tuple(name for name in GENERATORS if name in declared), owner
        problem = f"{', '.join(repr(name) for name in unknown)} {'is' if len(unknown) == 1 else 'are'} not one of them"
    elif declared is None:
        problem = "None is not a collection of them (for none, give ())"
    else:
        problem = f"a value of type {type(declared).__name__} is not a tuple, list or set of them"
    raise ValueError(
        f"world_size_invariant=True: {owner} = {declared!r}: give a tuple of the global generators the data set's "
        f"__getitem__ draws from, out of {GENERATORS!r} (e.g. ('torch',); () for none), or remove the attribute "
        f"to have all three seeded before each sample: {problem}.")


def _declared_on(dataset: Any) -> str:
    """``Class.keyed_generators`` where the attribute is the object's own or its class's, else the wrapper's
    forwarded one (its ``__getattr__`` answered from the data set it wraps)."""
    name = type(dataset).__name__
    if "keyed_generators" in getattr(dataset, "__dict__", {}) or any(
            "keyed_generators" in vars(cls) for cls in type(dataset).__mro__):
        return f"{name}.keyed_generators"
    return f"{name}.keyed_generators (forwarded by its __getattr__ from the data set it wraps)"


class KeyedSampleDataset(Dataset[Any]):
    """Wraps a map-style data set: ``dataset[SampleKey(epoch, i)]`` is ``dataset[i]`` drawn with torch's, numpy's
    and ``random``'s global generators seeded from ``derive_seed(root, "sample", epoch, i)``.

    In the main process torch's state is put back after each batch (the training step's torch stream does not
    move) while numpy's and ``random``'s go on from the last sample's stream (saving them costs more than the
    sample); in a worker all three are left as the last sample seeded them. CPU generators only: a data set
    drawing CUDA random numbers is not keyed. ``root`` is a seed or an object with a ``root`` attribute read at
    each batch (a resumed run adopts its checkpoint's). The wrapped data set's own ``__getitems__`` is not used:
    each sample is drawn by ``__getitem__``, keyed.

    Every generator is seeded before every sample, whether the sample draws from it or not: a check after the
    sample (did the state move?) would miss a sample that puts the state back (Lightning's ``isolate_rng``), and a
    sample drawn again once the check failed would keep what its first, unkeyed draw cached. Seeding all three costs
    ~17 us a sample between samples' own work (~8 in isolation: ``random`` 4.5, numpy 2, torch 1.35, the key 0.7);
    a data set that declares which generators it draws from (``keyed_generators = ("torch",)``, see
    :func:`keyed_generators`) has only those seeded: ~5.5 us with torch alone. A sample drawing from another one
    then takes that generator's running stream, which depends on the number of ranks:
    :func:`lightning_sync.testing.check_world_size_invariance` names such samples.

    Attributes:
        generators: the generators seeded before each sample (:func:`keyed_generators`).
        declared_by: where they were declared, in words (``"Crops.keyed_generators"``); None: nowhere (all three).
    """

    def __init__(self, dataset: Dataset[Any], root: Any) -> None:
        self.dataset = dataset
        self._root = root
        self.generators, self.declared_by = _declaration(dataset)

    @property
    def root(self) -> int:
        return int(getattr(self._root, "root", self._root))

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, SampleKey):
            return self.dataset[key]
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[Any]) -> list[Any]:
        """A batch's samples (torch's fetcher asks for the batch at once), each drawn with the generators seeded
        from its key. In the main process torch's state is saved once for the batch and put back after it (under
        a microsecond: the training step's own draws go on from the rank's stream); numpy's and ``random``'s go on
        from the last sample's (saving them would cost ~60 us and ~7 us a sample; no number repeats;
        deterministic)."""
        if not keys or not isinstance(keys[0], SampleKey):
            return [self[key] for key in keys]
        dataset, root, generators = self.dataset, self.root, self.generators
        seed = _seeder(generators)
        check = os.environ.get(CHECK_DRAWS_ENV, "")
        in_main = torch.utils.data.get_worker_info() is None
        torch_state = torch.default_generator.get_state() if in_main and "torch" in generators else None
        try:
            samples = []
            epoch, seeds = keys[0].epoch, derive_seeds(root, "sample", keys[0].epoch)
            for key in keys:
                if key.epoch != epoch:
                    epoch, seeds = key.epoch, derive_seeds(root, "sample", key.epoch)
                if seed is not None:
                    seed(seeds(key.sample))  # derive_seed(root, "sample", epoch, i)
                if check:
                    before = generator_digests()
                    samples.append(dataset[key.sample])
                    _note_draws(check, key.sample, generators, before, generator_digests())
                else:
                    samples.append(dataset[key.sample])
            return samples
        finally:
            if torch_state is not None:
                torch.default_generator.set_state(torch_state)

    def __getattr__(self, name: str) -> Any:
        # the wrapped data set's own attributes (not dunders: its ``__getitems__`` would bypass the keys)
        if name.startswith("__") or name in ("dataset", "_root", "generators", "declared_by"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


try:
    import numpy as _np
except ImportError:  # numpy is optional for torch
    _np = None  # type: ignore[assignment]


def _seed_cpu_generators(seed: int) -> None:
    """Seed torch's default CPU generator, ``random`` and numpy's global generator (``torch.manual_seed`` would
    also seed every CUDA generator: 70 us against 1; these three take ~1.35, 4.5 and 2 us in isolation)."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    if _np is not None:
        _np.random.seed(seed)


def _seeder(generators: tuple[str, ...]) -> Callable[[int], Any] | None:
    """The function seeding ``generators`` (None: none), built per batch (a data set sent to a worker is pickled)."""
    if generators == GENERATORS:
        return _seed_cpu_generators
    calls = [fn for name, fn in (("torch", torch.default_generator.manual_seed), ("random", random.seed),
                                 ("numpy", None if _np is None else _np.random.seed))
             if name in generators and fn is not None]
    if not calls:
        return None
    if len(calls) == 1:
        return calls[0]

    def seed_each(value: int) -> None:
        for fn in calls:
            fn(value)
    return seed_each


def generator_digests(names: tuple[str, ...] = GENERATORS) -> list[bytes]:
    """A digest of each named global generator's state, torch's CPU one, numpy's, ``random``'s (the invariance
    checker's runs: which of them a sample or a training step moved)."""
    out = []
    for name in names:
        if name == "torch":
            state = torch.default_generator.get_state().numpy().tobytes()
        elif name == "random":
            state = repr(random.getstate()).encode()
        elif _np is not None:
            legacy: Any = _np.random.get_state(legacy=True)
            state = _np.asarray(legacy[1]).tobytes() + repr(legacy[2:]).encode()
        else:
            state = b""
        out.append(hashlib.blake2b(state, digest_size=16).digest())
    return out


def _note_draws(directory: str, sample: int, keyed: tuple[str, ...], before: list[bytes],
                after: list[bytes]) -> None:
    """Note (the checker's runs) which global generators ``sample`` moved: a line ``NAME SAMPLE keyed|unkeyed``
    each in this process's file of ``directory`` (``before``/``after``: :func:`generator_digests`)."""
    moved = [name for name, a, b in zip(GENERATORS, before, after) if a != b]
    if moved:
        with open(os.path.join(directory, f"draws-{os.getpid()}.txt"), "a", encoding="utf-8") as f:
            f.writelines(f"{name} {sample} {'keyed' if name in keyed else 'unkeyed'}\n" for name in moved)


# --------------------------------------------------------------------------- dropout


@dataclass
class DropoutStep:
    """The running training step, as the invariant dropout layers key their masks.

    Attributes:
        root: the root seed.
        epoch, step: the global batch.
        rows: the global batch's row count.
        offset, local: this rank's first row in it and its row count (0: a stand-in step).
        calls: each layer's calls so far in the step (its ``n``-th call's mask is keyed by ``n``).
        recomputing: a checkpointed segment run again in backward (:func:`checkpoint_context`).
    """

    root: int
    epoch: int
    step: int
    rows: int
    offset: int
    local: int
    calls: collections.Counter[str] = None  # type: ignore[assignment]
    recomputing: bool = False

    def __post_init__(self) -> None:
        if self.calls is None:
            self.calls = collections.Counter()


_STEP: contextvars.ContextVar[DropoutStep | None] = contextvars.ContextVar("lightning_sync_dropout_step",
                                                                           default=None)


def set_dropout_step(step: DropoutStep | None) -> None:
    """Make ``step`` the running training step of this thread (None: none runs)."""
    _STEP.set(step)


def current_dropout_step() -> DropoutStep | None:
    """The running training step of this thread, as the invariant dropout layers see it (None: none runs)."""
    return _STEP.get()


def rerun_dropout_step() -> None:
    """The running training step is run again (a fault-tolerant step that was not committed): its dropout layers
    draw the same masks again, from their first call."""
    step = _STEP.get()
    if step is not None:
        step.calls.clear()


@contextlib.contextmanager
def dropout_step(step: DropoutStep) -> Iterator[DropoutStep]:
    """Run the block as ``step`` (tests, and a user's own loop)."""
    token = _STEP.set(step)
    try:
        yield step
    finally:
        _STEP.reset(token)


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


# SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014): the draw of
# counter i under key k is mix(k + i * GAMMA), computed on int64 tensors (multiplication wraps; a logical right
# shift is an arithmetic one masked).
_GAMMA = _signed64(0x9E3779B97F4A7C15)
_MIX = ((30, (1 << 34) - 1, _signed64(0xBF58476D1CE4E5B9)), (27, (1 << 37) - 1, _signed64(0x94D049BB133111EB)))
_LAST = (31, (1 << 33) - 1)
_SIGN = -(1 << 63)
# elements hashed at once, by device type: on CPU two int64 temporaries of 512 KB stay in cache (a 2**20 chunk
# was 2.7x slower for a 256 x 1024 mask); elsewhere fewer, larger launches (temporaries of 64 MB)
_CHUNK = {"cpu": 1 << 16}
_CHUNK_OTHER = 1 << 22


def _keep_mask(key: int, start: int, shape: tuple[int, ...], p: float, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> Tensor:
    """The keep mask (1 kept, 0 dropped, in ``dtype``) of elements ``start, start + 1, ...`` (row-major over
    ``shape``) of a counter-based stream keyed by ``key``: element ``i`` is kept when SplitMix64's output for
    counter ``i``, read as an unsigned 64-bit number, is at least ``round(p * 2**64)``. A slice of a larger mask
    is the same numbers whichever rank computes it and whatever the slice's bounds; the cost is that of the
    slice's elements, hashed in chunks (bounded temporaries)."""
    mask = torch.empty(shape, dtype=dtype, device=device)
    flat = mask.view(-1)
    # unsigned z >= T  <=>  signed (z ^ 2**63) >= T - 2**63
    threshold = min(round(p * 2.0**64), (1 << 64) - 1) + _SIGN
    total = flat.numel()
    chunk = _CHUNK.get(flat.device.type, _CHUNK_OTHER)
    for begin in range(0, total, chunk):
        end = min(begin + chunk, total)
        z = torch.arange(start + begin, start + end, dtype=torch.int64, device=flat.device)
        z.mul_(_GAMMA).add_(key)
        shifted = torch.empty_like(z)
        for shift, low, multiplier in _MIX:
            torch.bitwise_right_shift(z, shift, out=shifted)
            z.bitwise_xor_(shifted.bitwise_and_(low)).mul_(multiplier)
        shift, low = _LAST
        torch.bitwise_right_shift(z, shift, out=shifted)
        z.bitwise_xor_(shifted.bitwise_and_(low).bitwise_xor_(_SIGN))  # the last xor and the sign flip in one
        flat[begin:end] = z >= threshold
    return mask


def checkpoint_context() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False, context_fn=...)`` (or
    ``checkpoint_wrapper(module, context_fn=...)``) around layers with world-size-invariant dropout: the segment's
    recomputation in backward draws the masks its forward drew. A converted dropout layer run again in backward
    without it raises instead of drawing new masks (silently wrong gradients)."""
    snapshot: list[DropoutStep | None] = [None]

    @contextlib.contextmanager
    def forward() -> Iterator[None]:  # the step and its call counts where the segment starts
        step = _STEP.get()
        snapshot[0] = None if step is None else replace(step, calls=collections.Counter(step.calls), recomputing=True)
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:  # (in backward, on whichever thread autograd runs it)
        saved = snapshot[0]
        token = _STEP.set(None if saved is None else replace(saved, calls=collections.Counter(saved.calls)))
        try:
            yield
        finally:
            _STEP.reset(token)

    return forward(), recompute()


class _InvariantDropout:
    """Mixed into a converted dropout layer's class (``make_dropout_invariant``)."""

    _lsync_name: str  # its path in the module it was converted in (messages)
    _lsync_key: str  # that path without wrappers' own levels (torch.compile's, checkpoint_wrapper's): the mask key
    _lsync_channels: bool
    _lsync_unbatched: int  # the input rank torch reads as one unbatched sample (Dropout1d: 2, Dropout3d: 4), or -1
    p: float
    inplace: bool
    training: bool

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 - torch's name
        if not self.training or self.p == 0.0:
            return super().forward(input)  # type: ignore[misc, no-any-return]
        mask = _step_mask_eager(self, input)
        if mask is None:  # no training step runs (a loop of the user's own)
            return super().forward(input)  # type: ignore[misc, no-any-return]
        return input.mul_(mask) if self.inplace else input * mask


def _opt_out(name: str) -> str:
    return f"`model.get_submodule({name!r}).world_size_invariant = False`"


def _step_mask(layer: _InvariantDropout, input: Tensor) -> Tensor | None:  # noqa: A002 - torch's name
    """The mask ``layer`` applies in the running step (None: no step runs), scaled by ``1 / (1 - p)``."""
    step = _STEP.get()
    name = layer._lsync_name
    if current_autograd_node() is not None and (step is None or not step.recomputing):
        raise RuntimeError(
            f"world_size_invariant=True: dropout layer {name!r} ran again during backward (activation checkpointing "
            "recomputes it), where it must draw its forward's mask. Pass "
            "context_fn=lightning_sync.invariance.checkpoint_context to torch.utils.checkpoint.checkpoint(..., "
            "use_reentrant=False) (checkpoint_wrapper(module, context_fn=...) takes it too), or set "
            f"{_opt_out(name)} before fit to keep its per-rank dropout.")
    if step is None:
        return None
    if input.dim() == layer._lsync_unbatched:
        raise RuntimeError(
            f"world_size_invariant=True: dropout layer {name!r} ({type(layer).__bases__[1].__name__}) got a "
            f"{input.dim()}-D input, which torch reads as one sample without a batch dimension, so its mask cannot "
            f"be taken from the global batch's. Give it a batch first (one more dimension), or set {_opt_out(name)} "
            "before fit.")
    if step.local == 0:  # a stand-in step (its contribution is zero): any keyed mask does
        offset, local = 0, input.shape[0]
    else:
        offset, local = step.offset, step.local
    if input.dim() == 0 or input.shape[0] != local:
        raise RuntimeError(
            f"world_size_invariant=True: dropout layer {name!r} got an input of shape {tuple(input.shape)} whose "
            f"first dimension is not this rank's batch of {step.local} rows, so its mask cannot be taken from the "
            f"global batch's. Put the batch first (batch_first=True), or set {_opt_out(name)} before fit to keep its "
            "per-rank dropout (its masks then depend on the number of ranks).")
    key_name = layer._lsync_key
    call = step.calls[key_name]
    step.calls[key_name] = call + 1
    if layer._lsync_channels:  # Dropout1d/2d/3d: one draw per (sample, channel)
        shape = (local, input.shape[1], *([1] * (input.dim() - 2)))
    else:
        shape = (local, *input.shape[1:])
    if layer.p == 1.0:
        return torch.zeros(shape, dtype=input.dtype, device=input.device)
    key = _signed64(derive_key64(step.root, "dropout", step.epoch, step.step, key_name, call))
    mask = _keep_mask(key, offset * math.prod(shape[1:]), shape, layer.p, dtype=input.dtype, device=input.device)
    return mask.div_(1.0 - layer.p)


# Eager under torch.compile (one graph break a layer): Inductor folds the hash's wrapping int64 products as unbounded
# integers and fails ("too big to convert to int64_t"), and Dynamo would guard on the step's call counts (a
# recompilation every step until its limit)
_step_mask_eager = cast(Callable[[_InvariantDropout, Tensor], "Tensor | None"],
                        torch.compiler.disable(_step_mask))  # type: ignore[no-untyped-call]

# levels wrappers add to a module's path: the mask key is the path of the unwrapped model
_WRAPPER_LEVELS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def _key_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_LEVELS)


_CONVERTED: dict[type, type] = {}
_PLAIN = (nn.Dropout,)
_CHANNELS = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
_UNBATCHED = {nn.Dropout1d: 2, nn.Dropout3d: 4}  # (torch reads a 3-D input of Dropout2d as (N, C, L), with a warning)


def _invariant_class(cls: type) -> type:
    converted = _CONVERTED.get(cls)
    if converted is None:
        converted = _CONVERTED[cls] = type(f"WorldSizeInvariant{cls.__name__}", (_InvariantDropout, cls), {
            "__module__": __name__, "__doc__": f"``{cls.__name__}`` whose masks do not depend on the number of ranks."})
    return converted


def make_dropout_invariant(module: nn.Module) -> tuple[list[str], list[str]]:
    """Convert ``module``'s ``nn.Dropout`` and ``nn.Dropout1d/2d/3d`` layers in place (their class; weights,
    hooks and ``isinstance`` checks unchanged). Returns ``(converted, left)``: layer names converted, and those
    whose dropout stays per rank (``AlphaDropout``, attention's ``dropout``, a layer marked
    ``layer.world_size_invariant = False``). Idempotent."""
    converted: list[str] = []
    left: list[str] = []
    for name, layer in module.named_modules():
        if isinstance(layer, _InvariantDropout):
            converted.append(name)
        elif getattr(layer, "world_size_invariant", True) is False:
            left.append(f"{name} (marked world_size_invariant = False)")
        elif type(layer) in _PLAIN or type(layer) in _CHANNELS:
            kind = type(layer)
            layer.__class__ = _invariant_class(kind)
            layer._lsync_name = name
            layer._lsync_key = _key_name(name)
            layer._lsync_channels = kind in _CHANNELS
            layer._lsync_unbatched = _UNBATCHED.get(kind, -1)
            converted.append(name)
        elif isinstance(layer, (nn.AlphaDropout, nn.FeatureAlphaDropout)) and layer.p > 0:
            left.append(f"{name} ({type(layer).__name__}: no invariant form; remove it, or accept per-rank masks)")
        elif isinstance(layer, nn.MultiheadAttention) and layer.dropout > 0:
            left.append(f"{name} (attention dropout: set `{name or 'layer'}.dropout = 0.0`)")
    return converted, left
