"""pytest plugin: Lightning's registry name ``"ddp"`` served by ``SyncDDPStrategy``.

Used by ``tests/lightning_suite/run.sh`` to run Lightning's own DDP tests against ``ddp_sync``
(see docs/compat.md). Loaded with ``-p lsync_as_ddp`` (this folder on ``PYTHONPATH``); Lightning's
test files are never copied here.
"""

from __future__ import annotations

from typing import Any


def pytest_configure(config: Any) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_sync import SyncDDPStrategy

    StrategyRegistry.register("ddp", SyncDDPStrategy, description="ddp served by lightning_sync.SyncDDPStrategy",
                              override=True, start_method="popen")
    # Lightning's launcher re-runs `python -m pytest ...` for rank 1 (standalone tests): it loads
    # this plugin too, so both ranks use the same strategy.


def _serve_every_ddp_name() -> None:
    """LSYNC_AS_DDP=all: every DDP registry name and the DDPStrategy class itself served by SyncDDPStrategy
    (tests that build ``DDPStrategy(...)`` directly import it from ``lightning.pytorch.strategies``)."""
    import lightning.pytorch.strategies as strategies
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_sync import SyncDDPStrategy

    for name in [n for n in StrategyRegistry.available_strategies() if n.startswith("ddp") and "sync" not in n]:
        entry = StrategyRegistry[name]
        if entry["strategy"] is strategies.DDPStrategy:
            StrategyRegistry.register(name, SyncDDPStrategy, description=f"{name} served by SyncDDPStrategy",
                                      override=True, **entry["init_params"])
    strategies.DDPStrategy = SyncDDPStrategy  # type: ignore[misc]


def _serve_model_parallel() -> None:
    """LSYNC_AS_MODEL_PARALLEL=1: ``ModelParallelStrategy`` (the class and the registry name) served by
    ``SyncModelParallelStrategy``."""
    import lightning.pytorch.strategies as strategies
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_sync import SyncModelParallelStrategy

    if "model_parallel" in StrategyRegistry:
        StrategyRegistry.register("model_parallel", SyncModelParallelStrategy, override=True,
                                  description="model_parallel served by SyncModelParallelStrategy")
    strategies.ModelParallelStrategy = SyncModelParallelStrategy  # type: ignore[misc]


def pytest_sessionstart(session: Any) -> None:
    import os

    if os.environ.get("LSYNC_AS_DDP") == "all":
        _serve_every_ddp_name()
    if os.environ.get("LSYNC_AS_MODEL_PARALLEL") == "1":
        _serve_model_parallel()
