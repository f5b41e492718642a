"""The RNG state of every data-loader worker in torchdata's snapshots (a worker's random augmentation
continues where it stopped)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from lightning_sync.seeding import _collect_rng_state, _restore_rng_state

__all__ = ["_WorkerRNGDataset"]


class _WorkerRNGDataset(Dataset[Any]):
    """Wraps a map-style data set; in a worker process its state is the worker's RNG state.

    torchdata snapshots a data set's ``state_dict`` inside each worker at its last batch before every
    ``SNAPSHOT_EVERY``-th step and restores it after ``worker_init_fn`` on resume (then fetches the
    batches since the snapshot again), so random augmentation drawn in ``__getitem__`` or
    ``collate_fn`` continues exactly. The state is plain bytes and lists, not tensors: tensors would
    travel through shared memory with every snapshot. Attribute access falls through to the wrapped
    data set.
    """

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling): avoid recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def state_dict(self) -> dict[str, Any]:
        inner = self.dataset.state_dict() if hasattr(self.dataset, "state_dict") else None
        in_worker = torch.utils.data.get_worker_info() is not None
        return {"worker_rng": _collect_rng_state(compact=True) if in_worker else None, "inner": inner}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("inner") is not None and hasattr(self.dataset, "load_state_dict"):
            self.dataset.load_state_dict(state["inner"])
        if torch.utils.data.get_worker_info() is None:
            return
        rng = state.get("worker_rng") or state.get("rng")  # ("rng": written before the compact encoding)
        if rng is not None:
            _restore_rng_state(rng)
