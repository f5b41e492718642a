"""``default_parts``: every part, configured from a sync strategy's arguments."""

from __future__ import annotations

from lightning_sync.collectives import validate_seed
from lightning_sync.guard.core import CollectiveGuard
from lightning_sync.parts.base import Part
from lightning_sync.parts.checkpoint import CheckpointStatePart
from lightning_sync.parts.data import ResumableDataPart
from lightning_sync.parts.evaluation import ExactEvalPart
from lightning_sync.parts.guard import GuardPart
from lightning_sync.parts.invariant import WorldSizeInvariantPart
from lightning_sync.parts.requeue import RequeuePart
from lightning_sync.parts.seed import SeedLineagePart
from lightning_sync.parts.teardown import TeardownPart
from lightning_sync.parts.uneven import UNEVEN_MODES, UnevenBatchPart

__all__ = ["default_parts"]


def default_parts(*, owner: str, seed: int | None = None, guard: bool | CollectiveGuard = True,
                  guard_timeout: float | None = None, uneven_batches: str = "error", resume: str | None = None,
                  exact_eval: bool = True, world_size_invariant: bool = False) -> list[Part]:
    """Every part, configured from the strategy's arguments (``SyncDDPStrategy``'s, which documents them).

    Raises:
        ValueError, TypeError: a bad argument, named as ``owner(name=...)`` (the strategy's class).
    """
    validate_seed(seed, f"{owner}(seed=...)")
    if resume is not None and not isinstance(resume, str):
        raise TypeError(f"{owner}(resume={resume!r}): use None, 'auto' or a directory path.")
    if uneven_batches not in UNEVEN_MODES:
        raise ValueError(f"{owner}(uneven_batches={uneven_batches!r}): use 'error', 'stop_together' or 'join'.")
    if not isinstance(world_size_invariant, bool):
        raise TypeError(f"{owner}(world_size_invariant={world_size_invariant!r}): use True or False.")
    parts: list[Part] = []
    if guard:
        chosen = guard if isinstance(guard, CollectiveGuard) else CollectiveGuard()
        if guard_timeout is not None:
            # hang_timeout follows timeout unless the user set it on their own guard
            chosen.timeout = CollectiveGuard(timeout=guard_timeout).timeout
        parts.append(GuardPart(chosen))
    if exact_eval:
        parts.append(ExactEvalPart())
    # CheckpointStatePart before ResumableDataPart: on load it puts each rank's saved state where that part
    # reads it; UnevenBatchPart after ResumableDataPart: it wraps the training loader that part made resumable
    # WorldSizeInvariantPart after CheckpointStatePart (it adds to the entry that part writes) and before
    # ResumableDataPart (it builds the training loader that part would otherwise make resumable)
    parts += [SeedLineagePart(seed), CheckpointStatePart()]
    if world_size_invariant:
        parts.append(WorldSizeInvariantPart())
    parts += [ResumableDataPart(resume), UnevenBatchPart(uneven_batches, planned=world_size_invariant), RequeuePart(),
              TeardownPart()]
    return parts


