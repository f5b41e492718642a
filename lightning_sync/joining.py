"""Uneven training data: the ranks' training loaders agree, batch by batch, on who still has data.

A training loader whose ranks may run out at different batches (an ``IterableDataset`` sharded by
rank, per-rank files, a sampler of the user's own) is wrapped in a :class:`AgreeingLoader`. Each
``next()`` on every rank exchanges one small record (has a batch, its size, batches so far) and
every rank then knows the same thing about the step:

* every rank has a batch: an ordinary step (the batch sizes may differ; see ``StepShare.loss_scale``);
* no rank has one: the epoch ends on every rank together;
* some ranks ran out (``mode``): ``"error"`` raises :class:`~lightning_sync.UnevenTrainingError` on
  every rank, ``"stop_together"`` ends the epoch on every rank, ``"join"`` carries on: a rank that
  ran out yields a *stand-in* (its last batch again) so that it runs the very same step code and
  meets every collective the others make (DDP's gradient all-reduce, ``sync_dist``, SyncBatchNorm,
  the step flags), while ``lightning_sync.parts.uneven`` makes its contribution zero.

A loader known to be even (one length on every rank and a ``DistributedSampler``, which gives every
rank equal batches) is passed through without any per-batch exchange. This module knows nothing of
Lightning: the part gives it the exchange (``agree``) and reads the shares it queues.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DistributedSampler

from lightning_sync.errors import UnevenTrainingError, format_ranks

__all__ = ["STATE_KEY", "AgreeingLoader", "StepShare", "wrap_evaluation_loader", "wrap_training_loader"]

#: The key of this module's part of a wrapped loader's state (``loader.state_dict()``).
STATE_KEY = "lightning_sync_uneven"

log = logging.getLogger(__name__)

#: One rank's record for a batch: [has a batch, its size, batches yielded so far this epoch, has no stand-in].
Agree = Callable[[list[int]], list[list[int]]]
_HAS, _SIZE, _COUNT, _NEEDS = range(4)


@dataclass(frozen=True)
class StepShare:
    """One training step as every rank agreed on it when its batch was fetched.

    Attributes:
        rank: this rank.
        step: the step's index in the epoch (0-based).
        sizes: every rank's real batch size in this step (0 where the rank has run out).
        done_after: per rank, ``None`` while it still has data, else the number of batches it had.
    """

    rank: int
    step: int
    sizes: tuple[int, ...]
    done_after: tuple[int | None, ...]

    @property
    def shadow(self) -> bool:
        """This rank ran out: its batch is a stand-in whose contribution must be zero."""
        return self.done_after[self.rank] is not None

    @property
    def joined(self) -> bool:
        """Some rank ran out: the step has stand-ins."""
        return any(d is not None for d in self.done_after)

    @property
    def live(self) -> int:
        """How many ranks have real data in this step."""
        return sum(d is None for d in self.done_after)

    @property
    def loss_scale(self) -> float:
        """What this rank's loss is multiplied by before backward, so that DDP's mean over ranks of the
        gradients is the mean over the step's samples: ``world * n_rank / sum(n)`` (0 for a stand-in,
        exactly 1 when every rank has the same batch size)."""
        total = sum(self.sizes)
        mine = self.sizes[self.rank]
        if self.shadow:
            return 0.0
        if total <= 0 or all(s == mine for s in self.sizes):
            return 1.0
        return len(self.sizes) * mine / total

    @property
    def applies(self) -> bool:
        """The step needs its share applied: a rank ran out, or the ranks' batches differ in size (else the
        step is an ordinary even one and its share is not queued)."""
        return self.joined or len(set(self.sizes)) > 1

    def describe(self) -> str:
        """Which ranks ran out and after how many batches, e.g. ``"rank 1 ran out after 40 batches"``."""
        out = {r: d for r, d in enumerate(self.done_after) if d is not None}
        parts = [f"rank {r} ran out after {d} batch{'es' if d != 1 else ''}" for r, d in out.items()]
        return "; ".join(parts)


class AgreeingLoader:
    """A training loader whose iterators agree across ranks, batch by batch, on who still has data.

    Everything but iteration is the wrapped loader's (attributes are read from and written to it:
    ``sampler``, ``dataset``, ``state_dict`` ...). Build it with :func:`wrap_training_loader`.
    """

    _own = frozenset({"loader", "mode", "_agree", "_rank", "_batch_size", "shares", "_stand_in",
                      "_length", "_warned", "_live", "_resumed"})

    def __init__(self, loader: Any, mode: str, agree: Agree, rank: int, batch_size: Callable[[Any], int]) -> None:
        object.__setattr__(self, "loader", loader)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "_agree", agree)
        object.__setattr__(self, "_rank", rank)
        object.__setattr__(self, "_batch_size", batch_size)
        #: The agreed share of each fetched batch, in fetch order; the part takes one per training step
        #: (None: an even step). Lightning fetches one batch ahead of the step on unsized loaders.
        object.__setattr__(self, "shares", collections.deque())
        object.__setattr__(self, "_stand_in", None)  # (batch,) this rank repeats once it has run out
        object.__setattr__(self, "_length", None)
        object.__setattr__(self, "_warned", False)
        object.__setattr__(self, "_live", None)  # this epoch's iterator
        object.__setattr__(self, "_resumed", None)  # where a loaded state left this rank (see _load_state_dict)

    # ---------------------------------------------------------------- the wrapped loader's attributes

    def __getattr__(self, name: str) -> Any:
        loader = object.__getattribute__(self, "loader")
        if name in ("state_dict", "load_state_dict") and hasattr(loader, name):
            # a resumable loader (StatefulDataLoader ...): its state, plus whether this rank had run out
            return getattr(self, f"_{name}")
        return getattr(loader, name)

    def _state_dict(self) -> dict[str, Any]:
        state = self.loader.state_dict()
        live = self._live
        ours = {"done_after": live.count if isinstance(live, _Agreeing) and live.exhausted else None,
                "step": live.step if isinstance(live, _Agreeing) else 0,
                "count": live.count if isinstance(live, _Agreeing) else 0}
        return {**state, STATE_KEY: ours} if isinstance(state, dict) else {"loader": state, STATE_KEY: ours}

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        ours = state.pop(STATE_KEY, None)
        if set(state) == {"loader"}:
            state = state["loader"]
        self.loader.load_state_dict(state)
        # A rank that had run out must stay out: a StatefulDataLoader loaded from the end of its pass starts
        # a new pass on the next iter().
        self._resumed = ours

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._own:
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    def __repr__(self) -> str:
        return f"AgreeingLoader({self.loader!r}, mode={self.mode!r})"

    # ---------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[Any]:
        self.shares.clear()
        resumed, self._resumed = self._resumed, None
        even = self._known_even()  # every rank, every epoch: the exchange pairs whatever this rank resumes
        live: _Even | _Agreeing
        if resumed is not None and resumed.get("done_after") is not None:
            live = _Agreeing(self, iter(()))  # this rank had run out before the checkpoint
            live.exhausted = True
        elif even:
            live = _Even(iter(self.loader), self.shares)
        else:
            live = _Agreeing(self, iter(self.loader))
        if isinstance(live, _Agreeing) and resumed is not None:
            live.count, live.step = int(resumed.get("count", 0)), int(resumed.get("step", 0))
        self._live = live
        return live

    def _known_even(self) -> bool:
        """One exchange at the epoch's start: every rank has the same length and a DistributedSampler
        (equal batches at every step), so no per-batch exchange is needed. Refreshes ``len``. (Also at the
        first epoch, though the wrap exchanged lengths: a loader's length may change in between, on one
        rank, and a decision made on stale rows would pass an uneven epoch through unchecked.)"""
        rows = _length_rows(self.loader, self._agree)
        if all(r[0] for r in rows):
            self._length = max(r[1] for r in rows)
        return all(r[0] and r[2] for r in rows) and len({r[1] for r in rows}) == 1


class SizedAgreeingLoader(AgreeingLoader):
    """An :class:`AgreeingLoader` over a loader with a length: its length is the longest rank's (every
    rank runs that many steps under ``"join"``), agreed when it was built and at each epoch's start."""

    def __len__(self) -> int:
        if self._length is None:
            return len(self.loader)
        return int(self._length)


def wrap_training_loader(loader: Any, mode: str, agree: Agree, rank: int, batch_size: Callable[[Any], int]) -> Any:
    """``loader`` wrapped in an :class:`AgreeingLoader`, or unchanged where the epoch-start batch count
    check covers it. Every rank calls this together (one exchange: every rank's length, if any).

    Wrapped: every loader under ``"join"`` (its length, where every rank has one, is the longest
    rank's); under ``"error"`` and ``"stop_together"`` a loader without a length on some rank (an
    ``IterableDataset``), whose ranks could otherwise run out at different batches unnoticed.

    Args:
        mode: ``"error"``, ``"stop_together"`` or ``"join"`` (see the module doc).
        agree: the exchange: this rank's record in, every rank's record out (rank order).
        batch_size: a batch's sample count (for the step's loss scale).
    """
    rows = _length_rows(loader, agree)
    sized = all(r[0] for r in rows)
    if mode != "join" and sized:
        return loader
    if sized:
        wrapped: AgreeingLoader = SizedAgreeingLoader(loader, mode, agree, rank, batch_size)
        wrapped._length = max(r[1] for r in rows)
        return wrapped
    return AgreeingLoader(loader, mode, agree, rank, batch_size)


def wrap_evaluation_loader(loader: Any, agree: Agree, rank: int, batch_size: Callable[[Any], int]) -> Any:
    """An evaluation ``loader`` under ``"join"``: wrapped where some rank's loader has no length (a stream, whose
    ranks may run out apart), so per-step collectives in the evaluation step are joined; unchanged otherwise
    (exact evaluation cuts map-style loaders into equal steps where it can). Every rank calls this together."""
    if all(r[0] for r in _length_rows(loader, agree)):
        return loader
    return AgreeingLoader(loader, "join", agree, rank, batch_size)


def _length_rows(loader: Any, agree: Agree) -> list[list[int]]:
    """Every rank's ``[has a length, the length or -1, has a DistributedSampler, 0]`` (one exchange)."""
    length = _sized_len(loader)
    return agree([int(length is not None), -1 if length is None else length, int(_distributed_sampler(loader)), 0])


class _Even:
    """The wrapped iterator, unchanged, on an epoch known to be even (an even share queued per batch)."""

    def __init__(self, inner: Iterator[Any], shares: collections.deque[StepShare | None]) -> None:
        self.inner, self.shares = inner, shares

    def __iter__(self) -> _Even:
        return self

    def __next__(self) -> Any:
        batch = next(self.inner)
        self.shares.append(None)
        return batch

    def __getattr__(self, name: str) -> Any:  # the wrapped iterator's own API (e.g. a StatefulDataLoader's)
        return getattr(self.inner, name)


class _Agreeing:
    """One epoch's iterator: one exchange per batch (see the module doc)."""

    def __init__(self, owner: AgreeingLoader, inner: Iterator[Any]) -> None:
        self.owner, self.inner = owner, inner
        self.count = 0  # real batches this rank yielded this epoch
        self.step = 0
        self.exhausted = False
        self.finished = False

    def __iter__(self) -> _Agreeing:
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __next__(self) -> Any:
        if self.finished:
            raise StopIteration
        owner = self.owner
        batch: Any = None
        if not self.exhausted:
            try:
                batch = next(self.inner)
            except StopIteration:
                self.exhausted = True
        has = not self.exhausted
        size = owner._batch_size(batch) if has else 0
        rows = owner._agree([int(has), size, self.count, int(not has and owner._stand_in is None)])
        haves = [bool(r[_HAS]) for r in rows]
        if not any(haves):
            self.finished = True
            raise StopIteration
        done_after = tuple(None if r[_HAS] else int(r[_COUNT]) for r in rows)
        share = StepShare(owner._rank, self.step, tuple(int(r[_SIZE]) for r in rows), done_after)
        if not all(haves):
            if owner.mode == "error":
                self.finished = True
                raise _uneven_error(share)
            if owner.mode == "stop_together":
                self.finished = True
                if not owner._warned:
                    owner._warned = True
                    log.warning("lightning_sync: %s while other ranks had more; every rank ends the epoch there "
                             "(uneven_batches='stop_together': the rest of their data is not trained on).",
                             share.describe())
                raise StopIteration
            if any(r[_NEEDS] for r in rows):
                self._lend_stand_in(rows, batch)
        self.step += 1
        owner.shares.append(share if share.applies else None)
        if has:
            self.count += 1
            owner._stand_in = (batch,)
            return batch
        assert owner._stand_in is not None
        return owner._stand_in[0]

    def _lend_stand_in(self, rows: list[list[int]], batch: Any) -> None:
        """A rank that ran out has no batch of its own to repeat (its shard was empty, or it resumed after
        running out): the first rank with data lends it one (one object broadcast)."""
        import torch.distributed as dist

        owner = self.owner
        src = next(r for r, row in enumerate(rows) if row[_HAS])
        sent = [batch if owner._rank == src else None]
        dist.broadcast_object_list(sent, src=src)
        if owner._stand_in is None:
            owner._stand_in = (sent[0],)


def _uneven_error(share: StepShare) -> UnevenTrainingError:
    shown = {r: ("ran out" if d is not None else "has more") for r, d in enumerate(share.done_after)}
    return UnevenTrainingError(
        f"ranks ran out of training data at different batches: {share.describe()}, while "
        f"{', '.join(f'rank {r}' for r, d in enumerate(share.done_after) if d is None)} still had data at batch "
        f"{share.step} of this epoch ({format_ranks(shown)}). Every rank raises this error instead of waiting in DDP's "
        "gradient all-reduce. Pass SyncDDPStrategy(uneven_batches='join') to train on every rank's data (a rank "
        "that ran out joins the others' collectives with a zero contribution), uneven_batches='stop_together' to "
        "end the epoch on every rank when the first runs out, or give every rank the same number of batches "
        "(a DistributedSampler; for an IterableDataset, equal shards).",
        shown,
    )


def _sized_len(loader: Any) -> int | None:
    if not isinstance(loader, Sized):
        return None
    try:
        return len(loader)
    except (TypeError, NotImplementedError):
        return None


def _distributed_sampler(loader: Any) -> bool:
    sampler = getattr(loader, "sampler", None)
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return isinstance(sampler, DistributedSampler) or isinstance(inner, DistributedSampler)
