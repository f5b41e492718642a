"""What one training step changed outside the optimizer, kept to be put back.

A step that must count for nothing (``uneven_batches="join"``'s stand-in step of a rank that ran out) or that
is run again (``ddp_sync_ft`` after torchft did not commit it) must leave no trace where Lightning and the model
accumulate across steps:

* :class:`LoggedSnapshot`: the epoch's logged values (``self.log``: Lightning's running ``_ResultMetric``
  states) and the module's torchmetrics states, copied at a point of the step and put back later; a value first
  logged after the snapshot is emptied.
* :class:`BufferSnapshot`: the module's persistent buffers (BatchNorm's running statistics and its
  ``num_batches_tracked``, any buffer a ``state_dict`` holds), copied and put back in place.

Both copy what they keep (small tensors, on their own device: no host-device synchronisation).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_sync._compat import lightning_api as _compat

__all__ = ["BufferSnapshot", "LoggedSnapshot", "module_metrics"]


def module_metrics(module: Any) -> list[Any]:
    """The torchmetrics ``Metric`` modules of ``module``."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - a dependency of Lightning
        return []
    return [m for m in module.modules() if isinstance(m, Metric)]


class LoggedSnapshot:
    """The running loop's logged values and ``module``'s torchmetrics states now (see the module doc)."""

    def __init__(self, trainer: Any, module: Any) -> None:
        self._logged = _compat.running_results(trainer)  # the live collection: keys logged later show up in it
        self._saved = [(m, _states(m)) for m in [*self._logged.values(), *module_metrics(module)]]

    def put_back(self) -> None:
        """Every kept state as it was; a logged value that did not exist at the snapshot is reset (its epoch value
        then comes from later steps, or from the other ranks)."""
        for metric, states in self._saved:
            _put_back(metric, states)
        known = {id(m) for m, _ in self._saved}
        for metric in list(self._logged.values()):
            if id(metric) not in known and getattr(metric, "is_tensor", False):
                metric.reset()


class BufferSnapshot:
    """Copies of ``module``'s persistent buffers (what its ``state_dict`` holds besides parameters)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._saved: list[tuple[Any, str, Tensor]] = []
        for owner in module.modules():
            skip = getattr(owner, "_non_persistent_buffers_set", ())
            for name, buffer in owner.named_buffers(recurse=False):
                if buffer is not None and name not in skip:
                    self._saved.append((owner, name, buffer.detach().clone()))

    def put_back(self) -> None:
        with torch.no_grad():
            for owner, name, copy in self._saved:
                current = getattr(owner, name, None)
                if isinstance(current, Tensor) and current.shape == copy.shape and current.dtype == copy.dtype:
                    current.copy_(copy)  # in place: DDP and optimizers hold the same tensor
                else:
                    setattr(owner, name, copy.clone())


def _states(metric: Any) -> dict[str, Any]:
    """A metric's accumulated states: (the object, a copy) per state, and its update bookkeeping."""
    states: dict[str, Any] = {}
    for name in getattr(metric, "_defaults", {}):
        value = getattr(metric, name)
        states[name] = (value, value.clone() if isinstance(value, Tensor) else list(value) if isinstance(value, list)
                        else value)
    states["_update_count"] = (None, getattr(metric, "_update_count", 0))
    return states


def _put_back(metric: Any, states: dict[str, Any]) -> None:
    if hasattr(metric, "_computed"):
        object.__setattr__(metric, "_computed", None)  # a cached compute() of other states: recomputed
    for name, (original, copy) in states.items():
        current = getattr(metric, name, None)
        if isinstance(copy, Tensor) and current is original and isinstance(current, Tensor) \
                and current.shape == copy.shape:
            current.copy_(copy)  # in place: metrics sharing a state tensor (compute groups) keep sharing it
        elif isinstance(copy, list) and isinstance(current, list) and current is original:
            current[:] = copy
        else:
            object.__setattr__(metric, name, copy) if name.startswith("_") else setattr(metric, name, copy)
