"""Collective guard: no silent hangs, no silently mismatched collectives, at almost no cost.

Parts, one job each:

* :mod:`.fingerprint` - what one collective looked like on this rank; the ring of them;
* :mod:`.callsite` - the user's ``file:line function``; which callers are trusted (explicitly);
* :mod:`.intercept` - replacing the ``torch.distributed`` collective functions;
* :mod:`.protocol` - the cross-rank protocol on torch's ``Store`` (publish, compare, heartbeats);
* :mod:`.watchdog` - the background thread (fork-safe) that runs it and diagnoses stalls;
* :mod:`.report` - the error messages (pure functions);
* :mod:`.core` - :class:`CollectiveGuard`, the life cycle tying them together.

Only ``torch.distributed`` is imported by these modules, never Lightning. The names below are
resolved on first use, so importing one part (``lightning_sync.guard.report``) does not import the
others (no import cycle through this ``__init__``).
"""

import importlib
from typing import Any

__all__ = [
    "GUARDED_OPS",
    "CollectiveGuard",
    "configure_nccl_flight_recorder",
    "parameter_checksums",
    "register_trusted",
    "trusted",
]

_WHERE = {
    "GUARDED_OPS": "intercept",
    "CollectiveGuard": "core",
    "configure_nccl_flight_recorder": "nccl",
    "parameter_checksums": "checksums",
    "register_trusted": "callsite",
    "trusted": "callsite",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
