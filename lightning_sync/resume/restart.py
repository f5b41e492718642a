"""Elastic restarts (torchrun ``--max-restarts``): the process group of a new attempt."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["init_process_group_after_restart"]

log = logging.getLogger(__name__)


def init_process_group_after_restart(backend: str, timeout: Any, device_id: Any = None) -> bool:
    """Under torchrun, from the second attempt on: join the process group under a per-attempt store prefix.

    torchrun's agent keeps one store for all attempts; measured with torch 2.13, gloo's rendezvous
    of a restarted worker group then reads the dead group's addresses from it ("Connection
    refused", or a hang in ``init_process_group``). A fresh key prefix per attempt avoids that.
    Returns whether it initialised the group (Lightning then skips its own ``init_process_group``).
    """
    import os
    from datetime import timedelta

    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if (attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not dist.is_available()
            or dist.is_initialized()):
        return False
    c10d: Any = dist  # the store classes are exported without declarations (mypy)
    wait = timeout if isinstance(timeout, timedelta) else timedelta(minutes=30)
    client = c10d.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=wait)
    store = c10d.PrefixStore(f"lightning_sync/attempt_{attempt}", client)
    from lightning_sync._compat.torch_api import init_process_group_kwargs

    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=wait,
                            **init_process_group_kwargs(device_id))
    log.warning("lightning_sync: torchrun restart %s: process group joined under a fresh store prefix.", attempt)
    return True
