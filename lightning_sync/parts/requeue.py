"""``RequeuePart``: SLURM's requeue signal and Lightning's SIGTERM flag, met at a training step boundary."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_sync.parts.base import Part
from lightning_sync.preemption import DeferredRequeue

__all__ = ["RequeuePart"]


class RequeuePart(Part):
    """Replaces Lightning's per-step SIGTERM broadcast in every multi-rank fit, and under SLURM saves
    the requeue checkpoint at a step every rank agreed on (``lightning_sync.preemption``)."""

    def __init__(self) -> None:
        self.requeue = DeferredRequeue()

    def callbacks(self, strategy: Any) -> Sequence[Any]:
        return (self.requeue,)

    def run_stage_started(self, strategy: Any, trainer: Any) -> None:
        # Lightning registered its signal handlers just before: in fit, SLURM's requeue signal waits
        # for a training step boundary from here on, through the sanity check and validation too
        self.requeue.install(trainer)

    def before_teardown(self, strategy: Any) -> None:
        self.requeue.uninstall()
