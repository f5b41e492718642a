"""Each replica group writes its own files: two groups of one run logging or checkpointing into one directory
are refused at the start of ``fit``.

Every group of a ``ddp_sync_ft`` run is a Lightning run of its own that logs and checkpoints as rank 0. Two
groups writing ``last.ckpt`` (or a logger's metrics file) in the same directory overwrite each other's files
mid-write. At ``on_train_start`` each group leaves a marker ``.lsync_ft_group<G>`` holding the run's key in
every directory it writes (each ``ModelCheckpoint``'s ``dirpath``, each logger's ``log_dir``) and then looks for
another group's marker with the same key there: the group that looks second (both, where they look together)
refuses, and under ``lsync-ft-run`` that ends the run (``report_fatal``: a set-up error is not restarted, and the
other groups are stopped rather than left to train alone). A group removes its markers at the end of its ``fit``;
a killed group's stay (a restarted group with a versioned logger writes into a new version's directory).

The run's key is ``LSYNC_FT_RUN_ID`` (``lsync-ft-run`` sets a fresh one when it starts the lighthouse itself; the
SLURM recipe sets ``slurm-<job id>`` on every node), else torchft's lighthouse address (one ``lsync-ft-run --group
G --lighthouse HOST:PORT`` per machine: the same for every group).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any

from lightning_sync.errors import LightningSyncError

__all__ = ["claim_output_dirs", "output_dirs", "own_checkpoint_paths", "release_output_dirs", "run_key"]

_MARKER = re.compile(r"\.lsync_ft_group(\d+)")


def run_key(environ: os._Environ[str] | dict[str, str] = os.environ) -> str:
    """The key every group of this run shares (see the module doc)."""
    return environ.get("LSYNC_FT_RUN_ID") or environ.get("TORCHFT_LIGHTHOUSE", "")


def output_dirs(trainer: Any) -> list[str]:
    """The directories this group's ``fit`` writes files to: checkpoints and logs (absolute, each once)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    found: list[str] = []
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            found.append(str(callback.dirpath))
    for logger in trainer.loggers:
        log_dir = getattr(logger, "log_dir", None)
        if log_dir:
            found.append(str(log_dir))
    return sorted({os.path.realpath(d) for d in found if "://" not in d})  # (remote filesystems: not checked)


def claim_output_dirs(dirs: Iterable[str], group: int, key: str) -> list[str]:
    """Mark ``dirs`` as written by replica group ``group`` of the run ``key``; return the markers written.

    Raises:
        LightningSyncError: another group of the same run writes to one of them.
    """
    dirs = list(dirs)
    written = []
    for directory in dirs:
        os.makedirs(directory, exist_ok=True)
        marker = os.path.join(directory, f".lsync_ft_group{group}")
        with open(marker, "w") as f:
            f.write(key)
        written.append(marker)
    shared: dict[str, list[int]] = {}
    for directory in dirs:
        for name in os.listdir(directory):
            match = _MARKER.fullmatch(name)
            if match is None or int(match.group(1)) == group:
                continue
            try:
                with open(os.path.join(directory, name)) as f:
                    theirs = f.read()
            except OSError:
                continue  # removed meanwhile: that group's fit ended
            if theirs == key:
                shared.setdefault(directory, []).append(int(match.group(1)))
    if shared:
        release_output_dirs(written)
        where = "; ".join(f"{d} (also replica group(s) {', '.join(map(str, sorted(g)))})" for d, g in shared.items())
        raise LightningSyncError(
            f"ddp_sync_ft: replica group {group} writes its checkpoints or logs where another group of this run "
            f"writes too: {where}. Each group is a Lightning run of its own that saves as rank 0, so they would "
            "overwrite each other's files. Give each group its own directory, e.g. Trainer(default_root_dir="
            "f\"outputs/group{os.environ['REPLICA_GROUP_ID']}\") (and a ModelCheckpoint dirpath under it).")
    return written


def release_output_dirs(markers: Iterable[str]) -> None:
    """Remove this group's markers (the end of its ``fit``)."""
    for marker in markers:
        try:
            os.remove(marker)
        except OSError:
            pass


def own_checkpoint_paths(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """A live group's checkpoint, received by a recovering group: its ``ModelCheckpoint`` states name the sender's
    directory (best and last paths, the top-k). Rewritten to this group's own directory, where this group saved the
    same files at the same steps before it was lost, so that Lightning restores them (it drops a state whose
    ``dirpath`` changed) and the group goes on overwriting ``last.ckpt`` and pruning its top-k as it would have."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    states = checkpoint.get("callbacks")
    if not isinstance(states, dict):
        return
    for callback in trainer.callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        state = states.get(callback.state_key)
        theirs = state.get("dirpath") if isinstance(state, dict) else None
        if isinstance(theirs, str) and callback.dirpath and theirs != str(callback.dirpath):
            states[callback.state_key] = _moved(state, theirs, str(callback.dirpath))


def _moved(value: Any, old: str, new: str) -> Any:
    """``value`` with every path under ``old`` (strings, dict keys, nested) moved under ``new``."""
    if isinstance(value, str):
        return new + value[len(old):] if value == old or value.startswith(old.rstrip(os.sep) + os.sep) else value
    if isinstance(value, dict):
        return {_moved(k, old, new): _moved(v, old, new) for k, v in value.items()}
    return value
