"""``Part`` (one guarantee, a few hooks) and ``SyncStrategyMixin`` (a Lightning strategy plus its parts)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from lightning_sync._compat import lightning_api as _compat
from lightning_sync._compat.lightning_api import PathLike
from lightning_sync.strategy_callbacks import install_first

__all__ = ["Part", "SyncStrategyMixin"]

_P = TypeVar("_P", bound="Part")


class Part:
    """One guarantee of a sync strategy. Every hook is optional; each runs on every rank.

    The strategy calls its parts in list order at each of its own steps (below), so a part never
    overrides a strategy method and never reaches into another part. Hooks that talk to other
    ranks (``setup_distributed``, ``on_save_checkpoint``, ``closing``) must do the same collectives on
    every rank.
    """

    def before_setup_distributed(self, strategy: Any) -> None:
        """Before the process group is created (e.g. environment variables NCCL reads at creation)."""

    def setup_distributed(self, strategy: Any, fresh: bool) -> None:
        """The process group exists. ``fresh``: this strategy has not seen it before (False when a
        validate/test/predict after ``fit`` reuses the group the last teardown kept)."""

    def setup(self, strategy: Any, trainer: Any) -> None:
        """Lightning's ``strategy.setup`` is done: the model is wrapped, its weights identical."""

    def callbacks(self, strategy: Any) -> Sequence[Any]:
        """Callbacks this part owns; the strategy puts them first in ``trainer.callbacks``."""
        return ()

    def process_dataloader(self, strategy: Any, dataloader: Any, trainer: Any) -> Any:
        """Return the loader to use instead of ``dataloader`` (``trainer`` may be None)."""
        return dataloader

    def run_stage_started(self, strategy: Any, trainer: Any) -> None:
        """Lightning's run-stage barrier: its signal handlers are registered, the loops start next."""

    def on_train_start(self, strategy: Any, trainer: Any) -> None:
        """The training loop starts (the fit loop has restored a checkpoint's progress)."""

    def on_save_checkpoint(self, strategy: Any, checkpoint: dict[str, Any]) -> None:
        """Every rank, before rank 0 writes ``checkpoint``: add what this part keeps in it."""

    def on_load_checkpoint(self, strategy: Any, checkpoint: dict[str, Any], fitting: bool) -> None:
        """Every rank, after ``checkpoint`` was read (``fitting``: by ``fit``, not validate/test/predict)."""

    def configure_launcher(self, strategy: Any) -> None:
        """Lightning has chosen the launcher (``strategy.launcher``); a part may wrap or replace it."""

    def on_exception(self, strategy: Any, exception: BaseException) -> None:
        """The run failed with ``exception`` (before Lightning's own handling)."""

    def before_teardown(self, strategy: Any) -> None:
        """Before Lightning's teardown (the model is still wrapped)."""

    def closing(self, strategy: Any) -> None:
        """After Lightning's teardown, while the group is alive and healthy: the run's last collectives."""

    def after_teardown(self, strategy: Any) -> None:
        """Every part, even when ``closing`` raised; in list order (``TeardownPart``, last, keeps or destroys
        the group)."""


class SyncStrategyMixin:
    """A Lightning strategy plus an ordered list of parts: put it first in the bases,
    ``class SyncXStrategy(SyncStrategyMixin, XStrategy)``, and pass the parts to ``_init_parts``.

    It overrides the Lightning strategy methods the parts need and calls every part's hook around
    ``super()``: nothing about one guarantee lives in the strategy class.
    """

    _parts: tuple[Part, ...] = ()

    def _init_parts(self, parts: Sequence[Part]) -> None:
        self._parts = tuple(parts)

    @property
    def parts(self) -> tuple[Part, ...]:
        """The parts in the order their hooks run."""
        return self._parts

    def part(self, kind: type[_P]) -> _P | None:
        """This strategy's part of type ``kind``, or ``None`` when it has none (switched off)."""
        return next((p for p in self._parts if isinstance(p, kind)), None)

    # ------------------------------------------------------------------ Lightning's strategy methods

    _kept_group = False  # the last teardown kept the process group for this strategy's next trainer call
    _failed = False  # the current run failed: teardown skips the collectives of a healthy group

    def setup_distributed(self) -> None:
        import torch.distributed as dist

        from lightning_sync.resume import init_process_group_after_restart

        for p in self._parts:
            p.before_setup_distributed(self)
        strategy: Any = self  # the Lightning strategy this mixin is combined with
        device = strategy.root_device
        init_process_group_after_restart(_compat.process_group_backend(strategy), _compat.process_group_timeout(strategy),
                                         device if device.type != "cpu" else None)
        existed = dist.is_available() and dist.is_initialized()
        super().setup_distributed()  # type: ignore[misc]
        # The group this strategy kept at its last teardown (fit, then validate/test/predict): the parts
        # agreed on what they need once per group. (No reference to the group object is held: it would
        # keep a destroyed group's store serving stale rendezvous keys on MASTER_PORT.)
        fresh = not (existed and self._kept_group)
        self._kept_group = False
        self._failed = False
        for p in self._parts:
            p.setup_distributed(self, fresh)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # type: ignore[misc]
        for p in self._parts:
            p.setup(self, trainer)
        install_first(trainer, [cb for p in self._parts for cb in p.callbacks(self)])

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        trainer = _compat.attached_trainer(getattr(self, "lightning_module", None))
        for p in self._parts:
            dataloader = p.process_dataloader(self, dataloader, trainer)
        return dataloader

    def barrier(self, name: str | None = None) -> None:
        module = getattr(self, "lightning_module", None)
        if _compat.is_run_stage_barrier(name) and module is not None:
            for p in self._parts:
                p.run_stage_started(self, module.trainer)
        super().barrier(name)  # type: ignore[misc]

    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        module = getattr(self, "lightning_module", None)
        trainer = module.trainer if module is not None else None
        for p in self._parts:
            p.on_train_start(self, trainer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Any | None = None) -> None:
        for p in self._parts:  # called on every rank by trainer.save_checkpoint
            p.on_save_checkpoint(self, checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        # Lightning passes weights_only from 2.6.0 on; older ones have no such parameter.
        checkpoint: dict[str, Any] = super().load_checkpoint(  # type: ignore[misc]
            checkpoint_path, **_compat.load_checkpoint_kwargs(weights_only))
        trainer = _compat.attached_trainer(getattr(self, "lightning_module", None))
        fitting = trainer is not None and trainer.state.fn == "fit"
        for p in self._parts:
            p.on_load_checkpoint(self, checkpoint, fitting)
        return checkpoint

    def _configure_launcher(self) -> None:  # compat: Lightning's launcher hook (_compat.TOUCH_POINTS)
        super()._configure_launcher()  # type: ignore[misc]
        strategy: Any = self
        if _compat.start_method(strategy) == "popen":  # under Hydra: ranks replay only their job (launcher.py)
            from lightning_sync.launcher import HydraDDPLauncher, hydra_active

            if hydra_active():
                assert strategy.cluster_environment is not None
                _compat.set_launcher(strategy, HydraDDPLauncher(strategy.cluster_environment, strategy.num_processes,
                                                                strategy.num_nodes))
        for p in self._parts:
            p.configure_launcher(self)

    def on_exception(self, exception: BaseException) -> None:
        for p in self._parts:
            p.on_exception(self, exception)
        super().on_exception(exception)  # type: ignore[misc]

    def teardown(self) -> None:
        import torch.distributed as dist

        for p in self._parts:
            p.before_teardown(self)
        super().teardown()  # type: ignore[misc]  # unwraps the model, reverts layer sync, moves it to CPU
        if not (dist.is_available() and dist.is_initialized()):
            return
        try:
            if not self._failed:
                for p in self._parts:
                    p.closing(self)
        except BaseException:
            self._failed = True
            raise
        finally:
            for p in self._parts:
                p.after_teardown(self)
