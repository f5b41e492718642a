"""``UnevenBatchPart``: ranks with different numbers of training batches are caught at epoch start."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_sync.parts.base import Part

__all__ = ["UnevenBatchPart"]


class UnevenBatchPart(Part):
    """``"error"``: a clear error at epoch start instead of a hang in the gradient all-reduce;
    ``"stop_together"``: every rank's epoch ends when the shortest rank runs out."""

    def __init__(self, uneven_batches: str) -> None:
        self.uneven_batches = uneven_batches

    def callbacks(self, strategy: Any) -> Sequence[Any]:
        from lightning_sync.callbacks.resume import ResumeEpochLength
        from lightning_sync.strategy_checks import UnevenBatchCheck

        return (UnevenBatchCheck(self.uneven_batches), ResumeEpochLength())
