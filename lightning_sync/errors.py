"""The exceptions lightning_sync raises when ranks disagree.

Bad arguments raise the builtin ``ValueError``/``TypeError``; the classes here are for the
distributed failures: every rank can see every rank's value, so every rank raises the same error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "CollectiveMismatchError",
    "LightningSyncError",
    "ParameterDivergenceError",
    "RankMismatchError",
    "UnevenEvaluationError",
    "UnevenTrainingError",
    "format_ranks",
]


def format_ranks(values: Mapping[int, Any] | Sequence[Any]) -> str:
    """``{0: a, 1: b}`` or ``[a, b]`` -> ``"rank 0 a, rank 1 b"``."""
    items = values.items() if isinstance(values, Mapping) else enumerate(values)
    return ", ".join(f"rank {rank} {value}" for rank, value in items)


class LightningSyncError(RuntimeError):
    """Base class of every lightning_sync error about distributed state.

    Attributes:
        backend_error: where the guard explains a collective that failed in the backend (gloo's "Connection closed
            by peer", NCCL's abort), that backend's exception (``None`` otherwise). It is kept here rather than as
            the exception's ``__cause__`` so that a failure prints one traceback, not two.
    """

    backend_error: BaseException | None = None


class RankMismatchError(LightningSyncError):
    """Ranks passed incompatible values (dtype, shape, src, structure) to the same collective.

    Attributes:
        values: each rank's value, keyed by global rank, as shown in the message.
    """

    def __init__(self, message: str, values: Mapping[int, Any] | None = None) -> None:
        super().__init__(message)
        self.values: dict[int, Any] = dict(values or {})


class CollectiveMismatchError(RankMismatchError):
    """Ranks entered different collectives, or one rank never arrived: the program would hang."""


class ParameterDivergenceError(LightningSyncError):
    """Model replicas hold different parameter or buffer values on different ranks.

    Attributes:
        name: the first diverging tensor.
        values: each rank's checksum of it, keyed by global rank.
    """

    def __init__(self, message: str, name: str = "", values: Mapping[int, Any] | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.values: dict[int, Any] = dict(values or {})


class UnevenEvaluationError(RankMismatchError):
    """Exact evaluation cannot give every rank the same number of steps, and something needed it.

    Raised on every rank at once (each knows every rank's step count): by a per-step collective in
    an evaluation step when step counts differ, or before the loop when a rank would get no sample.
    """


class UnevenTrainingError(RankMismatchError):
    """Ranks ran out of training data at different batches, and the run cannot carry on as configured.

    Raised on every rank at once (each rank's loader knows every rank's batch count, batch by
    batch): with ``uneven_batches="error"`` when the first rank runs out while others have data, and
    under ``uneven_batches="join"`` by a collective of the user's own in ``training_step`` while a rank
    that ran out runs stand-in steps (its data would be counted twice).
    """


class ResumeError(LightningSyncError):
    """A checkpoint cannot resume this run as configured (data, batch size, sampler, or a damaged file).

    Raised before any training step; no checkpoint is changed or deleted.
    """
