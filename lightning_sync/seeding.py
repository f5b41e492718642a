"""Seed lineage: one root seed agreed by every rank, and the streams derived from it.

What must be equal across ranks and what must differ:

* the **root seed** is rank 0's and identical everywhere: samplers shuffle with it (disjoint shards
  that cover the data set) and model initialisation runs under it (identical replicas);
* each rank's **global RNGs** (torch, numpy, random) are then re-seeded from
  ``derive_seed(root, "rank", global_rank)``, so dropout, noise and augmentation differ across ranks;
* each **data-loader worker** is seeded from ``derive_seed(root, "worker", global_rank, worker_id,
  base)``, where ``base`` is the per-epoch seed the loader draws from its rank's stream, so workers
  differ across ranks, workers and epochs, and numpy/random are seeded too (torch leaves numpy
  identical in every forked worker).

The same root seed reproduces the run bit for bit. Per-rank RNG states go into checkpoints and are
restored on resume, so a resumed run continues the same streams.

Only ``torch`` and ``lightning_sync.collectives`` are used here (no Lightning import).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_sync.collectives import MAX_SEED, broadcast_seed, gather_objects, is_distributed

__all__ = ["SeedLineage", "derive_key64", "derive_seed", "derive_seeds", "seed_everything_local", "WorkerSeeder"]

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "lightning_sync"


def derive_seed(root: int, *path: int | str) -> int:
    """A seed in ``[0, 2**32 - 1]`` determined by ``root`` and a path such as ``("rank", 3)``.

    A cryptographic hash, so neighbouring ranks or workers get unrelated streams (``root + rank``
    would make rank 1 of seed 41 replay rank 0 of seed 42).
    """
    return derive_key64(root, *path) & MAX_SEED


def derive_key64(root: int, *path: int | str) -> int:
    """The 64-bit hash ``derive_seed`` keeps the low 32 bits of (``[0, 2**64 - 1]``): a key for a counter-based
    stream, where 32 bits would leave too few distinct streams."""
    text = ":".join([str(root), *map(str, path)]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def derive_seeds(root: int, *path: int | str) -> Callable[[int | str], int]:
    """``derive_seed(root, *path, last)`` as a function of ``last``, the common prefix hashed once (0.45 us a seed
    instead of 1: the per-sample seeds of a batch)."""
    prefix = hashlib.blake2b(":".join([str(root), *map(str, path), ""]).encode(), digest_size=8)

    def seed(last: int | str) -> int:
        h = prefix.copy()
        h.update(str(last).encode())
        return int.from_bytes(h.digest(), "little") & MAX_SEED

    return seed


def seed_everything_local(seed: int) -> None:
    """Seed this process's torch (CPU and CUDA), numpy and ``random`` global generators."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # numpy is optional for torch
        pass


def _collect_rng_state(compact: bool = False) -> dict[str, Any]:
    """This process's RNG states: torch (CPU; CUDA too unless ``compact``), numpy and ``random``.

    The one encoding of an RNG state in the package. Default: tensors and plain Python values,
    loadable from a checkpoint with ``weights_only=True``. ``compact``: bytes and lists (~11 KB
    pickled, ~0.1 ms), for the worker states torchdata snapshots inside data-loader workers, where a
    tensor would travel through shared memory with every snapshot.
    """
    version, internal, gauss = random.getstate()
    cpu = torch.get_rng_state()
    state: dict[str, Any] = {"torch": cpu.numpy().tobytes() if compact else cpu,
                             "python": [version, list(internal), gauss]}
    if not compact and torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        encoded: Any = (np.asarray(keys, dtype=np.uint32).tobytes() if compact
                        else torch.from_numpy(np.asarray(keys, dtype=np.int64)))
        state["numpy"] = [kind, encoded, int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return state


def _restore_rng_state(state: dict[str, Any]) -> None:
    """Set this process's RNG states from :func:`_collect_rng_state`'s result (either encoding)."""
    cpu = state["torch"]
    torch.set_rng_state(torch.frombuffer(bytearray(cpu), dtype=torch.uint8) if isinstance(cpu, (bytes, bytearray))
                        else cpu)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        words = (np.frombuffer(keys, dtype=np.uint32).copy() if isinstance(keys, (bytes, bytearray))
                 else keys.numpy().astype(np.uint32))
        np.random.set_state((kind, words, pos, has_gauss, cached))


class WorkerSeeder:
    """``worker_init_fn`` that seeds a data-loader worker from ``(root, rank, worker id, base)``.

    ``root`` is a seed, or a :class:`SeedLineage` whose root is read when the worker starts: a resumed
    run adopts the checkpoint's root after Lightning has set up its loaders, and workers started
    after that (each epoch's, without ``persistent_workers``) must use it. Picklable, so it works with
    ``spawn``/``forkserver`` worker start methods. A user's own ``worker_init_fn`` is never replaced.
    """

    def __init__(self, root: int | SeedLineage, rank: int) -> None:
        self._root = root
        self.rank = rank

    @property
    def root(self) -> int:
        return self._root.root if isinstance(self._root, SeedLineage) else self._root

    def __call__(self, worker_id: int) -> None:
        # torch gives worker i the seed base + i, with base drawn per epoch from the rank's stream.
        base = torch.initial_seed() - worker_id
        seed_everything_local(derive_seed(self.root, "worker", self.rank, worker_id, base))


@dataclass
class SeedLineage:
    """The root seed of a run and how every stream derives from it (same on every rank).

    Attributes:
        root: the root seed, rank 0's.
        world_size: number of ranks.
        origin: where the root came from (``"argument"``, ``"seed_everything"`` or ``"entropy"``).
        local_seeds: the seed each rank was started with (``None``: none), for the log.
    """

    root: int
    world_size: int
    origin: str
    local_seeds: list[int | None] = field(default_factory=list)
    _pending_rng: dict[str, Any] | None = field(default=None, repr=False)
    _resumed_at: int | None = field(default=None, repr=False)  # global step of a checkpoint from another world size
    _streams_of_another: bool = field(default=False, repr=False)  # ... or holding another process's RNG states

    @property
    def rank_seeds(self) -> list[int]:
        """The seed each rank's global RNGs got after model set-up, ranks ``0 .. world_size - 1`` (after a resume
        on another world size, the new streams'; where the RNG states continue from a checkpoint, the seeds the
        run started with). Where several process groups train one model (replica groups), :meth:`stream_seed`
        of a stream rank."""
        return [self.stream_seed(r) for r in range(self.world_size)]

    def stream_seed(self, stream_rank: int) -> int:
        """The seed the global RNGs of stream rank ``stream_rank`` got after model set-up (see :attr:`rank_seeds`)."""
        if self._resumed_at is not None:
            return derive_seed(self.root, "rank", stream_rank, "resumed", self._resumed_at)
        return derive_seed(self.root, "rank", stream_rank)

    # ---------------------------------------------------------------- the three moments of a run

    @classmethod
    def agree(cls, seed: int | None) -> SeedLineage:
        """Make every rank adopt rank 0's seed (a collective when distributed; call on every rank).

        ``seed`` is this rank's configured seed; ``None`` falls back to ``PL_GLOBAL_SEED`` (set by
        ``seed_everything``), then to fresh OS entropy drawn on rank 0. Nothing is written to
        ``os.environ``: the strategy hands the root to Lightning's samplers itself
        (``distributed_sampler_kwargs``).
        """
        env = os.environ.get("PL_GLOBAL_SEED")
        local = seed if seed is not None else (int(env) if env is not None and env.lstrip("-").isdigit() else None)
        if seed is not None:
            origin = "argument"
        elif local is None:
            origin = "entropy"
        else:
            origin = "seed_everything"
        root = broadcast_seed(local)
        if is_distributed():
            info = gather_objects((local, origin))
            assert info is not None
            local_seeds = [s for s, _ in info]
            origin = info[0][1]
            world = dist.get_world_size()
        else:
            local_seeds, world = [local], 1
        lineage = cls(root=root, world_size=world, origin=origin, local_seeds=local_seeds)
        seed_everything_local(root)  # model initialisation runs under the root seed on every rank
        return lineage

    def seed_rank_streams(self, rank: int) -> None:
        """Switch this rank's global RNGs to its own stream (or to the state restored from a checkpoint)."""
        if self._pending_rng is not None:
            _restore_rng_state(self._pending_rng)
            self._pending_rng = None
        else:  # (after a resume on another world size: new streams, not the run's first ones again)
            seed_everything_local(self.stream_seed(rank))

    def describe(self, first_stream_rank: int = 0) -> str:
        """One log line: the root, where it came from, and each rank's derived seed (``first_stream_rank``: the
        stream rank of this process group's rank 0, where several process groups train one model: replica
        groups)."""
        differing = [f"rank {first_stream_rank + r} {s}" for r, s in enumerate(self.local_seeds)
                     if s != self.local_seeds[0]]
        note = (f"; ranks started with other seeds ({', '.join(differing)}) now follow rank 0"
                if differing else "")
        ranks = range(first_stream_rank, first_stream_rank + self.world_size)
        if self._pending_rng is not None:
            rank_part = "each rank's RNG state continues from the checkpoint"
        elif self._resumed_at is not None:
            why = ("recovered from another process's state" if self._streams_of_another
                   else "another world size wrote the checkpoint")
            rank_part = ", ".join(f"rank {r} {self.stream_seed(r)}" for r in ranks) + f" (new: {why})"
        else:
            rank_part = ", ".join(f"rank {r} {self.stream_seed(r)}" for r in ranks)
        return (f"lightning_sync: root seed {self.root} (rank 0's, from {self.origin}){note}. "
                f"Samplers and model init use the root; per-rank streams: {rank_part}; "
                f"workers: derive_seed(root, 'worker', rank, worker_id, epoch base).")

    # ---------------------------------------------------------------- checkpoints

    def checkpoint_state(self, extra: Any = None, global_step: int | None = None,
                         own_rank: int | None = None) -> dict[str, Any] | None:
        """Every rank's RNG state (and ``extra``), gathered to rank 0 (a collective: call on every rank).

        Returns the dict to store under ``checkpoint["lightning_sync"]`` on rank 0, None elsewhere;
        ``extra`` of every rank lands in its ``"loader_states"`` list (one gather for both). ``own_rank``: no
        gather; that rank's state alone, in its slot of the per-rank lists (the others' None), for a checkpoint
        that goes to that rank of another process group (``ddp_sync_ft``'s recovery from a live replica group).
        """
        mine = self.rank_state(extra)
        if own_rank is None:
            gathered = gather_objects(mine, dst=0) if is_distributed() else [mine]
            if gathered is None:
                return None
        else:
            gathered = [mine if r == own_rank else {"rng_state": None, "loader_states": None}
                        for r in range(self.world_size)]
        state = self.shared_state(global_step)
        state["rng_states"] = [g["rng_state"] for g in gathered]
        if extra is not None:
            state["loader_states"] = [g["loader_states"] for g in gathered]
        return state

    def shared_state(self, global_step: int | None = None) -> dict[str, Any]:
        """What every rank's checkpoint entry shares: the root seed, the world size, the global step."""
        state: dict[str, Any] = {"root_seed": self.root, "world_size": self.world_size}
        if global_step is not None:
            state["global_step"] = global_step
        return state

    @staticmethod
    def rank_state(extra: Any = None) -> dict[str, Any]:
        """This rank's part of the entry: its RNG state and ``extra`` (its loader states); no collective."""
        return {"rng_state": _collect_rng_state(), "loader_states": extra}

    def pending_rng_state(self) -> dict[str, Any] | None:
        """The RNG state queued from a checkpoint for this rank (None: fresh streams)."""
        return self._pending_rng

    def load_checkpoint_state(self, state: dict[str, Any] | None, rank: int) -> None:
        """Adopt a checkpoint's root seed and queue this rank's RNG state for :meth:`seed_rank_streams`."""
        if not state:
            return
        if state["root_seed"] != self.root:  # samplers and RNG streams continue where they stopped
            self.root = int(state["root_seed"])
            self.origin = "the checkpoint being resumed"
            self.local_seeds = [self.root] * len(self.local_seeds)  # the agreed one is replaced on every rank
        states = state.get("rng_states") or []
        self._streams_of_another = bool(state.get("new_streams"))
        if state.get("new_streams"):  # another process's state (a live replica group's): streams of this rank's own
            self._resumed_at = int(state.get("global_step") or 0)
        elif state.get("world_size") == self.world_size and rank < len(states):
            self._pending_rng = states[rank]
        else:
            self._resumed_at = int(state.get("global_step") or 0)
            if rank == 0:
                log.warning("lightning_sync: the checkpoint was written by %s ranks, this run has %s; each rank's "
                            "own RNG stream (what the training step draws itself; samples loaded and dropout under "
                            "world_size_invariant=True are keyed by the sample instead) starts anew as "
                            "derive_seed(root %s, 'rank', r, 'resumed', step %s).", state.get("world_size"),
                            self.world_size, self.root, self._resumed_at)
