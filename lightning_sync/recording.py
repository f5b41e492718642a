"""Which dataset indices each evaluation/predict batch holds, recorded from the batch sampler.

Shared by :class:`~lightning_sync.ValidationGather` and :class:`~lightning_sync.PredictionWriter`.
When Lightning prepares an evaluation or predict dataloader (after injecting its
``DistributedSampler``), :func:`attach_recorder` puts in its place a shallow copy whose batch sampler
is a :class:`RecordingBatchSampler` wrapping the loader's own (same class, attributes and sampler;
the user's loader is not modified; Lightning's prediction index wrapper stays outermost). Batch
samplers run in the main process, in order, even with ``num_workers > 0``, so the index lists they
yield form a queue (:class:`BatchLog`) that the ``on_*_batch_end`` hooks consume one batch at a time.
A log may also drop batches before they are loaded (:meth:`BatchLog.accept`).

The point where the final batch sampler exists and has not yielded yet is the strategy's
``process_dataloader``: a sync strategy calls observers registered with its
``observe_dataloaders``; any other strategy gets the same through ``_compat.observe_dataloaders``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Literal, Protocol

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from lightning_sync._compat.lightning_api import (loop_dataloaders, observe_dataloaders, rewrap_index_batch_sampler,
                                                  unwrap_index_batch_sampler, with_batch_sampler)

__all__ = ["OUTPUT_KEY", "BatchLog", "Recorder", "RecordingBatchSampler", "Stage", "active_loaders", "attach_recorder"]

Stage = Literal["validate", "test", "predict"]
_RUNNING: dict[RunningStage, Stage] = {
    RunningStage.SANITY_CHECKING: "validate",
    RunningStage.VALIDATING: "validate",
    RunningStage.TESTING: "test",
    RunningStage.PREDICTING: "predict",
}
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


class RecordingBatchSampler:
    """Yields the batches of ``inner`` and pushes each to every attached :class:`BatchLog`.

    With no log attached it passes batches through unchanged. ``batch_size``, ``drop_last`` and
    ``sampler`` are copied from ``inner`` when it has them (Lightning and users read them from a
    loader's batch sampler), any other attribute is looked up on ``inner``.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.logs: list[BatchLog] = []
        for name in ("batch_size", "drop_last", "sampler"):
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))

    def __iter__(self) -> Iterator[Any]:
        logs = list(self.logs)  # this pass's logs, as attached when it started
        for log in logs:
            log.start()
        inner = iter(self.inner)
        # next() rather than a for loop over the sampler itself: samplers whose __iter__ returns self
        # (Lightning's index wrapper) must be advanced, not restarted
        while True:
            try:
                batch = next(inner)
            except StopIteration:
                return
            if logs:
                if not all([log.accept(batch) for log in logs]):  # a list: every log sees every batch
                    continue
                for log in logs:
                    log.push(batch)
            yield batch

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def _recording_sampler(loader: DataLoader[Any]) -> RecordingBatchSampler | None:
    """The recording wrapper a prepared loader already has (outermost, or inside Lightning's index wrapper)."""
    target = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    target = unwrap_index_batch_sampler(target)
    return target if isinstance(target, RecordingBatchSampler) else None


class Recorder:
    """Records the batches of the evaluation dataloaders it is given, and stops recording them."""

    def __init__(self, new_log: Callable[[], BatchLog] = BatchLog) -> None:
        self.new_log = new_log
        self.logs: dict[int, tuple[object, BatchLog | str]] = {}  # id(loader) -> its log, or why it has none
        self._attached: list[tuple[RecordingBatchSampler, BatchLog]] = []

    def install(self, loader: object) -> object:
        """Record the batches of ``loader``; returns the loader to use in its place.

        That is a shallow copy drawing from a :class:`RecordingBatchSampler` (or ``loader`` itself when
        it already records, or cannot be recorded: :meth:`lookup` then says why).
        """
        if not isinstance(loader, DataLoader):
            return loader  # a custom iterable: the *_step must return the indices itself
        known = self.logs.get(id(loader))
        if known is not None and known[0] is loader:
            return loader
        if isinstance(loader.dataset, IterableDataset):
            self.logs[id(loader)] = (loader, "its dataset is an IterableDataset, which has no dataset indices")
            return loader
        if getattr(loader, "in_order", True) is False:
            self.logs[id(loader)] = (loader, "it was built with in_order=False, so batches may arrive out of order")
            return loader
        recording = _recording_sampler(loader)
        if recording is None:
            if loader.batch_sampler is None:  # batch_size=None: the sampler yields one sample's index at a time
                recording = RecordingBatchSampler(loader.sampler)
                loader = with_batch_sampler(loader, sampler=recording)
            else:
                recording = RecordingBatchSampler(unwrap_index_batch_sampler(loader.batch_sampler))
                loader = with_batch_sampler(loader, rewrap_index_batch_sampler(loader.batch_sampler, recording))
        log = self.new_log()
        recording.logs.append(log)
        self._attached.append((recording, log))
        self.logs[id(loader)] = (loader, log)
        return loader

    def lookup(self, loader: object) -> BatchLog | str:
        entry = self.logs.get(id(loader))
        if entry is None or entry[0] is not loader:
            return ("it is not a torch DataLoader" if not isinstance(loader, DataLoader)
                    else "it was not prepared by the Trainer while this callback was attached")
        return entry[1]

    def uninstall(self) -> None:
        """Stop recording: the loaders' copies pass their batches through unchanged from now on."""
        for recording, log in self._attached:
            recording.logs[:] = [other for other in recording.logs if other is not log]
        self._attached.clear()
        self.logs.clear()


class _Recording(Protocol):
    """A callback that records dataset indices: the stages it records and its recorder."""

    stages: tuple[Stage, ...]
    _recorder: Recorder


def attach_recorder(trainer: pl.Trainer, client: _Recording) -> Callable[[], None]:
    """Record, with ``client._recorder``, every dataloader the trainer prepares in ``client.stages``.

    Lightning calls ``strategy.process_dataloader`` on every dataloader right after injecting its
    ``DistributedSampler`` and before the first ``iter()``: the one point where the final batch
    sampler exists and has not yielded anything yet. Returns the undo, which also stops the recording.
    """
    recorder, stages = client._recorder, client.stages

    def observe(dataloader: object) -> object:
        stage = trainer.state.stage
        running = _RUNNING.get(stage) if stage is not None else None
        return recorder.install(dataloader) if running in stages else dataloader

    stop_observing = observe_dataloaders(trainer.strategy, observe)

    def detach() -> None:
        stop_observing()
        recorder.uninstall()

    return detach


def active_loaders(trainer: pl.Trainer, stage: Stage) -> list[Any]:
    """The flattened dataloaders of the loop that is running now (dataloader_idx order)."""
    if stage == "validate":
        loop: Any = trainer.validate_loop if trainer.state.fn == "validate" else trainer.fit_loop.epoch_loop.val_loop
    else:
        loop = trainer.test_loop if stage == "test" else trainer.predict_loop
    return loop_dataloaders(loop)
