"""lightning_sync: explicit, checked data synchronisation for PyTorch Lightning DDP.

``import lightning_sync`` registers the strategy names ``"ddp_sync"``, ``"ddp_sync_spawn"``, ``"model_parallel_sync"``,
``"ddp_sync_notebook"`` (Jupyter), ``"ddp_sync_ft"`` and ``"model_parallel_sync_ft"`` (replica groups on torchft:
``lightning_sync.ft``). ``lightning_sync.pl`` is the same API for the ``pytorch_lightning``
package (its classes subclass ``pytorch_lightning``'s; ``lightning_sync._namespace`` builds it from
these files); ``import lightning_sync`` registers the names in ``pytorch_lightning``'s registry too (before
or after ``pytorch_lightning`` is imported), and the first ``pytorch_lightning.Trainer`` that asks for one
builds ``lightning_sync.pl``.
"""

from lightning.pytorch.strategies import StrategyRegistry as _strategy_registry

from lightning_sync import collectives, testing
from lightning_sync.batchnorm import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from lightning_sync.callbacks import (
    ParameterConsistencyCheck,
    PortableSyncBatchNorm,
    PredictionWriter,
    SeedBroadcast,
    SyncBatchNormConversion,
    ValidationGather,
)
from lightning_sync.errors import (
    CollectiveMismatchError,
    LightningSyncError,
    ParameterDivergenceError,
    RankMismatchError,
    UnevenEvaluationError,
    UnevenTrainingError,
)
from lightning_sync.guard.core import CollectiveGuard
from lightning_sync.seeding import SeedLineage, derive_seed
from lightning_sync.model_parallel import SyncModelParallelStrategy, register as _register_model_parallel
from lightning_sync.strategy import SyncDDPStrategy, register as _register
from lightning_sync.ft.strategy import (FaultTolerantDDPStrategy, FaultTolerantModelParallelStrategy,
                                        register as _register_ft)

_register(_strategy_registry)
_register_model_parallel(_strategy_registry)
_register_ft(_strategy_registry)

__version__ = "0.1.0"

from lightning_sync import _namespace  # noqa: E402  (after the API it re-exports)

_namespace.install()  # (pytorch_lightning's registry gets the names too, whichever is imported first)

__all__ = [
    "CollectiveGuard",
    "CollectiveMismatchError",
    "FaultTolerantDDPStrategy",
    "FaultTolerantModelParallelStrategy",
    "LightningSyncError",
    "ParameterConsistencyCheck",
    "ParameterDivergenceError",
    "PortableSyncBatchNorm",
    "PredictionWriter",
    "RankMismatchError",
    "SeedBroadcast",
    "SeedLineage",
    "SyncBatchNorm",
    "SyncBatchNormConversion",
    "SyncDDPStrategy",
    "SyncModelParallelStrategy",
    "UnevenEvaluationError",
    "UnevenTrainingError",
    "ValidationGather",
    "collectives",
    "convert_sync_batchnorm",
    "derive_seed",
    "revert_sync_batchnorm",
    "testing",
]
