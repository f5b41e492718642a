"""Which dataset indices each evaluation/predict batch holds, recorded from the batch sampler.

Shared by :class:`~lightning_sync.ValidationGather` and :class:`~lightning_sync.PredictionWriter`.
When Lightning prepares an evaluation or predict dataloader (after injecting its
``DistributedSampler``), :func:`attach_recorder` has the strategy's ``process_dataloader`` step give
the dataloader's batch sampler a recording subclass (the same object; ``isinstance`` checks still
hold). Batch samplers run in the main process, in order, even with ``num_workers > 0``, so the
index lists they yield form a queue (:class:`BatchLog`) that the ``on_*_batch_end`` hooks consume
one batch at a time. A log may also drop batches before they are loaded (:meth:`BatchLog.accept`).
:func:`detach_recorder` restores everything.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Literal, Protocol

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from lightning_sync._compat.lightning_api import loop_dataloaders

__all__ = ["OUTPUT_KEY", "BatchLog", "Recorder", "Stage", "active_loaders", "attach_recorder", "detach_recorder"]

Stage = Literal["validate", "test", "predict"]
_RUNNING: dict[RunningStage, Stage] = {
    RunningStage.SANITY_CHECKING: "validate",
    RunningStage.VALIDATING: "validate",
    RunningStage.TESTING: "test",
    RunningStage.PREDICTING: "predict",
}
_ACTIVE = "_lightning_sync_gathers"  # strategy attributes while an index-recording callback is attached
_PREVIOUS = "_lightning_sync_process_dataloader"
#: Key for a ``*_step`` that returns a single tensor instead of a dict.
OUTPUT_KEY = "output"




class BatchLog:
    """The index lists one batch sampler yielded during the current pass, oldest first."""

    def __init__(self) -> None:
        self.pending: deque[list[Any]] = deque()

    def start(self) -> None:
        self.pending.clear()  # a new pass over the dataloader (a new epoch, or a new val run)

    def push(self, batch: Any) -> None:
        self.pending.append(list(batch) if isinstance(batch, (list, tuple, Tensor)) else [batch])

    def pop(self) -> list[Any] | None:
        return self.pending.popleft() if self.pending else None

    def accept(self, batch: Any) -> bool:
        """Called for every batch the sampler yields, before it is loaded; ``False`` drops the batch.

        Subclasses use it to skip batches (``PredictionWriter(resume=True)`` skips finished ones).
        """
        return True


# id(sampler) -> the logs of every ValidationGather recording it (ids stay valid: the installers
# hold a reference until they restore the class)
_LOGS: dict[int, list[BatchLog]] = {}
_RECORDING: dict[type, type] = {}


def _recording_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``__iter__`` also pushes every yielded batch to the logs."""
    if cls in _RECORDING.values():
        return cls
    if cls not in _RECORDING:
        iter_of_base: Callable[[Any], Iterator[Any]] = getattr(cls, "__iter__")  # noqa: B009

        def __iter__(self: Any) -> Iterator[Any]:  # noqa: N807
            inner = iter_of_base(self)
            logs = _LOGS.get(id(self), [])
            for log in logs:
                log.start()
            # next() rather than a for loop: samplers whose __iter__ returns self (such as
            # Lightning's index batch-sampler wrapper) would otherwise re-enter this __iter__
            while True:
                try:
                    batch = next(inner)
                except StopIteration:
                    return
                if not all([log.accept(batch) for log in logs]):  # a list: every log sees every batch
                    continue
                for log in logs:
                    log.push(batch)
                yield batch

        # empty __slots__: the layout equals cls's, so assigning __class__ is allowed
        _RECORDING[cls] = type(f"Recording{cls.__name__}", (cls,), {"__slots__": (), "__iter__": __iter__,
                                                                     "__module__": __name__})
    return _RECORDING[cls]


class Recorder:
    """Installs index recording on evaluation dataloaders and undoes it."""

    def __init__(self, new_log: Callable[[], BatchLog] = BatchLog) -> None:
        self.new_log = new_log
        self.logs: dict[int, tuple[object, BatchLog | str]] = {}  # id(loader) -> its log, or why it has none
        self._patched: list[tuple[Any, type, BatchLog]] = []  # (sampler, its class before, our log)

    def install(self, loader: object) -> None:
        if not isinstance(loader, DataLoader) or id(loader) in self.logs:
            return  # a custom iterable: the *_step must return the indices itself
        if isinstance(loader.dataset, IterableDataset):
            self.logs[id(loader)] = (loader, "its dataset is an IterableDataset, which has no dataset indices")
            return
        if getattr(loader, "in_order", True) is False:
            self.logs[id(loader)] = (loader, "it was built with in_order=False, so batches may arrive out of order")
            return
        target = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
        before = type(target)
        try:
            target.__class__ = _recording_class(before)
        except TypeError as err:
            self.logs[id(loader)] = (loader, f"its sampler {before.__name__} cannot be instrumented ({err})")
            return
        log = self.new_log()
        _LOGS.setdefault(id(target), []).append(log)
        self._patched.append((target, before, log))
        self.logs[id(loader)] = (loader, log)

    def lookup(self, loader: object) -> BatchLog | str:
        entry = self.logs.get(id(loader))
        if entry is None or entry[0] is not loader:
            return ("it is not a torch DataLoader" if not isinstance(loader, DataLoader)
                    else "it was not prepared by the Trainer while this callback was attached")
        return entry[1]

    def uninstall(self) -> None:
        for target, before, log in reversed(self._patched):
            logs = _LOGS.get(id(target), [])
            logs[:] = [other for other in logs if other is not log]
            if not logs:  # no other ValidationGather records this sampler: give it its class back
                _LOGS.pop(id(target), None)
                target.__class__ = before if before not in _RECORDING.values() else before.__mro__[1]
        self._patched.clear()
        self.logs.clear()



class _Recording(Protocol):
    """A callback that records dataset indices: the stages it records and its recorder."""

    stages: tuple[Stage, ...]
    _recorder: Recorder


def attach_recorder(trainer: pl.Trainer, client: _Recording) -> None:
    """Install ``client._recorder`` on every dataloader the trainer prepares in ``client.stages``.

    Lightning calls ``strategy.process_dataloader`` on every dataloader right after injecting its
    ``DistributedSampler`` and before the first ``iter()``: the one point where the final batch
    sampler exists and has not yielded anything yet. One instance attribute per strategy, shared by
    every recording callback, removed when the last one detaches (:func:`detach_recorder`).
    """
    strategy = trainer.strategy
    clients: list[_Recording] | None = strategy.__dict__.get(_ACTIVE)
    if clients is None:
        clients = []
        original = strategy.process_dataloader
        active = clients

        def process_dataloader(dataloader: object) -> object:
            dataloader = original(dataloader)
            running = _RUNNING.get(trainer.state.stage) if trainer.state.stage is not None else None
            for client in active:
                if running in client.stages:
                    client._recorder.install(dataloader)
            return dataloader

        strategy.__dict__[_ACTIVE] = clients
        strategy.__dict__[_PREVIOUS] = strategy.__dict__.get("process_dataloader")
        strategy.process_dataloader = process_dataloader  # type: ignore[method-assign]
    clients.append(client)


def detach_recorder(strategy: Any, client: _Recording) -> None:
    """Undo :func:`attach_recorder` for ``client``; give every sampler its class back."""
    clients = strategy.__dict__.get(_ACTIVE, [])
    clients[:] = [c for c in clients if c is not client]
    if not clients:
        strategy.__dict__.pop(_ACTIVE, None)
        previous = strategy.__dict__.pop(_PREVIOUS, None)
        if previous is None:
            strategy.__dict__.pop("process_dataloader", None)
        else:
            strategy.__dict__["process_dataloader"] = previous
    client._recorder.uninstall()


def active_loaders(trainer: pl.Trainer, stage: Stage) -> list[Any]:
    """The flattened dataloaders of the loop that is running now (dataloader_idx order)."""
    if stage == "validate":
        loop: Any = trainer.validate_loop if trainer.state.fn == "validate" else trainer.fit_loop.epoch_loop.val_loop
    else:
        loop = trainer.test_loop if stage == "test" else trainer.predict_loop
    return loop_dataloaders(loop)
