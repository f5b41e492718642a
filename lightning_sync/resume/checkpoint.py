"""The checkpoint side of resume: each rank's loader state put where Lightning reads it, the progress
shift of a re-sharded epoch, and what the strategy's parts call at load and train start."""

from __future__ import annotations

import logging
from typing import Any, Sized

from lightning_sync.errors import ResumeError
from lightning_sync.resume.loader import STATE_KEY, torchdata_available
from lightning_sync.resume.sampler import ResumableDistributedSampler
from lightning_sync.seeding import CHECKPOINT_KEY, _restore_rng_state

__all__ = ["LOOP_STATES_KEY", "EpochLengthSync", "ResumeHooks", "describe_reshard", "is_mid_epoch",
           "local_loader_states", "restore_loader_states", "select_loader_state", "stash_loader_states"]

log = logging.getLogger(__name__)


def _fit_loop_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    state = loop.get("state_dict") if isinstance(loop, dict) else None
    return state if isinstance(state, dict) else None


def local_loader_states(checkpoint: dict[str, Any]) -> list[dict[str, Any]] | None:
    """This rank's data-loader states in a checkpoint dict being saved (Lightning's fit loop put them there)."""
    state = _fit_loop_state(checkpoint)
    return state.get("combined_loader") if state is not None else None


#: Where ``checkpoint["lightning_sync"]`` keeps the loader states Lightning's fit loop saved (see
#: :func:`stash_loader_states`).
LOOP_STATES_KEY = "fit_loop_loader_states"


def stash_loader_states(checkpoint: dict[str, Any], entry: dict[str, Any]) -> None:
    """Move the resumable loader's state out of Lightning's fit-loop entry into ``entry`` (the checkpoint's
    ``"lightning_sync"`` dict), leaving Lightning an empty list there. Lightning's own strategies then resume the
    checkpoint as one of theirs (the plain ``DataLoader`` they are given has no state to take: with the state in
    its place Lightning refuses, "The CombinedLoader has 0 stateful loaders, but found 1 states"), with their
    inexact mid-epoch resume; ``ddp_sync`` puts it back at load (:func:`restore_loader_states`). Loader states
    of a user's own stateful loaders (no ``lightning_sync`` state in them) stay where Lightning put them."""
    state = _fit_loop_state(checkpoint)
    loaders = state.get("combined_loader") if state is not None else None
    if state is None or not loaders or not any(isinstance(x, dict) and STATE_KEY in x for x in loaders):
        return
    entry[LOOP_STATES_KEY] = loaders
    state["combined_loader"] = []


def restore_loader_states(checkpoint: dict[str, Any]) -> None:
    """Undo :func:`stash_loader_states` on a checkpoint being loaded (before Lightning's fit loop reads it)."""
    ours = checkpoint.get(CHECKPOINT_KEY)
    state = _fit_loop_state(checkpoint)
    if isinstance(ours, dict) and state is not None and ours.get(LOOP_STATES_KEY) and not state.get("combined_loader"):
        state["combined_loader"] = ours[LOOP_STATES_KEY]


def select_loader_state(checkpoint: dict[str, Any], states: list[Any] | None, world_size: int,
                        rank: int) -> dict[str, Any] | None:
    """Put this rank's own loader state where Lightning reads it; return its sampler state (or None).

    ``states`` is every rank's list from ``checkpoint["lightning_sync"]["loader_states"]``. On the
    same world size rank ``r`` gets rank ``r``'s (bit-identical continuation, workers included); on
    another one every rank gets rank 0's, marked to re-shard the rest of the epoch.
    """
    fit_state = _fit_loop_state(checkpoint)
    if fit_state is None or not fit_state.get("combined_loader"):
        return None
    if states and len(states) == world_size and states[rank] is not None:
        fit_state["combined_loader"] = states[rank]
    else:
        resharded = []
        for loader_state in fit_state["combined_loader"]:
            if isinstance(loader_state, dict) and STATE_KEY in loader_state:
                loader_state = {**loader_state, STATE_KEY: {**loader_state[STATE_KEY], "mode": "reshard"}}
            resharded.append(loader_state)
        fit_state["combined_loader"] = resharded
    first = fit_state["combined_loader"][0]
    if isinstance(first, dict) and STATE_KEY in first:
        sampler_state = first[STATE_KEY]["sampler"]
        return sampler_state if isinstance(sampler_state, dict) else None
    return None


def adjust_progress_for_reshard(checkpoint: dict[str, Any], sampler_state: dict[str, Any], world_size: int) -> None:
    """On another world size the interrupted epoch continues as a new, shorter segment: count its batches from 0."""
    if sampler_state["world_size"] == world_size or sampler_state["yielded"] >= sampler_state["segment_len"]:
        return
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    batch_progress = loop.get("epoch_loop.batch_progress") if isinstance(loop, dict) else None
    if isinstance(batch_progress, dict) and isinstance(batch_progress.get("current"), dict):
        # Shift, not zero: Lightning adds one to "completed" itself when the save came at a batch's end.
        current = batch_progress["current"]
        done = int(current["ready"])
        for key in ("ready", "started", "processed", "completed"):
            current[key] = int(current[key]) - done


def is_mid_epoch(sampler_state: dict[str, Any] | None) -> bool:
    return bool(sampler_state) and 0 < sampler_state["yielded"] < sampler_state["segment_len"]  # type: ignore[index]


def describe_reshard(sampler_state: dict[str, Any], world_size: int) -> str:
    old = int(sampler_state["world_size"])
    consumed = min(sampler_state["dataset_len"],
                   int(sampler_state["start"]) + int(sampler_state["yielded"]) * old)
    left = sampler_state["dataset_len"] - consumed
    return (f"lightning_sync: resuming epoch {sampler_state['epoch']} on {world_size} ranks (checkpoint: {old}); "
            f"{consumed} of {sampler_state['dataset_len']} samples were seen, the other {left} are dealt out "
            f"again over {world_size} ranks. Per-rank RNG streams start anew from the checkpoint's root seed.")


class ResumeHooks:
    """What ``SyncDDPStrategy`` calls at save, load and train start (keeps the strategy's edits small)."""

    def __init__(self) -> None:
        self._rng_after_iterator: dict[str, Any] | None = None
        self._expects_resumable_loader = False

    def check_training_loader(self, dataloader: object) -> None:
        """Refuse a training loader that cannot take the checkpoint's mid-epoch state (before any step)."""
        if self._expects_resumable_loader and not isinstance(getattr(dataloader, "sampler", None),
                                                              ResumableDistributedSampler):
            self._expects_resumable_loader = False
            sampler = getattr(dataloader, "sampler", None)
            if hasattr(dataloader, "plan"):  # world_size_invariant's loader
                raise ResumeError(
                    "resume: the checkpoint was written mid-epoch with world_size_invariant=False (its position is "
                    "per-rank loader state), and this run has world_size_invariant=True (global batches of another "
                    "size and order). Resume it with the option it was written with, or start a new run from the "
                    "weights only (LightningModule.load_from_checkpoint).")
            raise ResumeError(
                "resume: the checkpoint holds the position of ddp_sync's resumable training loader (a map-style "
                "data set, the default batch sampler over Lightning's DistributedSampler), but this run's training "
                f"loader has sampler {type(sampler).__name__} / batch sampler "
                f"{type(getattr(dataloader, 'batch_sampler', None)).__name__}"
                f"{'' if torchdata_available() else ' and torchdata is not installed'}. Resume with the loader "
                "the checkpoint was written with (and torchdata installed: pip install 'torchdata>=0.10').")
        self._expects_resumable_loader = False

    @staticmethod
    def loader_payload(checkpoint: dict[str, Any]) -> Any:
        """This rank's loader states, to be gathered beside its RNG state."""
        return local_loader_states(checkpoint)

    def on_load(self, checkpoint: dict[str, Any], world_size: int, rank: int, fitting: bool = True,
                data_world_size: int | None = None) -> None:
        """``world_size``, ``rank``: this process group's; ``data_world_size``: the ranks the training data is split
        over, where more than the process group's (``ddp_sync_ft``'s replica groups: a recovering group is sent a
        live group's loader state of the same split)."""
        data_world = world_size if data_world_size is None else data_world_size
        self._expects_resumable_loader = False
        self._rng_after_iterator = None
        if not fitting:  # validate/test/predict from a checkpoint: no training loader to resume
            return
        ours = checkpoint.get(CHECKPOINT_KEY) or {}
        restore_loader_states(checkpoint)
        sampler_state = select_loader_state(checkpoint, ours.get("loader_states"), world_size, rank)
        self._rng_after_iterator = None
        if sampler_state is None:
            return
        self._expects_resumable_loader = True
        if sampler_state["world_size"] != data_world and is_mid_epoch(sampler_state):
            adjust_progress_for_reshard(checkpoint, sampler_state, data_world)
            if rank == 0:
                log.warning(describe_reshard(sampler_state, data_world))
        rng_states = ours.get("rng_states") or []
        if is_mid_epoch(sampler_state) and ours.get("world_size") == world_size and rank < len(rng_states):
            # Lightning creates the resumed iterator (one draw from the global generator) before training
            # continues; the uninterrupted run made that draw at the epoch's start, before the checkpoint.
            self._rng_after_iterator = rng_states[rank]

    def on_train_start(self, trainer: Any = None) -> None:
        if trainer is not None:
            from lightning_sync._compat.lightning_api import load_pending_train_loader_state

            load_pending_train_loader_state(trainer)  # before the RNG states: a new iterator draws a seed
        if self._rng_after_iterator is not None:
            _restore_rng_state(self._rng_after_iterator)
            self._rng_after_iterator = None


class EpochLengthSync:
    """Keeps Lightning's batch count in step with a re-sharded epoch.

    After a resume on another world size the interrupted epoch is shorter or longer than a normal
    one, and Lightning counts batches once, when it sets up the loader. At the start of each later
    epoch the count is set from the loader again (only with the default ``limit_train_batches``).
    """

    @staticmethod
    def on_train_epoch_start(trainer: Any) -> None:
        from lightning_sync._compat.lightning_api import train_combined_loader

        fit_loop = trainer.fit_loop
        combined = train_combined_loader(trainer)
        if combined is None or trainer.limit_train_batches != 1.0:
            return
        loaders = combined.flattened
        if not any(isinstance(getattr(dl, "sampler", None), ResumableDistributedSampler) for dl in loaders):
            return
        limits = [len(dl) if isinstance(dl, Sized) else float("inf") for dl in loaders]
        combined.limits = limits
        if fit_loop.max_batches == len(combined):
            return
        fit_loop.max_batches = len(combined)
        if isinstance(trainer.val_check_interval, float) and trainer.val_check_batch is not None:
            trainer.val_check_batch = max(1, int(fit_loop.max_batches * trainer.val_check_interval))
