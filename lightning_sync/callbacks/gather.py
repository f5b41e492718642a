"""``ValidationGather``: exactly-once evaluation outputs and exact metrics under DDP.

Lightning's evaluation ``DistributedSampler`` pads every rank to the same number of samples by
repeating indices (5 samples on 2 ranks: sample 0 is evaluated twice), so every DDP validation
metric is computed on a slightly wrong set, and gathering outputs whose first dimension differs
across ranks aborts gloo or returns garbage. ``ValidationGather`` records the dataset index of
every row from the batch sampler, gathers once per epoch and removes the duplicates by index:
exact with shuffling, custom samplers, ``drop_last`` and any number of dataloaders.

The indices are found without touching the dataset, by recording what the batch sampler yields
(:mod:`lightning_sync.recording`, shared with ``PredictionWriter``). Everything is restored at
``teardown``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_sync import collectives
from lightning_sync.gathering import INDEX_KEY, RowCollector
from lightning_sync.recording import OUTPUT_KEY, Stage, active_loaders, attach_recorder
from lightning_sync.recording import BatchLog as _BatchLog
from lightning_sync.recording import Recorder as _Recorder

__all__ = ["MetricFn", "Stage", "ValidationGather"]

#: A metric computed on the gathered outputs: ``fn(outputs) -> scalar`` (or any value, kept unlogged).
MetricFn = Callable[[dict[str, Any]], Any]

_STAGES: tuple[Stage, ...] = ("validate", "test", "predict")
_HOOK = {"validate": "on_validation_gathered", "test": "on_test_gathered", "predict": "on_predict_gathered"}
_PREFIX = {"validate": "val", "test": "test", "predict": "predict"}


# --------------------------------------------------------------------------------------------------
# the callback


class ValidationGather(pl.Callback):
    """Gather evaluation outputs exactly once per sample across ranks, keyed by dataset index.

    After every validation epoch (and test/predict epoch, see ``stages``),
    ``callback.gathered[dataloader_idx]`` is a dict: ``"index"`` holds the dataset indices as an
    int64 tensor, ascending, each exactly once (for a map-style dataset evaluated in full: exactly
    ``range(len(dataset))``); every key that ``validation_step`` returned holds the matching rows in
    the same order (tensors concatenated along dim 0, lists of Python objects as lists). A
    ``validation_step`` returning a single tensor is stored under ``"output"``. If the
    LightningModule defines ``on_validation_gathered(self, outputs, dataloader_idx)`` (or
    ``on_test_gathered`` / ``on_predict_gathered``), it is called with that dict on every rank that
    holds it.

    The set is exactly what the samplers yielded: the padding duplicates of Lightning's (or your)
    ``DistributedSampler`` are removed; samples a sampler never yields (``drop_last=True`` on a
    ``DistributedSampler`` or on the DataLoader, ``limit_val_batches``) are not there.

    What ``*_step`` may return: a dict whose values are tensors with the batch dimension first,
    lists/tuples with one Python object per sample (strings, ids, ragged tensors), or 0-d
    tensors/Python numbers (skipped with a warning: they are not per sample); a single tensor; or
    ``None`` (only indices are gathered). A step returning a bare number or 0-d tensor (no row per
    sample) is an error. Any bad output, on any rank and at any batch, is raised at epoch end on
    every rank (``ValueError`` naming the rank, dataloader and batch), and no metric is computed or
    logged from the incomplete set. Ragged per-sample tensors: pad them to one length and
    return the lengths too, or return them as a list. For an ``IterableDataset`` (no dataset
    indices) return the indices yourself under ``"index"``; a returned ``"index"`` always wins.

    Metrics (``metrics``) are computed on the gathered set, where the rows are held, then rank 0's
    scalar values are broadcast and logged on every rank with ``self.log`` (``trainer.callback_metrics``,
    ``ModelCheckpoint(monitor=...)`` and ``EarlyStopping`` see the exact value, identical on every
    rank). Do not log the same quantity with ``self.log(..., sync_dist=True)`` from ``validation_step``:
    that averages per-rank means over the padded set.

    Memory: each rank holds its own rows during the epoch (on CPU with ``offload_to_cpu=True``).
    At epoch end keys are gathered one at a time; a receiving rank peaks, beyond its own rows, at
    the result (gathered bytes = samples x (8 + bytes per row)) plus the largest key's received
    buffer plus that key's own rows once more: about 2x the gathered bytes for one dominant key
    (measured 2.2-2.35x RSS growth at 1e6 rows of 16 float32 + int64 label on 2 ranks, see
    ``docs/gather.md``). With ``rank_zero_only=True`` the other ranks peak at about twice their
    own rows.

    Args:
        keys: the output keys to gather (``None``: all per-sample keys). Listed keys must be present.
        metrics: ``{name: fn}`` with ``fn(outputs) -> value`` (e.g. a ``torchmetrics.functional``
            call) or a ``torchmetrics.Metric`` (fed ``outputs[preds_key], outputs[target_key]``;
            its own DDP sync is switched off: the rows are already complete). ``"{stage}"`` in a
            name becomes ``val``/``test``/``predict``; with several dataloaders
            ``/dataloader_idx_{i}`` is appended, as Lightning does. Scalar values are logged
            (not in predict, where Lightning has no logging); all values land in ``callback.metrics``.
        stages: which of ``"validate"`` (also during fit and the sanity check), ``"test"``,
            ``"predict"`` to gather.
        rank_zero_only: only rank 0 receives and holds the rows (other ranks send theirs and keep
            nothing; their ``gathered`` stays empty, the hooks run on rank 0 only). Metric values
            are still logged on every rank.
        offload_to_cpu: move rows to CPU (detached) as each batch ends, so a large evaluation holds
            no accelerator memory.
        preds_key: the key fed to ``torchmetrics.Metric`` objects as predictions.
        target_key: the key fed to them as targets.
        prog_bar: show logged metrics in the progress bar.

    Attributes:
        gathered: ``{dataloader_idx: outputs}`` of the most recent epoch of any gathered stage.
        results: ``{stage: {dataloader_idx: outputs}}``, the most recent epoch of each stage.
        metrics: ``{logged name: value}`` of the most recent epoch of each stage.
        metric_samples: ``{logged name: N}``, the number of distinct samples each value was computed on.
    """

    def __init__(self, keys: Sequence[str] | None = None, *, metrics: Mapping[str, Any] | None = None,
                 stages: Sequence[Stage] = ("validate", "test"), rank_zero_only: bool = False,
                 offload_to_cpu: bool = False, preds_key: str = "preds", target_key: str = "target",
                 prog_bar: bool = False) -> None:
        if isinstance(keys, str):
            raise TypeError(f"ValidationGather(keys={keys!r}): pass a list of keys, e.g. keys=[{keys!r}].")
        bad = [s for s in stages if s not in _STAGES]
        if isinstance(stages, str) or bad or not stages:
            raise ValueError(f"ValidationGather(stages={stages!r}): stages must be a non-empty list of "
                             f"{', '.join(map(repr, _STAGES))}.")
        for name, fn in (metrics or {}).items():
            if not callable(fn) and not _is_metric(fn):
                raise TypeError(f"ValidationGather(metrics={{{name!r}: ...}}): expected a callable fn(outputs) or a "
                                f"torchmetrics.Metric; got {type(fn).__name__}.")
        self.keys = list(keys) if keys is not None else None
        self.metric_fns: dict[str, Any] = dict(metrics or {})
        self.stages = tuple(stages)
        self.rank_zero_only = rank_zero_only
        self.offload_to_cpu = offload_to_cpu
        self.preds_key = preds_key
        self.target_key = target_key
        self.prog_bar = prog_bar
        self.gathered: dict[int, dict[str, Any]] = {}
        self.results: dict[str, dict[int, dict[str, Any]]] = {}
        self.metrics: dict[str, Any] = {}
        self.metric_samples: dict[str, int] = {}
        self._recorder = _Recorder()
        self._collectors: dict[int, RowCollector] = {}
        self._warned: set[str] = set()
        self._detach: Callable[[], None] | None = None

    # ---------------------------------------------------------------- install / uninstall

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._detach is None:
            self._detach = attach_recorder(trainer, self)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "")  # Lightning skips the teardown hooks after an exception

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        detach, self._detach = self._detach, None
        if detach is not None:
            detach()
        self._collectors.clear()

    # ---------------------------------------------------------------- per batch

    def _start(self, trainer: pl.Trainer, stage: Stage) -> None:
        if stage in self.stages:
            self._collectors = {}

    def _batch_end(self, trainer: pl.Trainer, stage: Stage, outputs: Any, batch_idx: int, dataloader_idx: int) -> None:
        if stage not in self.stages or getattr(trainer.strategy, "stand_in_step", False):
            return  # a stand-in step (uneven_batches="join") repeats a batch this rank already had
        collector = self._collectors.setdefault(dataloader_idx, RowCollector(offload_to_cpu=self.offload_to_cpu))
        loaders = active_loaders(trainer, stage)
        loader = loaders[dataloader_idx] if dataloader_idx < len(loaders) else None
        log = self._recorder.lookup(loader)
        recorded = log.pop() if isinstance(log, _BatchLog) else None
        if collector.failed:
            return
        try:
            index, tensors, objects = self._split(outputs, recorded, log, dataloader_idx, batch_idx)
            collector.add(index, tensors, objects)
        except (TypeError, ValueError) as err:
            # not raised here: the other ranks would wait in the epoch-end gather until the
            # process-group timeout. gather() raises it on every rank at once.
            collector.fail(f"dataloader {dataloader_idx}, batch {batch_idx}: {err}")

    def _split(self, outputs: Any, recorded: list[Any] | None, log: _BatchLog | str, dataloader_idx: int,
               batch_idx: int) -> tuple[Any, dict[str, Tensor], dict[str, list[Any]]]:
        if outputs is None:
            outputs = {}
        elif isinstance(outputs, Tensor) and outputs.ndim > 0:
            outputs = {OUTPUT_KEY: outputs}
        elif isinstance(outputs, (Tensor, int, float, complex)):  # a 0-d tensor or a number
            shown = outputs.item() if isinstance(outputs, Tensor) else outputs
            raise TypeError(f"the step returned the scalar {type(outputs).__name__} {shown!r}, not one row per sample; "
                            "return a dict of per-sample values (e.g. {'loss': F.cross_entropy(logits, y, "
                            "reduction='none'), 'preds': logits.argmax(1)}), a tensor with the batch dimension first, "
                            "or None.")
        elif not isinstance(outputs, Mapping):
            raise TypeError(f"the step returned {type(outputs).__name__}; ValidationGather needs a dict of "
                            "per-sample tensors/lists, a single tensor, or None.")
        chosen = self.keys if self.keys is not None else [k for k in outputs if k != INDEX_KEY]
        missing = [k for k in chosen if k not in outputs]
        if missing:
            raise ValueError(f"keys {missing} are not in the step's outputs (it returned {sorted(outputs)}).")
        tensors: dict[str, Tensor] = {}
        objects: dict[str, list[Any]] = {}
        for key in chosen:
            value = outputs[key]
            if isinstance(value, Tensor) and value.ndim > 0:
                tensors[key] = value
            elif isinstance(value, (list, tuple)):
                objects[key] = list(value)
            elif self.keys is None and (isinstance(value, (int, float, bool)) or
                                        (isinstance(value, Tensor) and value.ndim == 0)):
                if key not in self._warned:
                    self._warned.add(key)
                    rank_zero_warn(f"ValidationGather: skipping {key!r}, a scalar rather than one row per sample. "
                                   "Pass keys=[...] to choose the keys to gather.")
            else:
                raise TypeError(f"key {key!r} is a {type(value).__name__}; return a tensor with the batch dimension "
                                "first or a list with one item per sample.")
        if INDEX_KEY in outputs:
            index = outputs[INDEX_KEY]
        elif recorded is None:
            why = log if isinstance(log, str) else (
                "its batch sampler yielded no more batches than this (the step may use dataloader_iter)")
            raise ValueError(f"no dataset indices for this batch: {why}. Return the dataset indices of the batch's "
                             f"samples under {INDEX_KEY!r} from the step.")
        elif any(i is None for i in recorded):
            raise ValueError("the sampler yielded no dataset indices (None); return the dataset indices of the "
                             f"batch's samples under {INDEX_KEY!r} from the step.")
        else:
            index = recorded
        return index, tensors, objects

    # ---------------------------------------------------------------- per epoch

    def _epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: Stage) -> None:
        if stage not in self.stages:
            return
        dst = 0 if self.rank_zero_only else None
        count = len(active_loaders(trainer, stage)) or (max(self._collectors, default=-1) + 1)
        results: dict[int, dict[str, Any]] = {}
        # every rank walks every dataloader in the same order, even one it ran no batch of
        for dataloader_idx in range(count):
            # `is None`, not `or`: a collector holding an error but no rows has len 0 (falsy), and
            # replacing it would drop the error and gather the other ranks' rows as if complete
            collector = self._collectors.pop(dataloader_idx, None)
            if collector is None:
                collector = RowCollector(self.offload_to_cpu)
            out = collector.gather(dst=dst, what=f"ValidationGather ({stage}, dataloader {dataloader_idx})")
            if out is not None:
                results[dataloader_idx] = out
            values = self._compute_metrics(out, stage, dataloader_idx, count)
            if stage != "predict":
                for name, value in values.items():
                    pl_module.log(name, value, on_step=False, on_epoch=True, prog_bar=self.prog_bar, batch_size=1,
                                  add_dataloader_idx=False,
                                  # identical on every rank already (broadcast): max keeps it bit-exact,
                                  # and sync_dist=True keeps Lightning from warning about epoch-level logging
                                  sync_dist=True, reduce_fx="max")
        self._collectors.clear()
        if not (self.rank_zero_only and trainer.global_rank != 0):
            self.results[stage] = results
            self.gathered = results
        hook = getattr(pl_module, _HOOK[stage], None)
        if callable(hook):
            for dataloader_idx, out in results.items():
                hook(out, dataloader_idx)

    def _compute_metrics(self, out: dict[str, Any] | None, stage: Stage, dataloader_idx: int,
                         count: int) -> dict[str, float]:
        """Compute on ranks holding rows; broadcast rank 0's scalars so every rank logs the same."""
        if not self.metric_fns:
            return {}
        suffix = f"/dataloader_idx_{dataloader_idx}" if count > 1 else ""
        local: dict[str, Any] = {}
        error: str | None = None
        if out is not None:
            try:
                for raw, fn in self.metric_fns.items():
                    local[raw.format(stage=_PREFIX[stage]) + suffix] = self._apply(fn, out)
            except Exception as err:  # noqa: BLE001 - re-raised on every rank below
                error = f"{type(err).__name__}: {err}"
        scalars = {k: float(v) for k, v in local.items() if _is_scalar(v)}
        samples = len(out[INDEX_KEY]) if out is not None else 0
        # every rank's outcome (a metric can fail on one rank only: its device, its dtype); plain data only
        # (safe=True): a peer's bytes cannot run code here. Rank 0's scalars are what every rank logs.
        everyone = collectives.gather_objects({"scalars": scalars, "error": error, "samples": samples}
                                              if out is not None else None, safe=True)
        assert everyone is not None
        failed = {r: o["error"] for r, o in enumerate(everyone) if o is not None and o["error"] is not None}
        if failed:
            raise RuntimeError(f"ValidationGather: a metric failed ({stage}, dataloader {dataloader_idx}) on "
                               + "; ".join(f"rank {r}: {e}" for r, e in failed.items()))
        shared = everyone[0]
        self.metrics.update(local)
        self.metrics.update(shared["scalars"])
        self.metric_samples.update({name: int(shared["samples"]) for name in [*local, *shared["scalars"]]})
        return dict(shared["scalars"])

    def _apply(self, fn: Any, out: dict[str, Any]) -> Any:
        if not _is_metric(fn):
            return fn(out)
        preds, target = out[self.preds_key], out[self.target_key]
        available = fn.distributed_available_fn
        # The rows are already complete on this rank; the Metric's own sync would all-gather them
        # again (counting every sample world_size times) or, with rank_zero_only, wait for ranks
        # that never call it.
        fn.distributed_available_fn = lambda: False
        try:
            fn.reset()
            fn.to(preds.device)
            fn.update(preds, target)
            return fn.compute()
        finally:
            fn.reset()
            fn.distributed_available_fn = available

    # ---------------------------------------------------------------- Lightning hooks

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer, "validate")

    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer, "test")

    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer, "predict")

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._batch_end(trainer, "validate", outputs, batch_idx, dataloader_idx)

    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        self._batch_end(trainer, "test", outputs, batch_idx, dataloader_idx)

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        self._batch_end(trainer, "predict", outputs, batch_idx, dataloader_idx)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_end(trainer, pl_module, "validate")

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_end(trainer, pl_module, "test")

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_end(trainer, pl_module, "predict")


def _is_metric(obj: Any) -> bool:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return False
    return isinstance(obj, Metric)


def _is_scalar(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1 and not value.is_complex()
    return isinstance(value, (int, float)) and not isinstance(value, bool)
