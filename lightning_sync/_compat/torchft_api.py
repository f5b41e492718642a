"""torchft's private names, each with a check (``TOUCH_POINTS``): imported only where torchft is installed.

torchft 0.2.0's ``Manager`` builds its gRPC ``ManagerServer`` on ``[::]`` (every interface), hard-coded in
``Manager.__init__``; lightning_sync binds it to the replica group's own address instead (loopback on one
machine), by handing ``torchft.manager`` a ``ManagerServer`` that rewrites the bind address. Its manager's log
is filtered by message text (:func:`quiet_manager_log`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections.abc import Iterator
from typing import Any

from lightning_sync._compat import TouchPoint

__all__ = ["TOUCH_POINTS", "forget_failed_quorum", "manager_server_bound_to", "quiet_manager_log"]

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


_FLIGHT_RECORDER = "Unable to reset NCCL flight recorder"
_WORK_FAILED = "got exception waiting for work"


class _ManagerLogFilter(logging.Filter):
    """torchft 0.2.0's manager log as a ``ddp_sync_ft`` user needs it: no warning that an NCCL flight recorder
    could not be reset (printed at every quorum change by a torch built without NCCL; the groups' process group is
    gloo), and a collective that failed because a group was lost in one line, without the traceback of torchft's
    own frames (``ddp_sync_ft`` says next what it does about it: the step is run again)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if _FLIGHT_RECORDER in message:
            return False
        if record.exc_info and _WORK_FAILED in message:
            record.exc_info, record.exc_text = None, None
        return True


def quiet_manager_log() -> None:
    """Install :class:`_ManagerLogFilter` on torchft's manager logger (once a process)."""
    logger = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _ManagerLogFilter) for f in logger.filters):
        logger.addFilter(_ManagerLogFilter())


def _manager_log_messages() -> bool:
    import torchft.manager as manager_module

    source = inspect.getsource(manager_module)
    return (_FLIGHT_RECORDER in source and f'exception(f"{_WORK_FAILED}' in source
            and "logging.getLogger(__name__)" in source and manager_module.__name__ == "torchft.manager")


def _manager_binds_every_interface() -> bool:
    import torchft.manager as manager_module

    source = inspect.getsource(manager_module.Manager.__init__)
    return 'bind = f"[::]:{port}"' in source and "ManagerServer(" in source and callable(
        getattr(manager_module, "ManagerServer", None))


def forget_failed_quorum(manager: Any) -> None:
    """Let ``manager.start_quorum()`` ask again after a quorum that failed (the lighthouse did not answer within
    the quorum timeout): torchft 0.2.0's ``start_quorum`` first waits for the previous quorum's future, which
    would raise the same error again."""
    future = getattr(manager, "_quorum_future", None)
    if future is not None and future.done() and future.exception() is not None:
        manager._quorum_future = None


def _quorum_future_waited_first() -> bool:
    import torchft.manager as manager_module

    source = inspect.getsource(manager_module.Manager.start_quorum)
    return ("if self._quorum_future is not None:" in source and "self._quorum_future.result()" in source
            and "self._quorum_future = self._executor.submit(" in source)


TOUCH_POINTS: tuple[TouchPoint, ...] = (
    TouchPoint("torchft.manager.ManagerServer (called by Manager.__init__ with bind='[::]:port')",
               "the replica group's torchft manager listens on its own address, not every interface",
               _manager_binds_every_interface),
    TouchPoint("torchft.manager's log messages (the NCCL flight-recorder warning, 'got exception waiting for work')",
               "lsync-ft-run's output: no flight-recorder warning per quorum change, a lost group's failed "
               "collective in one line", _manager_log_messages),
    TouchPoint("torchft.Manager._quorum_future (start_quorum waits for the previous quorum's future first)",
               "ddp_sync_ft asks for a quorum again after the lighthouse did not answer (a restarted lighthouse)",
               _quorum_future_waited_first),
)
