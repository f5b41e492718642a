"""torch's flight recorder settings (read by the process group at creation)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import MutableMapping

__all__ = ["configure_nccl_flight_recorder"]


def configure_nccl_flight_recorder(env: MutableMapping[str, str] | None = None,
                                   directory: str | None = None) -> dict[str, str]:
    """Turn on torch's NCCL flight recorder so a collective timeout leaves a per-rank dump.

    Must run before the NCCL process group is created. Values already set by the user are kept.
    The dumps go to ``directory``, by default a fresh private directory (``tempfile.mkdtemp``, mode
    0700, ``$TMPDIR/lightning_sync_nccl_*``): a predictable name in a shared ``/tmp`` would let
    another user pre-create or link the dump files.

    Returns:
        The variables it set.
    """
    if env is None:
        env = os.environ
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # entries per rank: the last collectives and their state
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env:  # create the private directory only when it is used
        directory = directory or tempfile.mkdtemp(prefix="lightning_sync_nccl_")
        wanted["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = os.path.join(directory, "nccl_trace_rank_")
    done = {}
    for name, value in wanted.items():
        if name not in env:
            env[name] = value
            done[name] = value
    return done


