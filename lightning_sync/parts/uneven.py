"""``UnevenBatchPart``: ranks with different amounts of training data: a clear error, a common stop, or a join.

``"error"`` (the default) and ``"stop_together"`` compare the ranks' batch counts at every epoch's
start (loaders with a length) and, for loaders without one (``IterableDataset``), batch by batch
(``lightning_sync.joining``). ``"join"``: every batch of every rank is trained on once; a rank that
ran out repeats its last batch as a *stand-in* so that it runs the same step and meets every
collective the others make, and this part makes the stand-in count for nothing:

* the gradient: each rank's loss is scaled by ``world * n_rank / sum(n)`` before backward (0 for a
  stand-in), so DDP's mean over ranks is the mean over the step's real samples;
* ``self.log(..., sync_dist=True)`` per step: the stand-in rank's value is left out of the
  reduction (mean over the ranks with data); nothing a stand-in step logs is accumulated into the
  epoch's values, nor into the module's torchmetrics metrics (their states are put back);
* SyncBatchNorm (``lightning_sync.batchnorm.joined_step``): a stand-in contributes a count of zero;
* a collective of the user's own in ``training_step`` cannot be made neutral: under the guard every
  rank raises :class:`~lightning_sync.UnevenTrainingError` at it, naming the rank that ran out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_sync._compat import lightning_api as _compat
from lightning_sync._compat.torch_api import all_gather_single
from lightning_sync.errors import UnevenTrainingError
from lightning_sync.invariance import InvariantLoader
from lightning_sync.joining import AgreeingLoader, StepShare, wrap_evaluation_loader, wrap_training_loader
from lightning_sync.parts.base import Part
from lightning_sync.step_state import LoggedSnapshot

__all__ = ["UNEVEN_MODES", "UnevenBatchPart"]

UNEVEN_MODES = ("error", "stop_together", "join")


class UnevenBatchPart(Part):
    """Ranks with different numbers of training batches (``uneven_batches=``; see the module doc)."""

    def __init__(self, uneven_batches: str, planned: bool = False) -> None:
        self.uneven_batches = uneven_batches
        # world_size_invariant=True: the training loader plans every step's shares itself (an InvariantLoader)
        self.planned = planned
        self.loader: AgreeingLoader | InvariantLoader | None = None  # the training loader, where it has shares
        self.current: StepShare | None = None  # the running batch's share (until the next batch or the epoch's end)
        self.in_step = 0  # inside a step (training_step, validation_step, test_step, backward): its collectives join
        self.in_weighted_step = 0  # inside a step whose ranks hold different numbers of samples, none a stand-in
        self._saved: LoggedSnapshot | None = None  # logged values and metric states before a stand-in step

    # ------------------------------------------------------------------ hooks

    def callbacks(self, strategy: Any) -> Sequence[Any]:
        from lightning_sync.callbacks.resume import ResumeEpochLength
        from lightning_sync.strategy_checks import UnevenBatchCheck

        steps = (_JoinedSteps(self),) if self.uneven_batches == "join" or self.planned else ()
        return (UnevenBatchCheck(self.uneven_batches), ResumeEpochLength(), *steps)

    def setup(self, strategy: Any, trainer: Any) -> None:
        if not (self.uneven_batches == "join" or self.planned) or strategy.world_size < 2:
            return
        native = [name for name, m in strategy.lightning_module.named_modules()
                  if isinstance(m, torch.nn.SyncBatchNorm)]
        if native:
            raise ValueError(
                f"{'world_size_invariant=True' if self.planned else 'uneven_batches=' + repr('join')}: the model has "
                f"torch.nn.SyncBatchNorm layers ({', '.join(native[:5])}"
                f"{', ...' if len(native) > 5 else ''}), whose statistics would count a joined rank's stand-in "
                "batch. Use lightning_sync's SyncBatchNorm, which gives a stand-in a count of zero: "
                "Trainer(sync_batchnorm=True) with plain BatchNorm layers, or lightning_sync.convert_sync_batchnorm(model).")

    def process_dataloader(self, strategy: Any, dataloader: Any, trainer: Any) -> Any:
        if trainer is not None and trainer.training and isinstance(dataloader, InvariantLoader):
            # every rank knows every step's shares from the plan: no exchange (the plan's ranks may be more than
            # this process group's: ddp_sync_ft's replica groups)
            self.loader = dataloader
            return dataloader
        if trainer is None or strategy.world_size < 2:
            return dataloader
        agree = (lambda record: self._agree(strategy, record))  # noqa: E731
        if trainer.training:
            wrapped = wrap_training_loader(dataloader, self.uneven_batches, agree, strategy.global_rank,
                                           _compat.batch_size_of)
            self.loader = wrapped if isinstance(wrapped, AgreeingLoader) else None
            return wrapped
        if self.uneven_batches == "join" and (trainer.sanity_checking or trainer.validating or trainer.testing):
            # Evaluation streams that differ in length: per-step sync_dist is joined the same way (map-style
            # loaders are cut into equal steps by exact evaluation where that is possible).
            return wrap_evaluation_loader(dataloader, agree, strategy.global_rank, _compat.batch_size_of)
        return dataloader

    def step_context(self, strategy: Any) -> Any:
        share = self.current
        if share is None:
            return contextlib.nullcontext()
        if not share.joined:
            return self._weighted()  # every rank has data, in different amounts
        return self._joined(strategy, share)

    @contextlib.contextmanager
    def _weighted(self) -> Iterator[None]:
        self.in_weighted_step += 1
        try:
            yield
        finally:
            self.in_weighted_step -= 1

    def scale_loss(self, strategy: Any, loss: Any) -> Any:
        share = self.current
        if share is None or not isinstance(loss, Tensor):
            return loss
        scale = share.loss_scale
        return loss if scale == 1.0 else loss * scale

    def reduce(self, tensor: Tensor, reduce_op: Any, run: Callable[[Tensor, Any], Tensor]) -> Tensor | None:
        """``self.log(sync_dist=True)`` in a step with stand-ins: the reduction over the ranks with data only; in a
        step whose ranks hold different numbers of samples, a mean weighted by them (``run(tensor, op)`` does the
        collective). None: an ordinary step, reduce as usual."""
        share = self.current
        if share is None or not (self.in_step or self.in_weighted_step):
            return None  # outside the step (a callback's decision, an epoch-end value): every rank as it is
        op = (reduce_op if isinstance(reduce_op, str) else str(reduce_op).rsplit(".", 1)[-1]).lower()
        if not share.joined:
            if op not in ("mean", "avg"):
                return None
            # slices of different sizes: the mean over the step's samples, as the loss's gradient is weighted
            value = tensor if tensor.is_floating_point() else tensor.to(torch.get_default_dtype())
            return run(value * (share.sizes[share.rank] / sum(share.sizes)), "sum")
        shadow = share.shadow
        if op in ("mean", "avg"):
            value = tensor if tensor.is_floating_point() else tensor.to(torch.get_default_dtype())
            out = run(torch.zeros_like(value) if shadow else value, "sum")
            return out / share.live
        if op == "sum":
            return run(torch.zeros_like(tensor) if shadow else tensor, "sum")
        if op in ("max", "min") and shadow:
            info = torch.finfo(tensor.dtype) if tensor.is_floating_point() else torch.iinfo(tensor.dtype)
            neutral = (-float("inf") if op == "max" else float("inf")) if tensor.is_floating_point() else (
                info.min if op == "max" else info.max)
            return run(torch.full_like(tensor, neutral), op)
        return run(tensor, reduce_op)

    # ------------------------------------------------------------------ machinery

    def _agree(self, strategy: Any, record: list[int]) -> list[list[int]]:
        """Every rank's record of this batch (one all-gather of a few int64, a guarded operation)."""
        world = strategy.world_size
        mine = torch.tensor(record, dtype=torch.int64, device=strategy.root_device)
        every = torch.empty(world * len(record), dtype=torch.int64, device=strategy.root_device)
        guard = strategy.guard
        with guard.guarded("uneven_batches batch agreement", f"int64[{len(record)}]") if guard is not None \
                else contextlib.nullcontext():
            all_gather_single(every, mine)
        return every.view(world, -1).tolist()

    @contextlib.contextmanager
    def _joined(self, strategy: Any, share: StepShare) -> Iterator[None]:
        from lightning_sync.batchnorm import joined_step

        guard = strategy.guard
        self.in_step += 1
        try:
            with joined_step(share.shadow), (guard.refusing(lambda op, site: _refused(share, op, site))
                                             if guard is not None else contextlib.nullcontext()):
                yield
        finally:
            self.in_step -= 1

    def start_step(self, trainer: Any, module: Any, loader: AgreeingLoader | InvariantLoader | None) -> None:
        """A training or evaluation batch of ``loader`` starts: take its share; before a stand-in step, keep the
        metric states."""
        self.end_stand_in()
        self.current = loader.shares.popleft() if loader is not None and loader.shares else None
        if self.current is not None and self.current.shadow:
            self._saved = LoggedSnapshot(trainer, module)

    def end_stand_in(self) -> None:
        """Put back the metric states a stand-in step changed (at the next batch or the epoch's end, after
        every hook of the step and Lightning's own step-end logging ran); a value first logged in a stand-in
        step is emptied (its epoch value comes from the ranks with data)."""
        saved, self._saved = self._saved, None
        if saved is not None:
            saved.put_back()


class _JoinedSteps(pl.Callback):
    """``uneven_batches="join"``: each training step's share (first of every callback)."""

    def __init__(self, part: UnevenBatchPart) -> None:
        self.part = part

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_sync.strategy_checks import _loaders

        loaders = _loaders(trainer)
        if trainer.world_size > 1 and len(loaders) > 1:  # the same on every rank: every rank raises
            if self.part.planned:
                raise ValueError(
                    f"world_size_invariant=True takes one training loader; this fit has {len(loaders)} (a list or "
                    "dict of loaders). Combine them into one loader (one dataset yielding the combined batch), or "
                    "use world_size_invariant=False.")
            raise ValueError(
                f"uneven_batches='join' takes one training loader; this fit has {len(loaders)} (a list or dict of "
                "loaders). Combine them into one loader (one dataset yielding the combined batch), or use "
                "uneven_batches='error' / 'stop_together'.")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.part.start_step(trainer, pl_module, self.part.loader)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.part.end_stand_in()
        self.part.current = None

    # evaluation streams (validation within fit, validate, test): the same, per dataloader

    def _eval_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: Any, idx: int) -> None:
        from lightning_sync.recording import active_loaders

        loaders = active_loaders(trainer, stage)
        loader = loaders[idx] if idx < len(loaders) else None
        self.part.start_step(trainer, pl_module, loader if isinstance(loader, AgreeingLoader) else None)

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_start(trainer, pl_module, "validate", dataloader_idx)

    def on_test_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                            batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_start(trainer, pl_module, "test", dataloader_idx)

    # Lightning computes an evaluation loader's epoch values right after its last batch (before the epoch-end
    # hooks): a stand-in evaluation step's states are put back at its batch end (first of every callback).

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self.part.end_stand_in()

    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        self.part.end_stand_in()

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.part.current = None  # validation within a training epoch is no part of the training step

    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.part.current = None

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.part.end_stand_in()
        self.part.current = None

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.part.end_stand_in()
        self.part.current = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.part.current = None
        self.part._saved = None
        self.part.in_step = self.part.in_weighted_step = 0


def _refused(share: StepShare, op: str, site: str) -> UnevenTrainingError:
    shown = {r: (f"ran out after {d} batches" if d is not None else "has data")
             for r, d in enumerate(share.done_after)}
    return UnevenTrainingError(
        f"{op} at {site}, at training batch {share.step} of this epoch, while {share.describe()} "
        "(uneven_batches='join': a rank that ran out runs stand-in steps on its last batch to meet the others' "
        "collectives). A collective of your own in training_step cannot be made neutral: the stand-in's values "
        "would be counted as data. Every rank raises this error. Use self.log(..., sync_dist=True) or a "
        "torchmetrics metric (both are joined), move the collective to on_train_epoch_end (every rank runs it "
        "together once the epoch is over), or give every rank the same number of batches and use "
        "uneven_batches='error'.",
        shown,
    )
