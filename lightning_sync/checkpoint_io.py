"""Atomic checkpoint files: complete under their final name, or not there at all.

Lightning's ``TorchCheckpointIO`` writes through an fsspec transaction, which stages the bytes in a
file under ``$TMPDIR`` and moves it into place with ``shutil.move``. When ``$TMPDIR`` is on another
file system than the checkpoint directory (``/dev/shm``, a node-local ``/tmp`` beside a shared
``/checkpoints``), that move is a copy into the final name: a rank killed during it leaves a
truncated ``epoch=0-step=4.ckpt`` and even a truncated ``last.ckpt`` where a good one was, and the
resume fails with "PytorchStreamReader failed reading zip archive".

:class:`AtomicCheckpointIO` (the default checkpoint IO of ``strategy="ddp_sync"``) writes local
checkpoints to a temporary file **in the target directory**, ``fsync``\\ s it, renames it over the
final name with ``os.replace`` (atomic on POSIX within one file system) and ``fsync``\\ s the
directory, whatever ``$TMPDIR`` is. A reader sees the old file or the new one, never a mix. A
failed save removes its temporary file; one left by a killed process (``.NAME.HOST-PID.*.lsync-tmp``)
is removed by the next save into the directory (of the same name, or from the same host once that
process is gone). Remote URLs (``s3://``...) keep Lightning's path.

:func:`is_complete_checkpoint` tells a complete checkpoint from a truncated one without loading
it (auto-resume uses it to pick the newest complete checkpoint); loading a truncated or corrupt
file raises :class:`CorruptCheckpointError` with the file's name and what to do.

Only torch and Lightning's checkpoint IO base class are imported here.
"""

from __future__ import annotations

import glob
import os
import re
import socket
import tempfile
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_sync._compat.lightning_api import PathLike, checkpoint_io_load_kwargs
from lightning_sync.errors import LightningSyncError

__all__ = ["RANK_FILES", "AtomicCheckpointIO", "CorruptCheckpointError", "atomic_save", "checkpoint_problem",
           "expect_rank_files", "invalidate_sharded_checkpoint", "is_complete_checkpoint", "rank_file", "rank_files_problem",
           "sharded_checkpoint_problem"]

_TMP_SUFFIX = ".lsync-tmp"


class CorruptCheckpointError(LightningSyncError):
    """A checkpoint file is truncated or corrupt (e.g. its writer was killed while saving)."""


def _is_local(path: PathLike) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


def _local(path: PathLike) -> str:
    text = str(path)
    return text[len("file://"):] if text.startswith("file://") else os.fspath(path)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some file systems do not open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: PathLike, save: Callable[[Any, Any], None] | None = None) -> None:
    """Write ``obj`` to the local file ``path`` atomically: temporary file beside it, fsync, rename.

    Args:
        obj: what ``save(obj, file)`` writes (a checkpoint dict for the default ``torch.save``).
        path: the final file name; its directory is created if needed.
        save: writes ``obj`` into an open binary file.
    """
    target = os.path.abspath(_local(path))
    directory, name = os.path.split(target)
    os.makedirs(directory, exist_ok=True)
    _remove_stale_temp_files(directory, name)
    # the writer's host and pid in the name: lets a later save tell a dead writer's file
    owner = f"{socket.gethostname().replace('.', '_')}-{os.getpid()}"
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.{owner}.", suffix=_TMP_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            (save or torch.save)(obj, f)  # torch.save looked up now: a wrapped or patched one is honoured
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; a checkpoint gets the usual mode
        os.replace(tmp, target)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


def _remove_stale_temp_files(directory: str, name: str) -> None:
    """Remove temporary files of killed writers: any of an earlier save of ``name``, and any other whose
    writer ran on this host and is gone (the writer's host and pid are in the name)."""
    host = socket.gethostname().replace(".", "_")
    for stale in glob.glob(os.path.join(glob.escape(directory), f".*{_TMP_SUFFIX}")):
        base = os.path.basename(stale)
        owner = base[: -len(_TMP_SUFFIX)].rsplit(".", 2)
        writer_host, _, pid = owner[1].rpartition("-") if len(owner) == 3 else ("", "", "")
        dead = writer_host == host and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid))
        if base.startswith(f".{name}.") or dead:
            try:
                os.remove(stale)
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_umask_lock = threading.Lock()


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``/proc/self/status``):
    ``os.umask`` can only be read by setting it, which races every other thread creating files
    (Lightning's ``AsyncCheckpointIO`` saves on a thread of its own)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _umask_lock:  # elsewhere: set and restore at once, one thread at a time
        mask = os.umask(0o077)  # the strictest mask while it is briefly replaced
        os.umask(mask)
    return mask


#: In a sharded checkpoint's directory: the folder of each rank's own state file.
RANK_FILES = "lightning_sync"
SHARDED_META = "meta.pt"  # Lightning's ModelParallelStrategy: the non-tensor state, written by rank 0 last
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint: written by its coordinator once every rank's data is


def rank_file(directory: PathLike, rank: int, world_size: int) -> Path:
    """Where rank ``rank`` of ``world_size`` keeps its state in the sharded checkpoint ``directory``."""
    return Path(directory) / RANK_FILES / f"rank{rank}-of-{world_size}.pt"


_RANK_FILE = re.compile(r"rank(\d+)-of-(\d+)\.pt")
_EXPECTED = re.compile(r"expect-(\d+)-ranks")


def expect_rank_files(directory: Path, world_size: int) -> None:
    """Mark ``directory`` as completed by ``world_size`` rank files (rank 0, before the save's collectives)."""
    folder = directory / RANK_FILES
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"expect-{world_size}-ranks").touch()


def rank_files_problem(directory: PathLike) -> str | None:
    """Why the per-rank state files a sharded checkpoint expects are incomplete, or None (none expected:
    a checkpoint of Lightning's own strategy, or one that gathered every rank's state into ``meta.pt``)."""
    folder = Path(directory) / RANK_FILES
    names = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    for name in names:
        expected = _EXPECTED.fullmatch(name)
        if expected is None:
            continue
        size = int(expected[1])
        missing = [r for r in range(size) if rank_file(directory, r, size).name not in names]
        if missing:
            shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
            return f"the per-rank state of rank(s) {shown} is missing from {folder}"
    return None


def invalidate_sharded_checkpoint(directory: Path) -> None:
    """Before a sharded checkpoint is written over ``directory`` (rank 0, before the save's first collective):
    remove what marks it complete (Lightning's ``meta.pt``, DCP's ``.metadata``) and lightning_sync's rank
    files and marker, so that a save cut short never looks complete. Only a sharded checkpoint is touched."""
    if not directory.is_dir() or not ((directory / SHARDED_META).exists() or (directory / DCP_METADATA).exists()):
        return
    for name in (SHARDED_META, DCP_METADATA):
        (directory / name).unlink(missing_ok=True)
    folder = directory / RANK_FILES
    for path in folder.iterdir() if folder.is_dir() else ():
        if _RANK_FILE.fullmatch(path.name) or _EXPECTED.fullmatch(path.name):
            path.unlink(missing_ok=True)


def sharded_checkpoint_problem(directory: PathLike) -> str | None:
    """Why ``directory`` is not a complete sharded checkpoint (Lightning's ``ModelParallelStrategy``: DCP
    shards, DCP's ``.metadata``, Lightning's ``meta.pt``, lightning_sync's per-rank files), or None.

    ``SyncModelParallelStrategy`` clears a directory's completion marks before it writes over it, rank
    0 then notes how many rank files will complete it, Lightning writes ``meta.pt`` after every rank's
    shards and each rank its state file after that: complete means ``.metadata``, a whole ``meta.pt``
    and every expected rank file. Nothing is unpickled (hyperparameters in ``meta.pt`` may need
    ``weights_only=False``).
    """
    root = Path(directory)
    for name in (DCP_METADATA, SHARDED_META):
        if not (root / name).is_file():
            return f"it is a directory without {name} (not a sharded checkpoint, or its save was cut short)"
    problem = checkpoint_problem(root / SHARDED_META)
    if problem is not None:
        return f"its {SHARDED_META}: {problem}"
    return rank_files_problem(root)


def checkpoint_problem(path: PathLike, verify_data: bool = False) -> str | None:
    """Why ``path`` is not a complete torch checkpoint, or ``None`` if it is.

    Reads only the zip directory at the end of the file (a truncated file has none), so it is cheap
    for a checkpoint of any size. ``verify_data=True`` also checks every record's CRC (reads the
    whole file: catches corruption inside, not only truncation). A directory is checked as a sharded
    checkpoint (:func:`sharded_checkpoint_problem`).
    """
    local = _local(path)
    if _is_local(path) and os.path.isdir(local):
        return sharded_checkpoint_problem(local)
    try:
        size = os.path.getsize(local)
    except OSError as err:
        return f"cannot read it ({err.strerror or err})"
    if size == 0:
        return "it is empty"
    if not zipfile.is_zipfile(local):
        with open(local, "rb") as f:
            head = f.read(4)
        if head[:2] == b"\x80\x02":  # torch's legacy (non-zip) format: only loading it tells
            try:
                torch.load(local, map_location="cpu", weights_only=False)
            except Exception as err:  # noqa: BLE001
                return f"it does not load ({type(err).__name__}: {err})"
            return None
        return f"it is not a complete torch checkpoint (no zip directory at its end; {size} bytes): truncated?"
    try:
        with zipfile.ZipFile(local) as archive:
            names = archive.namelist()
            if not any(n.endswith("data.pkl") for n in names):
                return "it is a zip file but holds no torch checkpoint (no data.pkl)"
            if verify_data:
                bad = archive.testzip()
                if bad is not None:
                    return f"its record {bad!r} is corrupt (CRC mismatch)"
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        return f"its zip directory is unreadable ({err})"
    return None


def is_complete_checkpoint(path: PathLike, verify_data: bool = False) -> bool:
    """True when ``path`` is a complete torch checkpoint (see :func:`checkpoint_problem`)."""
    return checkpoint_problem(path, verify_data) is None


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that writes local files atomically and refuses truncated ones on load."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathLike, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        atomic_save(checkpoint, path)

    def load_checkpoint(self, path: PathLike, map_location: Any | None = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if _is_local(path) and os.path.exists(_local(path)):
            problem = checkpoint_problem(path)
            if problem is not None:
                raise CorruptCheckpointError(_refusal(path, problem))
        try:
            return super().load_checkpoint(path, map_location=map_location,
                                           **checkpoint_io_load_kwargs(weights_only))  # 2.6.0 on
        except RuntimeError as err:
            if "PytorchStreamReader" in str(err) or "zip archive" in str(err):
                raise CorruptCheckpointError(_refusal(path, f"{err}".splitlines()[0])) from err
            raise


def _refusal(path: PathLike, problem: str) -> str:
    directory = Path(_local(path)).parent
    others = sorted((p for p in directory.glob("*.ckpt") if p != Path(_local(path)) and is_complete_checkpoint(p)),
                    key=lambda p: p.stat().st_mtime, reverse=True)[:3]
    hint = (f" Complete checkpoints beside it, newest first: {', '.join(p.name for p in others)}." if others
            else " No complete checkpoint lies beside it.")
    return (f"checkpoint {_local(path)} is incomplete: {problem}. It was probably being written when its process "
            f"was killed; it is refused rather than loaded.{hint} Resume from a complete one (ckpt_path=...).")
