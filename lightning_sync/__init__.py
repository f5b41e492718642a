"""lightning_sync: explicit, checked data synchronisation for PyTorch Lightning DDP."""

from lightning_sync import collectives
from lightning_sync.errors import (
    CollectiveMismatchError,
    LightningSyncError,
    ParameterDivergenceError,
    RankMismatchError,
)

__version__ = "0.1.0"

__all__ = [
    "CollectiveMismatchError",
    "LightningSyncError",
    "ParameterDivergenceError",
    "RankMismatchError",
    "collectives",
]
