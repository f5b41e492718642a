"""``Part``: one guarantee of a sync strategy, and the hooks the strategy calls it at."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any


__all__ = ["Part"]


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

    def step_context(self, strategy: Any) -> Any:
        """A context manager around each training, validation and test step (``strategy.training_step`` ...)
        and each backward (``strategy.backward``); parts without it are not called on the hot path."""
        return contextlib.nullcontext()

    def scale_loss(self, strategy: Any, loss: Any) -> Any:
        """The loss to call backward on instead of ``loss`` (manual and automatic optimisation)."""
        return loss

    def run_stage_started(self, strategy: Any, trainer: Any) -> None:
        """Lightning's run-stage barrier: its signal handlers are registered, the loops start next."""

    def on_train_start(self, strategy: Any, trainer: Any) -> None:
        """The training loop starts (the fit loop has restored a checkpoint's progress)."""

    def on_save_checkpoint(self, strategy: Any, checkpoint: dict[str, Any], directory: Path | None) -> None:
        """Every rank, before rank 0 writes ``checkpoint``: add what this part keeps in it. ``directory``:
        the checkpoint's directory when the strategy writes a sharded one (every rank writes its own
        files there: see ``after_save_checkpoint``), else None (rank 0 writes one file)."""

    def after_save_checkpoint(self, strategy: Any, directory: Path | None) -> None:
        """Every rank, once the strategy has written the checkpoint; a sharded one's ``directory`` exists."""

    def on_load_checkpoint(self, strategy: Any, checkpoint: dict[str, Any], fitting: bool,
                           directory: Path | None) -> None:
        """Every rank, after ``checkpoint`` was read (``fitting``: by ``fit``, not validate/test/predict;
        ``directory``: the sharded checkpoint's directory, else None)."""

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
