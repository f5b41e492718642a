"""This process's rank as the launchers announce it, before any process group exists (no Hydra, no torch)."""

from __future__ import annotations

import os

__all__ = ["announced_global_rank"]


def announced_global_rank() -> int:
    """This process's global rank as the launchers announce it (0 in a process nobody launched)."""
    for key in ("LSYNC_GLOBAL_RANK", "RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0
