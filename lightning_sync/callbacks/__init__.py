"""Callbacks that bring lightning_sync's guarantees to any strategy, Lightning's own "ddp" included."""

from lightning_sync.callbacks.batchnorm import PortableSyncBatchNorm, SyncBatchNormConversion
from lightning_sync.callbacks.consistency import ParameterConsistencyCheck
from lightning_sync.callbacks.gather import ValidationGather
from lightning_sync.callbacks.predict import PredictionWriter
from lightning_sync.callbacks.seed import SeedBroadcast

__all__ = [
    "ParameterConsistencyCheck",
    "PortableSyncBatchNorm",
    "PredictionWriter",
    "SeedBroadcast",
    "SyncBatchNormConversion",
    "ValidationGather",
]
