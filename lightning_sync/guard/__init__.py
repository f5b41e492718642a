"""Collective guard: no silent hangs, no silently mismatched collectives, at almost no cost.

Parts, one job each:

* :mod:`.fingerprint` - what one collective looked like on this rank; the ring of them;
* :mod:`.callsite` - the user's ``file:line function``; which callers are trusted (explicitly);
* :mod:`.intercept` - replacing the ``torch.distributed`` collective functions;
* :mod:`.protocol` - the cross-rank protocol on torch's ``Store`` (publish, compare, heartbeats);
* :mod:`.watchdog` - the background thread (fork-safe) that runs it and diagnoses stalls;
* :mod:`.report` - the error messages (pure functions);
* :mod:`.core` - :class:`CollectiveGuard`, the life cycle tying them together.

Only ``torch.distributed`` is imported here, never Lightning.
"""

from lightning_sync.guard.callsite import register_trusted, trusted
from lightning_sync.guard.checksums import parameter_checksums
from lightning_sync.guard.core import CollectiveGuard
from lightning_sync.guard.intercept import GUARDED_OPS
from lightning_sync.guard.nccl import configure_nccl_flight_recorder

__all__ = [
    "GUARDED_OPS",
    "CollectiveGuard",
    "configure_nccl_flight_recorder",
    "parameter_checksums",
    "register_trusted",
    "trusted",
]
