"""``CheckpointStatePart``: every rank's RNG state and loader position in ``checkpoint["lightning_sync"]``."""

from __future__ import annotations

from typing import Any

from lightning_sync.parts.base import Part
from lightning_sync.parts.data import ResumableDataPart
from lightning_sync.parts.seed import SeedLineagePart
from lightning_sync.resume import ResumeHooks
from lightning_sync.seeding import CHECKPOINT_KEY

__all__ = ["CheckpointStatePart"]


class CheckpointStatePart(Part):
    """Owns the checkpoint's ``"lightning_sync"`` entry: the root seed, the world size, the global step,
    and per rank its RNG state (``SeedLineagePart``) and loader position (``ResumableDataPart``),
    gathered to rank 0 in one collective at every save; on load, hands them back to those parts."""

    def on_save_checkpoint(self, strategy: Any, checkpoint: dict[str, Any]) -> None:
        seed = strategy.part(SeedLineagePart)
        if seed is None or seed.lineage is None:
            return
        data = strategy.part(ResumableDataPart)
        payload = ResumeHooks.loader_payload(checkpoint) if data is not None else None
        state = seed.lineage.checkpoint_state(payload, checkpoint.get("global_step"))
        if state is not None:
            checkpoint[CHECKPOINT_KEY] = state

    def on_load_checkpoint(self, strategy: Any, checkpoint: dict[str, Any], fitting: bool) -> None:
        seed = strategy.part(SeedLineagePart)
        if seed is not None:
            seed.pending_state = checkpoint.get(CHECKPOINT_KEY)
