"""Exact mid-epoch resume of the training data path (``ddp_sync``, ``model_parallel_sync``).

What a checkpoint must hold so that ``trainer.fit(ckpt_path=...)`` continues with exactly the
batches, and exactly the random numbers, of the uninterrupted run:

* the **sampler position**: which epoch, and how far into it. :class:`ResumableDistributedSampler`
  describes the epoch as one global order (the permutation of ``seed + epoch``, as torch's
  ``DistributedSampler``) and a cursor into it, so the same state also re-shards the rest of the
  epoch over another number of ranks;
* the **data-loader iterator**, worker processes included: torchdata's ``StatefulDataLoader`` (which
  Lightning saves and restores by itself) keeps the base seed of the workers, which worker yields
  next and a snapshot every ``SNAPSHOT_EVERY`` batches. ``ResumableDataLoader`` adds the **RNG
  state of every worker** to those snapshots (a worker's random augmentation continues where it
  stopped);
* **every rank's** loader state: Lightning writes rank 0's only, so the strategy's
  ``CheckpointStatePart`` stores all of them (gathered into one file, or one file per rank in a
  sharded checkpoint) and :func:`select_loader_state` hands each rank its own on load;
* each rank's global RNG states (``lightning_sync.seeding``), restored after the resumed iterator
  was created (creating one draws a seed from the global generator).

The modules, one job each:

==============  ========================================================================
sampler.py      ``ResumableDistributedSampler`` and the checks of a saved sampler state
workers.py      the workers' RNG states inside torchdata's snapshots
loader.py       ``make_resumable``: Lightning's training loader rebuilt as the resumable one
checkpoint.py   the checkpoint side: each rank's state on load, re-sharded progress, the
                hooks ``ResumableDataPart`` calls
auto.py         ``resume="auto"``: the newest complete checkpoint for a ``fit`` without one
restart.py      elastic restarts: the process group of a new torchrun attempt
==============  ========================================================================

torchdata is a requirement of the package; an environment without it (installed with ``--no-deps``)
trains as before, and a mid-epoch checkpoint resumes at the right epoch but not at the right batch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "SAMPLER_NAME",
    "SNAPSHOT_EVERY",
    "STATE_KEY",
    "EpochLengthSync",
    "ResumableDistributedSampler",
    "ResumeHooks",
    "auto_resume_directories",
    "check_sampler_state",
    "describe_reshard",
    "find_resume_checkpoint",
    "init_process_group_after_restart",
    "install_auto_resume",
    "is_mid_epoch",
    "local_loader_states",
    "make_resumable",
    "resumable_loader_class",
    "select_loader_state",
    "torchdata_available",
]

_WHERE = {
    "SAMPLER_NAME": "sampler", "ResumableDistributedSampler": "sampler", "check_sampler_state": "sampler",
    "SNAPSHOT_EVERY": "loader", "STATE_KEY": "loader", "make_resumable": "loader", "resumable_loader_class": "loader",
    "torchdata_available": "loader",
    "EpochLengthSync": "checkpoint", "ResumeHooks": "checkpoint", "describe_reshard": "checkpoint",
    "is_mid_epoch": "checkpoint", "local_loader_states": "checkpoint", "select_loader_state": "checkpoint",
    "auto_resume_directories": "auto", "find_resume_checkpoint": "auto", "install_auto_resume": "auto",
    "init_process_group_after_restart": "restart",
}


def __getattr__(name: str) -> Any:  # the names are resolved on first use (as in lightning_sync.parts)
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
