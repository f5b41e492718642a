"""``CheckpointStatePart``: every rank's RNG state and loader position in ``checkpoint["lightning_sync"]``.

A one-file checkpoint (``ddp_sync``) holds every rank's state, gathered to rank 0 at each save. A
sharded checkpoint (a directory every rank writes, as ``SyncModelParallelStrategy``'s DCP checkpoints)
holds each rank's state in a file of that rank's own, ``<checkpoint>/lightning_sync/rank<r>-of-<w>.pt``,
written by that rank: no gather, nothing on rank 0 that grows with the number of ranks.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_sync.checkpoint_io import (RANK_FILES, atomic_save, expect_rank_files, invalidate_sharded_checkpoint,
                                         rank_file)
from lightning_sync.errors import ResumeError
from lightning_sync.parts.base import Part
from lightning_sync.parts.data import ResumableDataPart
from lightning_sync.parts.invariant import STATE_KEY as INVARIANT_KEY
from lightning_sync.parts.invariant import WorldSizeInvariantPart
from lightning_sync.parts.seed import SeedLineagePart
from lightning_sync.resume.checkpoint import ResumeHooks, stash_loader_states
from lightning_sync.seeding import CHECKPOINT_KEY

__all__ = ["CheckpointStatePart"]


class CheckpointStatePart(Part):
    """Owns the checkpoint's ``"lightning_sync"`` entry: the root seed, the world size, the global step,
    and per rank its RNG state (``SeedLineagePart``) and loader position (``ResumableDataPart``); on
    load, hands them back to those parts. One file: gathered to rank 0 in one collective at every save.
    A sharded checkpoint: each rank writes its own file into the checkpoint's directory."""

    def __init__(self) -> None:
        self._to_write: dict[str, Any] | None = None

    def on_save_checkpoint(self, strategy: Any, checkpoint: dict[str, Any], directory: Path | None) -> None:
        self._to_write = None
        if directory is not None and strategy.global_rank == 0:
            # before the save's first collective: a save over an existing sharded checkpoint that is cut
            # short must not leave it looking complete (its completion marks and rank files go first)
            invalidate_sharded_checkpoint(directory)
        seed = strategy.part(SeedLineagePart)
        if seed is None or seed.lineage is None:
            return
        data = strategy.part(ResumableDataPart)
        payload = ResumeHooks.loader_payload(checkpoint) if data is not None else None
        step = checkpoint.get("global_step")
        if directory is not None:
            checkpoint[CHECKPOINT_KEY] = {**seed.lineage.shared_state(step), "rank_files": RANK_FILES}
            stash_loader_states(checkpoint, checkpoint[CHECKPOINT_KEY])
            self._to_write = {**seed.lineage.rank_state(payload), "global_step": step}
            if strategy.global_rank == 0 and not directory.is_file():
                # before the save's first collective: the directory now says which rank files complete it
                expect_rank_files(directory, strategy.world_size)
            return
        state = seed.lineage.checkpoint_state(payload, step)
        if state is not None:
            checkpoint[CHECKPOINT_KEY] = state
            stash_loader_states(checkpoint, state)  # Lightning's own strategies can resume the file too

    def own_state(self, strategy: Any, checkpoint: dict[str, Any]) -> None:
        """The entry of a one-file checkpoint for this rank alone, without the gather: its RNG state and loader
        position in its own slot of the per-rank lists (the others' slots None). For a checkpoint that goes to one
        process, rank ``r``'s to rank ``r`` (``ddp_sync_ft``'s recovery from a live replica group), where a
        collective is out of place (every step, or another thread)."""
        seed = strategy.part(SeedLineagePart)
        if seed is None or seed.lineage is None:
            return
        payload = ResumeHooks.loader_payload(checkpoint) if strategy.part(ResumableDataPart) is not None else None
        state = seed.lineage.checkpoint_state(payload, checkpoint.get("global_step"), own_rank=strategy.global_rank)
        assert state is not None  # (no gather: every rank has its entry)
        checkpoint[CHECKPOINT_KEY] = state
        stash_loader_states(checkpoint, state)

    def after_save_checkpoint(self, strategy: Any, directory: Path | None) -> None:
        # After the strategy's save (its path broadcast came after rank 0 cleared the directory): each rank
        # writes its own file.
        mine, self._to_write = self._to_write, None
        if directory is not None and mine is not None and directory.is_dir():
            atomic_save(mine, rank_file(directory, strategy.global_rank, strategy.world_size))

    def on_load_checkpoint(self, strategy: Any, checkpoint: dict[str, Any], fitting: bool,
                           directory: Path | None) -> None:
        state = checkpoint.get(CHECKPOINT_KEY)
        if (fitting and isinstance(state, dict) and state.get("rank_files")
                and state.get("world_size") == strategy.world_size):  # validate/test/predict need none of it
            self._read_own(state, directory, strategy.global_rank, strategy.world_size)
        seed = strategy.part(SeedLineagePart)
        if seed is not None:
            seed.pending_state = state
        plan = state.get(INVARIANT_KEY) if isinstance(state, dict) else None
        if (fitting and isinstance(plan, dict) and int(plan.get("batches", 0)) > 0
                and strategy.part(WorldSizeInvariantPart) is None and strategy.global_rank == 0):
            warnings.warn(
                f"resume: the checkpoint was written with world_size_invariant=True, after {plan['batches']} global "
                f"batches of {plan['batch_size']} in epoch {plan['epoch']}; this run has world_size_invariant=False, "
                "whose per-rank loader cannot take that position: Lightning resumes the epoch inexactly (samples "
                "seen twice or not at all). Pass world_size_invariant=True to continue the same global batches.",
                stacklevel=2)

    @staticmethod
    def _read_own(state: dict[str, Any], directory: Path | None, rank: int, world_size: int) -> None:
        """Put this rank's file into the entry's per-rank lists (the other ranks' slots stay None)."""
        path = rank_file(directory, rank, world_size) if directory is not None else None
        if path is None or not path.is_file():
            raise ResumeError(
                f"resume: the checkpoint keeps each rank's RNG state and loader position in a file of its own, and "
                f"rank {rank}'s is missing ({path or 'the checkpoint is not a directory'}): the save was cut short, "
                "or the directory was copied in part. Resume from a complete checkpoint (every "
                f"{RANK_FILES}/rank<r>-of-{world_size}.pt present), or from this one with another world size (the "
                "rest of the epoch is dealt out again, without the per-rank states).")
        own = torch.load(path, map_location="cpu", weights_only=True)
        if own.get("global_step") != state.get("global_step"):
            raise ResumeError(
                f"resume: rank {rank}'s state file {path} was written at global step {own.get('global_step')}, the "
                f"checkpoint at step {state.get('global_step')}: it belongs to another save (the ranks saved to "
                "different paths, or the directory was assembled from two saves). Resume from a checkpoint written by "
                "one save.")
        rng_states: list[Any] = [None] * world_size
        rng_states[rank] = own["rng_state"]
        state["rng_states"] = rng_states
        if own.get("loader_states") is not None:
            loader_states: list[Any] = [None] * world_size
            loader_states[rank] = own["loader_states"]
            state["loader_states"] = loader_states
