"""``ResumableDataPart``: the training loader resumes mid-epoch at the exact batch (``lightning_sync.resume``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_sync._compat import lightning_api as _compat
from lightning_sync.parts.base import Part
from lightning_sync.resume.checkpoint import ResumeHooks
from lightning_sync.resume.loader import make_resumable

__all__ = ["ResumableDataPart"]


class ResumableDataPart(Part):
    """Makes the training loader a ``StatefulDataLoader`` over the resumable sampler, refuses one that
    cannot take a checkpoint's mid-epoch position, and applies that position (then the RNG states)
    once the training iterator exists. ``resume="auto"``: ``fit`` without ``ckpt_path`` picks the
    newest complete checkpoint of the run."""

    def __init__(self, resume: str | None) -> None:
        self.resume_arg = resume
        self.hooks = ResumeHooks()

    def process_dataloader(self, strategy: Any, dataloader: Any, trainer: Any) -> Any:
        if trainer is not None and trainer.training:
            dataloader = make_resumable(dataloader)
            self.hooks.check_training_loader(dataloader)
        return dataloader

    def on_load_checkpoint(self, strategy: Any, checkpoint: dict[str, Any], fitting: bool,
                           directory: Path | None) -> None:
        self.hooks.on_load(checkpoint, strategy.world_size, strategy.global_rank, fitting,  # each rank's loader
                           getattr(strategy, "data_world_size", None))

    def on_train_start(self, strategy: Any, trainer: Any) -> None:
        # a mid-epoch checkpoint's loader position (if Lightning set the loader up before restoring it),
        # then its RNG states, now that the iterator exists
        self.hooks.on_train_start(trainer)

    def configure_launcher(self, strategy: Any) -> None:
        if self.resume_arg is not None:
            from lightning_sync.resume.auto import auto_resume_directories, install_auto_resume

            install_auto_resume(_compat.ensure_launcher(strategy), auto_resume_directories(self.resume_arg))
