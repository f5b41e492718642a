"""torchft's private names, each with a check (``TOUCH_POINTS``): imported only where torchft is installed.

torchft 0.2.0's ``Manager`` builds its gRPC ``ManagerServer`` on ``[::]`` (every interface), hard-coded in
``Manager.__init__``; lightning_sync binds it to the replica group's own address instead (loopback on one
machine), by handing ``torchft.manager`` a ``ManagerServer`` that rewrites the bind address.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from typing import Any

from lightning_sync._compat import TouchPoint

__all__ = ["TOUCH_POINTS", "manager_server_bound_to"]

_lock = threading.Lock()


@contextlib.contextmanager
def manager_server_bound_to(host: str) -> Iterator[None]:
    """While the block runs, a ``torchft.Manager`` built in it binds its ManagerServer to ``host`` (not ``[::]``)."""
    import torchft.manager as manager_module

    real = manager_module.ManagerServer

    def bound(**kwargs: Any) -> Any:
        port = str(kwargs["bind"]).rsplit(":", 1)[-1]
        kwargs["bind"] = f"{host}:{port}"
        return real(**kwargs)

    with _lock:
        manager_module.ManagerServer = bound
        try:
            yield
        finally:
            manager_module.ManagerServer = real


def _manager_binds_every_interface() -> bool:
    import torchft.manager as manager_module

    source = inspect.getsource(manager_module.Manager.__init__)
    return 'bind = f"[::]:{port}"' in source and "ManagerServer(" in source and callable(
        getattr(manager_module, "ManagerServer", None))


TOUCH_POINTS: tuple[TouchPoint, ...] = (
    TouchPoint("torchft.manager.ManagerServer (called by Manager.__init__ with bind='[::]:port')",
               "the replica group's torchft manager listens on its own address, not every interface",
               _manager_binds_every_interface),
)
