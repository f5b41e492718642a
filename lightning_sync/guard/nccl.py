"""torch's flight recorder settings (read by the process group at creation)."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["configure_nccl_flight_recorder"]


def configure_nccl_flight_recorder(env: MutableMapping[str, str] | None = None,
                                   directory: str | None = None) -> dict[str, str]:
    """Turn on torch's NCCL flight recorder so a collective timeout leaves a per-rank dump.

    Must run before the NCCL process group is created. Values already set by the user are kept.

    Returns:
        The variables it set.
    """
    if env is None:
        env = os.environ
    directory = directory or os.environ.get("TMPDIR", "/tmp")
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # entries per rank: the last collectives and their state
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(directory, "lightning_sync_nccl_trace_rank_"),
    }
    done = {}
    for name, value in wanted.items():
        if name not in env:
            env[name] = value
            done[name] = value
    return done


