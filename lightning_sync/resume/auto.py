"""``resume="auto"``: ``fit`` without ``ckpt_path`` resumes from the newest complete checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lightning_sync.ranks import announced_global_rank

__all__ = ["auto_resume_directories", "fill_fit_ckpt_path", "find_resume_checkpoint", "install_auto_resume"]

log = logging.getLogger(__name__)


def find_resume_checkpoint(directories: list[Path]) -> Path | None:
    """The newest complete checkpoint under ``directories`` (newest by modification time): a file, or a
    sharded checkpoint's directory (``SyncModelParallelStrategy``'s DCP checkpoints).

    A file cut short when its writer died (only possible outside ``AtomicCheckpointIO``, which
    renames complete files into place) fails :func:`~lightning_sync.checkpoint_io.is_complete_checkpoint`
    and is skipped with a log line; nothing is deleted.
    """
    from lightning_sync.checkpoint_io import DCP_METADATA, RANK_FILES, SHARDED_META, checkpoint_problem

    def _sharded(path: Path) -> bool:  # a sharded checkpoint's directory, complete or cut short
        return path.is_dir() and ((path / SHARDED_META).exists() or (path / DCP_METADATA).exists()
                                  or (path / RANK_FILES).is_dir() or any(path.glob("*.distcp")))

    candidates: list[Path] = []
    for directory in directories:
        if directory.is_dir() and not (directory / SHARDED_META).is_file():
            # one-file checkpoints, and sharded ones: directories named *.ckpt (DCP shards + meta.pt)
            candidates += [p for p in directory.rglob("*.ckpt") if p.is_file() or _sharded(p)]
        elif directory.exists():
            candidates.append(directory)

    def written(path: Path) -> int:  # a sharded checkpoint: when its last file was written
        if not path.is_dir():
            return path.stat().st_mtime_ns
        return max((p.stat().st_mtime_ns for p in [path, *path.iterdir(), *path.glob(f"{RANK_FILES}/*")]), default=0)

    for path in sorted(candidates, key=written, reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        log.warning("lightning_sync: resume skips %s: %s.", path, problem)
    return None


def fill_fit_ckpt_path(launcher: Any, choose: Any) -> None:
    """Make ``launcher.launch`` call ``fit`` with ``ckpt_path=choose(trainer)`` where ``fit`` was given none (and
    ``choose`` returns something).

    The launcher object stays what it is (Lightning checks its type); only its ``launch`` gains a step, run on
    every rank before the process group exists. The one place that rewrites ``fit``'s arguments:
    :func:`install_auto_resume` chooses the newest complete checkpoint, ``ddp_sync_ft`` a live replica group.
    """
    import inspect

    from lightning_sync._compat.lightning_api import FIT_IMPL_NAME

    inner = launcher.launch

    def launch(function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is not None and getattr(function, "__name__", "") == FIT_IMPL_NAME:
            bound = inspect.signature(function).bind(*args, **kwargs)
            if bound.arguments.get("ckpt_path") is None:
                chosen = choose(trainer)
                if chosen is not None:
                    bound.arguments["ckpt_path"] = chosen
                args, kwargs = bound.args, bound.kwargs
        return inner(function, *args, trainer=trainer, **kwargs)

    setattr(launcher, "launch", launch)


def install_auto_resume(launcher: Any, directories: Any) -> None:
    """Make ``launcher.launch`` resume ``fit`` without ``ckpt_path`` from the newest complete checkpoint.

    Each rank searches the same ``directories(trainer)`` before the process group exists (after an elastic
    restart every rank starts again).
    """

    def newest(trainer: Any) -> str | None:
        dirs = directories(trainer)
        chosen = find_resume_checkpoint(dirs) if dirs else None
        where = ", ".join(map(str, dirs))
        if chosen is not None:
            log.warning("lightning_sync: resume: resuming from %s (the newest complete checkpoint under %s).",
                        chosen, where)
            return str(chosen)
        if dirs:
            log.info("lightning_sync: resume: no checkpoint under %s; starting fresh.", where)
        return None

    fill_fit_ckpt_path(launcher, newest)


def auto_resume_directories(resume: str) -> Any:
    """Where ``resume`` looks: ``"auto"``: every ModelCheckpoint's ``dirpath`` and Lightning's SLURM
    ``hpc_ckpt_*.ckpt`` files in ``default_root_dir``; else the directory given."""

    def directories(trainer: Any) -> list[Path]:
        if resume != "auto":
            return [Path(resume)]
        dirs = [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
        # Lightning's own SLURM preemption checkpoints (SIGUSR1 -> hpc_ckpt_N.ckpt in default_root_dir)
        hpc = sorted(Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt"))
        if not dirs and not hpc and announced_global_rank() == 0:  # the same on every rank: said once
            log.warning("lightning_sync: resume='auto' has nowhere to look: no ModelCheckpoint(dirpath=...). A "
                        "restarted run starts fresh; set dirpath, or pass resume=<directory>.")
        return dirs + hpc

    return directories
