"""This process's rank as the launchers announce it, before any process group exists, and a free port for
one to come (no Hydra, no torch)."""

from __future__ import annotations

import os
import socket

__all__ = ["announced_global_rank", "free_port"]


def announced_global_rank() -> int:
    """This process's global rank as the launchers announce it (0 in a process nobody launched)."""
    for key in ("LSYNC_GLOBAL_RANK", "RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def free_port() -> int:
    """A TCP port free on this host now (the kernel's pick), for a store server to come."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])
