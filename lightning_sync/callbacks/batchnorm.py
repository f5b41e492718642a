"""Lightning wiring for the portable :class:`~lightning_sync.batchnorm.SyncBatchNorm`.

Two ways to synchronise BatchNorm with Lightning on any backend:

* ``Trainer(strategy="ddp_sync", sync_batchnorm=True)``: the strategy swaps the ``TorchSyncBatchNorm``
  that ``sync_batchnorm=True`` builds for :class:`PortableSyncBatchNorm` (see
  :func:`portable_layer_sync`); Lightning converts after ``LightningModule.setup`` and reverts at
  teardown. ``Trainer(strategy="ddp", plugins=[PortableSyncBatchNorm()])`` does the same on
  Lightning's own strategy.
* ``Trainer(strategy="ddp", callbacks=[SyncBatchNormConversion()])`` without ``sync_batchnorm``:
  converts in the callback's ``setup`` hook (before the DDP wrap) and reverts at ``teardown``.
"""

from __future__ import annotations

from collections.abc import Iterable

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_sync._compat.lightning_api import layer_sync as strategy_layer_sync
from lightning_sync._compat.torch_api import BatchNormBase
from lightning_sync.batchnorm import (
    EXCLUDE_ATTR,
    SyncBatchNorm,
    _excluded,
    _is_frozen,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
    share_running_stats,
    unshare_running_stats,
)

__all__ = ["PortableSyncBatchNorm", "SyncBatchNormConversion", "portable_layer_sync"]


class PortableSyncBatchNorm(LayerSync):
    """A ``LayerSync`` plugin converting BatchNorm layers to the portable :class:`SyncBatchNorm`.

    Works on CPU (gloo) and GPU (NCCL, where the layers run torch's own CUDA kernels). Pass it as
    ``Trainer(plugins=[PortableSyncBatchNorm()])`` (without ``sync_batchnorm=True``), or let
    ``strategy="ddp_sync"`` use it for ``sync_batchnorm=True``.

    On gloo, :meth:`apply` also takes the synchronised running statistics out of DDP's per-step
    buffer broadcast (:func:`~lightning_sync.batchnorm.share_running_stats`): they are identical on
    every rank by construction, and that broadcast is one more blocking collective per step.

    Args:
        process_group: the group to synchronise over; ``None``: the default (world) group. A group of
            its own (:func:`~lightning_sync.batchnorm.dedicated_group`) measured slower on CPU (see
            ``bench/bench_syncbn.py``).
        exclude: qualified module names to leave unsynchronised (see ``convert_sync_batchnorm``).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, exclude: Iterable[str] = ()) -> None:
        self.process_group = process_group
        self.exclude = tuple(exclude)
        self._shared: list[str] = []

    def apply(self, model: nn.Module) -> nn.Module:
        """Convert ``model``'s BatchNorm layers; before the DDP wrap. Every rank must call it (on gloo
        it broadcasts the running statistics once)."""
        model = convert_sync_batchnorm(model, process_group=self.process_group, exclude=self.exclude)
        self._shared = share_running_stats(model)
        return model

    def revert(self, model: nn.Module) -> nn.Module:
        """Give ``model`` back its original BatchNorm classes (no collective)."""
        unshare_running_stats(model, self._shared)
        self._shared = []
        return revert_sync_batchnorm(model)


def portable_layer_sync(layer_sync: LayerSync | None) -> LayerSync | None:
    """Replace Lightning's ``TorchSyncBatchNorm`` (what ``sync_batchnorm=True`` builds) by
    :class:`PortableSyncBatchNorm`; return anything else unchanged.

    For strategies: apply it to the strategy's layer-sync plugin at the top of
    ``setup``, before Lightning applies it.
    """
    if type(layer_sync) is TorchSyncBatchNorm:  # exact type: a user's own subclass is their choice
        return PortableSyncBatchNorm()
    return layer_sync


def _unsynchronised(model: nn.Module, exclude: tuple[str, ...]) -> list[str]:
    """Plain BatchNorm layers that conversion should have caught (not frozen, excluded or marked)."""
    return [name for name, m in model.named_modules()
            if isinstance(m, BatchNormBase) and not isinstance(m, SyncBatchNorm) and not _is_frozen(m)
            and getattr(m, EXCLUDE_ATTR, True) is not False and not _excluded(name, exclude)]


class SyncBatchNormConversion(Callback):
    """Synchronise BatchNorm across ranks on Lightning's own ``"ddp"`` strategies, on any backend.

    Converts the LightningModule's BatchNorm layers to :class:`SyncBatchNorm` in ``setup`` (fit
    only; before the DDP wrap) and reverts them in ``teardown``, so the model leaves ``fit`` with its
    original classes. Checkpoints have the same keys either way and load into the plain model. Does
    nothing, and says so once, when the world has a single process.

    Use it instead of ``Trainer(sync_batchnorm=True)``, never together: that flag makes Lightning
    convert the layers to ``torch.nn.SyncBatchNorm``, which fails on CPU.

    Layers built in ``LightningModule.setup``/``configure_model`` do not exist yet when the callback
    converts; it warns about them at ``on_fit_start``. Use ``Trainer(plugins=[PortableSyncBatchNorm()])``
    or ``strategy="ddp_sync", sync_batchnorm=True`` for such models.

    Args:
        process_group: as for :class:`PortableSyncBatchNorm`.
        exclude: qualified module names to leave unsynchronised.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, exclude: Iterable[str] = ()) -> None:
        self._plugin = PortableSyncBatchNorm(process_group, exclude)
        self._converted = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        layer_sync = strategy_layer_sync(trainer.strategy)
        if layer_sync is not None:
            raise MisconfigurationException(
                f"SyncBatchNormConversion: the strategy already synchronises layers with "
                f"{type(layer_sync).__name__} (from `Trainer(sync_batchnorm=True)` or a LayerSync plugin). Use one or "
                "the other: drop `sync_batchnorm=True` and keep the callback, or drop the callback and use "
                '`Trainer(strategy="ddp_sync", sync_batchnorm=True)`.'
            )
        if trainer.world_size <= 1:
            rank_zero_info("SyncBatchNormConversion: a single process, nothing to synchronise; BatchNorm layers left "
                           "as they are.")
            return
        self._plugin.apply(pl_module)  # in place: a LightningModule is never itself a BatchNorm layer
        self._converted = True

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._converted:
            return
        missed = _unsynchronised(pl_module, self._plugin.exclude)
        if missed:
            rank_zero_warn(
                f"SyncBatchNormConversion: {len(missed)} BatchNorm layer(s) appeared after the callback's `setup` and "
                f"are not synchronised: {', '.join(missed)}. Build them in `__init__`, or use "
                '`Trainer(strategy="ddp_sync", sync_batchnorm=True)`, which converts after `LightningModule.setup`.'
            )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._converted:
            self._plugin.revert(pl_module)
            self._converted = False
