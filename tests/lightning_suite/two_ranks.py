"""pytest plugin: every ``lightning.pytorch.Trainer`` a peer's test builds runs on 2 CPU ranks.

``LSYNC_TWO_RANKS_STRATEGY`` names the strategy (``ddp`` or ``ddp_sync``). Used by
``tests/lightning_suite/torchmetrics.sh`` to run torchmetrics' Lightning integration tests, which
build ``Trainer()`` for one process, on two (docs/compat.md). Lightning's launcher re-runs the pytest
command for rank 1, so each test runs in a pytest process of its own. Nothing of theirs is copied.
"""

from __future__ import annotations

import os
from typing import Any


def pytest_configure(config: Any) -> None:
    import lightning.pytorch as pl

    import lightning_sync  # noqa: F401  (registers ddp_sync)

    strategy = os.environ.get("LSYNC_TWO_RANKS_STRATEGY", "ddp")
    init = pl.Trainer.__init__
    if getattr(init, "_lsync_two_ranks", False):
        return

    def two_ranks(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.update(accelerator="cpu", devices=2, strategy=strategy)
        init(self, *args, **kwargs)

    two_ranks._lsync_two_ranks = True  # type: ignore[attr-defined]
    pl.Trainer.__init__ = two_ranks  # type: ignore[method-assign]
