"""``FaultTolerantDDPStrategy`` (``"ddp_sync_ft"``): ``ddp_sync`` in each replica group, torchft across them;
``FaultTolerantModelParallelStrategy`` (``"model_parallel_sync_ft"``): the same with FSDP2 inside each group (process
``r`` of every group holds shard ``r``; its gradient shards are averaged across the groups after the backward, and it
is sent process ``r``'s shards when its group recovers). Both are ``_FaultTolerance`` over a group's strategy.

Each replica group is an ordinary Lightning run started by ``lsync-ft-run``: one process (``devices=1``), or
``P`` processes under ``torchrun`` (``--nproc-per-replica P``, ``devices=P``: DDP inside the group). Across the
groups, torchft's ``Manager`` (one per process: rank ``r`` of every group forms one of torchft's rings) decides
every step who takes part:

- a quorum of the live groups is formed at the start of each step (the first one before Lightning restores
  anything); a group recovering in it is sent the checkpoint this group would have written at the end of the
  previous step;
- DDP's gradient buckets are averaged over the quorum through torchft's reconfigurable process group (a
  DDP communication hook: the group's own all-reduce of the bucket, then one across the groups on torchft's
  process group, which DDP waits for at the end of the backward, as it waits for its own: the buckets cross
  the groups while the backward goes on);
- the optimizer steps only if torchft commits the step (``should_commit``); a step it does not commit (a
  group was lost in it) is run again on the same batch, with the same random numbers, by the groups of a new
  quorum;
- a group restarted by ``lsync-ft-run`` (``LSYNC_FT_RESTART`` > 0) resumes from a live group, not from a
  file: its ``fit`` without ``ckpt_path`` joins a quorum first, torchft sends it the Lightning checkpoint of
  a live group at that step boundary (weights, optimizer, loops, data position, RNG states; rank ``r``'s to
  rank ``r``) and Lightning restores it as it restores a file.

The training data is split across groups (group ``g`` of ``R`` reads shard ``g``); the shards of groups
missing from a step are not trained in that step. They are counted (``trainer.strategy.ft_report``, the
logged ``ft/participants`` and ``ft/missing_shards``, a line at the end of ``fit``), never silent. With
``world_size_invariant=True`` none is skipped: the live groups of a step split its whole global batch among them
(``taken_over`` counts those steps' missing slices).
"""

from __future__ import annotations

import collections
import functools
import logging
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from lightning_sync._compat import lightning_api as _compat
from lightning_sync._compat.lightning_api import PathLike
from lightning_sync._compat.torch_api import BatchNormBase, register_buffer_sync_hook
from lightning_sync.batchnorm import SyncBatchNorm, exchange_across
from lightning_sync.errors import LightningSyncError
from lightning_sync.invariance import DropoutStep, current_dropout_step, rerun_dropout_step, set_dropout_step
from lightning_sync.joining import StepShare
from lightning_sync.ft import ReplicaContext, ReplicaGroup, replica_context, report_fatal, require_torchft, run_finished
from lightning_sync.ft.outputs import (claim_output_dirs, output_dirs, own_checkpoint_paths, release_output_dirs,
                                       run_key)
from lightning_sync.parts.base import Part
from lightning_sync.parts.checkpoint import CheckpointStatePart
from lightning_sync.parts.invariant import WorldSizeInvariantPart
from lightning_sync.parts.uneven import UnevenBatchPart
from lightning_sync.seeding import CHECKPOINT_KEY, _collect_rng_state, _restore_rng_state
from lightning_sync.model_parallel import SyncModelParallelStrategy
from lightning_sync.step_state import BufferSnapshot, LoggedSnapshot
from lightning_sync.strategy import SyncDDPStrategy

__all__ = ["FaultTolerantDDPStrategy", "FaultTolerantModelParallelStrategy", "FT_PEER"]

if TYPE_CHECKING:  # (checked as a strategy of a replica group; combined with one at run time)
    _Base = SyncDDPStrategy
else:
    _Base = object

log = logging.getLogger(__name__)

#: the ``ckpt_path`` a restarted replica group's ``fit`` gets: the checkpoint comes from a live group
FT_PEER = "torchft:live-replica-group"
_REPORT_KEY = "lightning_sync_ft"  # in the checkpoint a recovering group is sent: the run's counts
_QUORUM_RETRIES = 2  # a quorum asked for again after quorum_timeout (a restarted lighthouse lost the request)


class _LivePeerCheckpoint(str):
    """``FT_PEER`` as the restarted group's ``ckpt_path``: false (Lightning then loads nothing) once the recovery
    quorum found no live group ahead of this one (every group is still at its first step: nothing to recover)."""

    outcome = "pending"  # "pending" until the recovery quorum ran, then "received" or "none"

    def __bool__(self) -> bool:
        return self.outcome != "none"


class _FaultTolerance(_Base):
    """torchft across the replica groups, over a lightning_sync strategy in each group (the parts common to
    ``FaultTolerantDDPStrategy`` and ``FaultTolerantModelParallelStrategy``): the quorum of each step, the commit,
    a step run again, recovery from a live group, the counts."""

    def __init__(self, *args: Any, min_replicas: int | None = None, timeout: float = 30.0,
                 quorum_timeout: float = 120.0, max_step_retries: int = 10, **kwargs: Any) -> None:
        require_torchft()
        if min_replicas is not None and min_replicas < 1:
            raise ValueError(f"{type(self).__name__}(min_replicas={min_replicas}): at least 1.")
        if max_step_retries < 0:
            raise ValueError(f"{type(self).__name__}(max_step_retries={max_step_retries}): 0 or more.")
        self.replica_group = ReplicaGroup.from_env()
        self.min_replicas = min_replicas if min_replicas is not None else self.replica_group.min_replicas
        self.ft_timeout = timedelta(seconds=timeout)
        self.quorum_timeout = timedelta(seconds=quorum_timeout)
        self.max_step_retries = max_step_retries
        if kwargs.get("resume") is not None:
            raise ValueError(
                f"{type(self).__name__}(resume={kwargs['resume']!r}): a group's fit recovers from a live replica "
                "group; resuming from checkpoint files is not combined with it yet. Pass ckpt_path= to fit (the "
                "same checkpoint in every group) to start a whole run again from a file.")
        super().__init__(*args, **kwargs)
        self._init_parts([*self.parts[:-1], _FaultTolerancePart(self), self.parts[-1]])
        self._sending = False  # building the state a recovering group is sent (torchft's quorum thread)
        self._ctx: ReplicaContext | None = None
        self._quorum_open = False
        self._restoring = False
        self._received: dict[str, Any] | None = None
        self._peer_checkpoint: _LivePeerCheckpoint | None = None  # a restarted group's fit: where it recovers from
        self._boundary: dict[str, Any] = {}  # the position entries of a checkpoint at the last step boundary
        self._in_step_with_others = False  # from on_train_start to the end of fit: every group at the same step
        self._markers: list[str] = []  # this group's claims on the directories it writes (lightning_sync.ft.outputs)
        self._own_share: _OwnShare | None = None  # the running step's batch as the loader gave it (invariant plans)
        self._in_step = False  # inside a training step's closure (forward and backward), every group in it
        #: what torchft decided so far in this group's life (see ``docs/fault_tolerance.md``)
        self.ft_report: dict[str, int] = {"committed": 0, "redone": 0, "caught_up": 0, "missing_shards": 0,
                                          "taken_over": 0, "healed": 0, "participants": 0}

    # ------------------------------------------------------------------ replica group and data

    @property
    def seed_stream_rank(self) -> int:
        """The rank this process's random streams derive from: its rank across every replica group."""
        return self.replica_group.group_id * self.world_size + self.global_rank

    @property
    def data_world_size(self) -> int:
        """The ranks the training data is split over: every replica group's."""
        return self.world_size * self.replica_group.num_groups

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        kwargs = dict(super().distributed_sampler_kwargs)
        trainer = _compat.attached_trainer(getattr(self, "lightning_module", None))
        if trainer is not None and trainer.training:
            # the training data is split across every replica group's ranks; evaluation stays in the group
            kwargs["num_replicas"], kwargs["rank"] = self.data_world_size, self.seed_stream_rank
        return kwargs

    def _sync_setup_distributed(self, create: Any) -> None:
        super()._sync_setup_distributed(create)  # (the process group of this replica group)
        lineage = self.seed_lineage
        if lineage is not None and lineage.origin == "entropy":
            _refuse(  # (a set-up error: every life of the group would draw its own seed again)
                "ddp_sync_ft: every replica group must start from the same root seed (the groups split the training "
                "data by it, and build the same model from it), but none was given, so each group drew its own. "
                f"Pass {type(self).__name__}(seed=N) or call lightning.seed_everything(N) before building the "
                "model, with the same N in every group.")
        trainer = _compat.attached_trainer(getattr(self, "lightning_module", None))
        if self._ctx is None and trainer is not None and trainer.state.fn == "fit":
            # (before the first quorum: no group waits for one that refuses)
            self._refuse_manual_optimization()
            _refuse_accumulation(trainer)
            self._ctx = replica_context(self._state_for_peer, self._load_from_peer, min_replica_size=self.min_replicas,
                                        timeout=self.ft_timeout, quorum_timeout=self.quorum_timeout,
                                        use_async_quorum=False, init_sync=False, group=self.replica_group,
                                        rank=self.global_rank, world_size=self.world_size,
                                        share_port=self._group_first if self.world_size > 1 else None)
            peer = self._peer_checkpoint
            if peer is not None and peer.outcome == "pending":
                self._join(peer)

    def _refuse_manual_optimization(self) -> None:
        """Manual optimisation (``automatic_optimization = False``) is refused at the start of ``fit``, in every group
        alike and before any quorum or step: torchft's per-step protocol lives in ``optimizer_step``, which runs the
        automatic loop's closure (``training_step`` and backward) itself, so that a step a lost group interrupted is
        run again on the same batch and the optimizer steps only if torchft commits it. Under manual optimisation the
        closure is Lightning's do-nothing one: the forward, the backward and the gradient all-reduce have already
        run in the user's ``training_step``, and a failed step could be neither run again nor held back. A set-up
        error: every life of the group would meet it again (``report_fatal``: ``lsync-ft-run`` ends the run)."""
        module = getattr(self, "lightning_module", None)
        if module is None or module.automatic_optimization:
            return
        message = (
            f"ddp_sync_ft: {type(module).__name__} sets automatic_optimization = False (manual optimisation), which "
            "ddp_sync_ft does not support: torchft commits every optimizer step through Lightning's automatic loop "
            "(the strategy runs the step's closure, training_step and backward, itself: a step a lost replica group "
            "interrupted is run again on the same batch, and the optimizer steps only if torchft commits it), while "
            "a manual training_step calls backward and optimizer.step() itself, so a failed step could be neither "
            "run again nor held back. Use automatic optimisation (leave automatic_optimization True and return the "
            f"loss from training_step), or strategy=\"{self.strategy_name.removesuffix('_ft')}\" without fault "
            "tolerance.")
        _refuse(message)

    @property
    def manager(self) -> Any:
        """torchft's ``Manager`` of this replica group (during ``fit``)."""
        if self._ctx is None:
            raise LightningSyncError("ddp_sync_ft: torchft's manager exists only while fit runs.")
        return self._ctx.manager

    # ------------------------------------------------------------------ quorum, commit, recovery

    def start_quorum(self) -> None:
        """Join the quorum of the next step (torchft's, synchronous: a group that needs recovery is sent a live
        group's state before this returns). Where the lighthouse gives no quorum within ``quorum_timeout`` (it was
        restarted: the request in flight was lost; or fewer than ``min_replicas`` groups are left), ask again, up to
        twice (``_QUORUM_RETRIES``): a lost request costs one ``quorum_timeout``, a quorum that cannot form three;
        the group keeps its state meanwhile. Where another group has finished the run meanwhile, stop."""
        from lightning_sync._compat.torchft_api import forget_failed_quorum

        manager = self.manager
        failures = 0
        while True:
            try:
                manager.start_quorum()
                break
            except TimeoutError as err:
                failures += 1
                seconds = self.quorum_timeout.total_seconds()
                if run_finished():
                    raise self._run_over("no quorum, and another group has finished the run meanwhile") from err
                if failures > _QUORUM_RETRIES:
                    raise LightningSyncError(
                        f"ddp_sync_ft: replica group {self.replica_group.group_id}: no quorum at step "
                        f"{manager.current_step()} in {failures} tries of {seconds:.0f} s (quorum_timeout): fewer "
                        f"than min_replicas={self.min_replicas} groups joined, or the lighthouse "
                        f"{self.replica_group.lighthouse} does not answer ({err}). Check that it runs and is reachable "
                        "from this machine, and how many groups are alive; raise quorum_timeout to wait longer."
                        ) from err
                log.warning("ddp_sync_ft: replica group %d, process %d: no quorum at step %d within %.0f s "
                            "(quorum_timeout): "
                            "fewer than min_replicas groups joined, or the lighthouse %s did not answer (restarted, "
                            "or unreachable); asking again (%d of %d).",
                            self.replica_group.group_id, self.global_rank, manager.current_step(), seconds,
                            self.replica_group.lighthouse, failures, _QUORUM_RETRIES)
                forget_failed_quorum(manager)
        self._quorum_open = True

    def _group_agrees(self, flag: bool) -> tuple[bool, bool]:
        """Whether every process of this group says ``flag``, and whether some does: one all-reduce over the group
        (a group of one process: its own ``flag``, no collective). Where the processes could decide apart (each
        has its own clock and its own torchft ring), they act on what they agree."""
        if self.world_size == 1:
            return flag, flag
        both = torch.tensor([float(flag), -float(flag)], device=self.root_device)
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX)
        return bool(-both[1].item() > 0.5), bool(both[0].item() > 0.5)

    def _group_first(self, value: Any) -> Any:
        """Rank 0's ``value`` on every process of this group (one broadcast; a group of one process: ``value``)."""
        return value if self.world_size == 1 else super().broadcast(value, src=0)

    def _run_over(self, why: str) -> LightningSyncError:
        """The error of a group that finds the run finished by another group (``lsync-ft-run``'s
        ``LSYNC_FT_FINISHED``): nothing is left for it to train."""
        return LightningSyncError(
            f"ddp_sync_ft: replica group {self.replica_group.group_id} (life {self.replica_group.restart}): {why}: "
            "nothing is left to train. The run's model is the finished groups'.")

    def mark_step_boundary(self, trainer: Any) -> None:
        """Keep the position entries of the checkpoint this group would write now (loops, data position, RNG
        states, LR schedulers: no tensor of the model), the step boundary a recovering group is sent by the next
        step's quorum (at that step's start, or inside it when the step is run again)."""
        boundary: dict[str, Any] = {"epoch": trainer.current_epoch, "global_step": trainer.global_step,
                                    "loops": _compat.loops_state(trainer),
                                    "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]}
        self._parts_entries(boundary)
        self._boundary = boundary

    def _parts_entries(self, checkpoint: dict[str, Any]) -> None:
        """The parts' entries of a checkpoint a recovering group is sent, this process's alone: its RNG state and
        loader position in its own slot, no gather over the group (rank ``r`` of the recovering group is sent rank
        ``r``'s checkpoint; and this runs every step, or in torchft's quorum thread)."""
        for p in self.parts:
            if isinstance(p, CheckpointStatePart):
                p.own_state(self, checkpoint)
            else:
                p.on_save_checkpoint(self, checkpoint, None)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._own_share = None
        if self._ctx is not None and not self._quorum_open:
            self.start_quorum()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._ctx is not None and len(args) >= 2:
            args = (self._share_of_quorum(args[0], int(args[1])), *args[1:])  # (batch, batch_idx, ...)
        return super().training_step(*args, **kwargs)

    def _share_of_quorum(self, batch: Any, step: int) -> Any:
        """The batch this group trains in ``step`` under the current quorum. Under an invariant plan
        (``world_size_invariant=True``) with groups missing from the quorum, the live groups split the whole
        global batch among them (participant ``p`` of ``n`` takes slice ``p`` of ``n``; its loss scale and dropout
        rows follow), so the missing groups' samples are trained in the step: loaded here, in this process. With
        every group in the quorum (again, on a step run again), the loader's batch. Otherwise unchanged (the
        missing shards are counted)."""
        invariant, uneven = self.part(WorldSizeInvariantPart), self.part(UnevenBatchPart)
        loader = invariant.loader if invariant is not None else None
        if loader is None or uneven is None:
            return batch
        if self._own_share is None:
            self._own_share = _OwnShare(batch, uneven.current, current_dropout_step())
        own = self._own_share
        manager = self.manager
        participants, participant = manager.num_participants(), manager.participating_rank()
        if participants >= self.replica_group.num_groups or participant is None or participants < 1:
            uneven.current = own.share
            if own.dropout is not None:
                own.dropout.calls.clear()  # (a step run again: the same masks from the first call)
            set_dropout_step(own.dropout)
            return own.batch
        plan = loader.plan
        # the live groups' processes split the global batch: process r of participant p is rank p * P + r of them
        world, rank = participants * self.world_size, participant * self.world_size + self.global_rank
        share = plan.share(step, world, rank)
        uneven.current = share if share.applies else None
        set_dropout_step(plan.dropout_step(step, self.seed or 0, world, rank))
        return self.batch_to_device(loader.load(plan.rows_among(step, world, rank)))

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._ctx is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        trainer = _compat.attached_trainer(getattr(self, "lightning_module", None))
        if trainer is not None:
            _refuse_accumulation(trainer)  # (again here: a GradientAccumulationScheduler changes it at an epoch)
        manager = self.manager
        rng = _collect_rng_state()
        # what a forward and self.log change outside the optimizer, put back before the step is run again
        module = self.lightning_module
        assert module is not None
        buffers = BufferSnapshot(module)
        logged = LoggedSnapshot(trainer, module) if trainer is not None else None
        failures = 0
        while True:
            if not self._quorum_open:  # a step run again: a new quorum of the groups still alive
                _restore_rng_state(rng)
                rerun_dropout_step()
                buffers.put_back()  # BatchNorm's running statistics: updated once by the step, not twice
                if logged is not None:
                    logged.put_back()  # the epoch's logged means: this step's values counted once
                healed = self.ft_report["healed"]
                self.start_quorum()
                caught_up = self.ft_report["healed"] > healed
                every, some = self._group_agrees(caught_up)
                if some and not every:
                    raise LightningSyncError(
                        f"ddp_sync_ft: replica group {self.replica_group.group_id}: some of its processes took the "
                        "live groups' state at this step and some did not (a transfer failed on one of torchft's "
                        "rings: see torchft's log lines above); the group stops so that lsync-ft-run restarts it "
                        "whole, and it recovers from a live group.")
                if caught_up:
                    # the others committed this step without this group: it took their weights and optimizer
                    # state (``_load_from_peer``); the quorum just joined is their next step's, and this one's
                    self.ft_report["caught_up"] += 1
                    return None
            self._in_step = True  # (SyncBatchNorm exchanges across groups only inside it: _rows_across_groups)
            try:
                result = closure()  # training_step + backward: the hook averages the gradients over the quorum
                if result is not None:
                    self._average_across_groups()
            finally:
                self._in_step = False
            self._quorum_open = False
            if result is None:
                raise LightningSyncError(
                    f"ddp_sync_ft: training_step returned None in replica group {self.replica_group.group_id} (a "
                    "skipped step): every group must run backward in every step, or the others wait in the gradient "
                    "all-reduce. Return a loss (multiply it by 0 to skip a batch's contribution).")
            participants = manager.num_participants()
            if manager.should_commit():
                break
            failures += 1
            self.ft_report["redone"] += 1
            if failures > self.max_step_retries:
                raise LightningSyncError(
                    f"ddp_sync_ft: replica group {self.replica_group.group_id}: step {manager.current_step()} was not "
                    f"committed {failures} times in a row (fewer than min_replicas={self.min_replicas} groups "
                    "alive, or the all-reduce keeps failing); see torchft's log lines above. Raise "
                    "max_step_retries, or lower min_replicas.")
            if self.global_rank == 0:  # (the group's processes decide alike: once a group)
                log.warning("ddp_sync_ft: replica group %d: step %d not committed (a group was lost during it); "
                            "running it again on the same batch.", self.replica_group.group_id, manager.current_step())
        self.ft_report["committed"] += 1
        self.ft_report["participants"] = participants
        missing = self.replica_group.num_groups - participants
        # under an invariant plan the live groups trained the missing groups' slices (``_share_of_quorum``)
        self.ft_report["taken_over" if self._own_share is not None else "missing_shards"] += missing
        return super().optimizer_step(optimizer, lambda: result, model, **kwargs)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Lightning's agreement on a decision (``EarlyStopping``'s stop, among others), across the replica groups of
        the current quorum too: a group that stops alone would leave the others waiting for it, or training on
        without it. ``ModelCheckpoint``'s decisions stay in the group: whether a file exists and whether the
        group's own monitored value improved are about the group's own directory (the groups would also make
        different numbers of them)."""
        decision = super().reduce_boolean_decision(decision, all=all)
        if self._ctx is None or _compat.called_from_model_checkpoint(sys._getframe(1)):
            return decision
        votes = torch.tensor([float(decision), 1.0], dtype=torch.float64)
        done = bool(self.manager.allreduce(votes, reduce_op=torch.distributed.ReduceOp.SUM).wait())
        if not self._group_agrees(done and self.manager.errored() is None)[0]:
            return decision  # a group was lost meanwhile (seen by a process of this one): the next quorum deals with it
        yes, voters = float(votes[0]), float(votes[1])
        return yes == voters if all else yes > 0

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Lightning's broadcast of a decision (``Timer``'s stop: a bool), across the replica groups too while they
        train in step: every group takes the quorum's first group's, as DDP's ranks take rank 0's. Other objects
        (paths, configs), calls outside training and ``ModelCheckpoint``'s decisions (about the group's own
        directory) stay in the group (a restarted group's set-up runs alone)."""
        obj = super().broadcast(obj, src)
        trainer = _compat.attached_trainer(getattr(self, "lightning_module", None))
        if (type(obj) is not bool or self._ctx is None or not self._in_step_with_others or trainer is None
                or trainer.sanity_checking or trainer.state.fn != "fit"
                or _compat.called_from_model_checkpoint(sys._getframe(1))):
            return obj
        decided = _from_first_group(self, torch.tensor([float(obj)], dtype=torch.float64))
        if not self._group_agrees(decided is not None)[0] or decided is None:
            return obj  # a group was lost meanwhile (seen by a process of this one): the next quorum deals with it
        return bool(decided.item() > 0.5)

    def _state_for_peer(self) -> dict[str, Any]:
        """What a recovering group is sent (torchft's quorum thread, while this group's training thread waits in
        ``start_quorum`` at a step boundary): the Lightning checkpoint this group would write now."""
        trainer = _compat.attached_trainer(getattr(self, "lightning_module", None))
        assert trainer is not None
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()  # the optimizer step's kernels are done before torchft reads the weights
        self._sending = True
        try:
            checkpoint: dict[str, Any] = _compat.dump_checkpoint(trainer)
        finally:
            self._sending = False
        if self._boundary:  # weights and optimizer state are as they were at the boundary: no step since
            checkpoint.update(self._boundary)
        else:
            self._parts_entries(checkpoint)
        # the run's counts go on in the recovering group
        checkpoint[_REPORT_KEY] = {k: self.ft_report[k] for k in ("missing_shards", "taken_over")}
        return checkpoint

    def _load_from_peer(self, checkpoint: dict[str, Any]) -> None:
        self.ft_report["healed"] += 1
        if self._restoring:  # a restarted group's fit: Lightning restores it as a file (``load_checkpoint``)
            self._received = checkpoint
            return
        # A group in the run that fell behind by one step (the others committed a step it did not): its loops and
        # data are at the same batch as the others', only its weights and optimizer state are behind.
        module = self.lightning_module
        assert module is not None
        trainer = _compat.attached_trainer(module)
        behind = None if trainer is None else int(checkpoint.get("global_step", -1)) - trainer.global_step
        if behind != 1:
            raise LightningSyncError(
                f"ddp_sync_ft: replica group {self.replica_group.group_id} is {behind} steps from the live groups "
                "(1 is all a running group can catch up from: a step the others committed without it); its loops "
                "and data cannot follow. Restart the group (lsync-ft-run restarts it when it exits).")
        self._load_weights_and_optimizers(checkpoint)

    def _load_weights_and_optimizers(self, checkpoint: dict[str, Any]) -> None:
        """A live group's weights and optimizer states, as ``_state_for_peer`` sent them, into this group's."""
        module = self.lightning_module
        assert module is not None
        trainer = _compat.attached_trainer(module)
        module.load_state_dict(checkpoint["state_dict"])
        for optimizer, state in zip(trainer.optimizers if trainer is not None else (), checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)

    def _average_across_groups(self) -> None:
        """The step's gradients averaged over the quorum's groups, after the closure (where the group's strategy
        has not done it during the backward)."""

    def _join(self, peer: _LivePeerCheckpoint) -> None:
        """Before Lightning restores anything (``fit`` without ``ckpt_path``), join the first quorum: a group whose
        peers are ahead (it was restarted, or started late) is sent a live group's checkpoint at that step
        boundary, which Lightning then restores as it restores a file (``ckpt_path`` is ``peer``). At the run's
        start, the groups wait for each other (up to ``quorum_timeout``) so that none trains alone meanwhile."""
        manager = self.manager
        deadline = time.monotonic() + self.quorum_timeout.total_seconds()
        self._restoring = True
        try:
            self.start_quorum()
            if (self._received is None and self.replica_group.restart > 0 and manager.current_step() == 0
                    and manager.num_participants() < self.replica_group.num_groups):
                rank_zero_info(f"ddp_sync_ft: replica group {self.replica_group.group_id} (life "
                               f"{self.replica_group.restart}) found no live group ahead of it; waiting up to "
                               f"{self.quorum_timeout.total_seconds():.0f} s (quorum_timeout) for one.")
            while True:
                waiting = (self._received is None and manager.current_step() == 0
                           and manager.num_participants() < self.replica_group.num_groups
                           and time.monotonic() < deadline)
                over = waiting and self.replica_group.restart > 0 and run_finished()  # (not restarted then)
                # one decision for the group's processes (rank 0's clock): they ask for each quorum together
                waiting, over = self._group_first((waiting, over))
                if over:
                    raise self._run_over("the run finished while this group was restarting (another group ended "
                                         "its fit); no live group to recover from")
                if not waiting:
                    break
                time.sleep(0.2)  # every group of this quorum sees the same count: all of them ask again
                self.start_quorum()
        finally:
            self._restoring = False
        group = f"replica group {self.replica_group.group_id} (life {self.replica_group.restart})"
        if self._received is None and manager.errored() is not None:
            raise LightningSyncError(
                f"ddp_sync_ft: {group}: recovering from a live group failed ({manager.errored()}); it does not start "
                f"from the beginning instead. Raise {type(self).__name__}(timeout=...) if the transfer timed out.")
        if (self._received is None and self.replica_group.restart > 0
                and manager.num_participants() < self.replica_group.num_groups):
            raise LightningSyncError(
                f"ddp_sync_ft: {group} was restarted, but no live replica group is ahead of it to recover from "
                f"({manager.num_participants()} of {self.replica_group.num_groups} groups in the quorum, all at step "
                "0): the others ended or were lost too. Start the run again from a checkpoint "
                "(trainer.fit(..., ckpt_path=...) in every group).")
        peer.outcome = "received" if self._received is not None else "none"
        if self._received is not None:
            rank_zero_info(f"ddp_sync_ft: {group} recovers from a live group at step {manager.current_step()} "
                           f"(global step {self._received.get('global_step')}).")
        elif manager.num_participants() < self.replica_group.num_groups:
            planned = self.part(WorldSizeInvariantPart) is not None
            log.warning("ddp_sync_ft: %s starts with %d of %d replica groups (the others did not join within "
                        "quorum_timeout); %s until they join.", group, manager.num_participants(),
                        self.replica_group.num_groups, "the live groups split each global batch" if planned else
                        "their data shards are not trained")

    def _read_checkpoint(self, checkpoint_path: PathLike, weights_only: bool | None) -> dict[str, Any]:
        if not isinstance(checkpoint_path, _LivePeerCheckpoint):
            return super()._read_checkpoint(checkpoint_path, weights_only)
        received, self._received = self._received, None
        if received is None:
            raise LightningSyncError(
                f"ddp_sync_ft: replica group {self.replica_group.group_id} was to recover from a live group, but its "
                "fit did not join the first quorum (the strategy was set up outside fit?).")
        counts = received.get(_REPORT_KEY, {})
        for key in ("missing_shards", "taken_over"):
            self.ft_report[key] = int(counts.get(key, 0))
        entry = received.get(CHECKPOINT_KEY)
        if isinstance(entry, dict):  # the RNG states are the sender's: this group derives streams of its own
            entry["new_streams"] = True
            entry["rng_states"] = []
        trainer = _compat.attached_trainer(getattr(self, "lightning_module", None))
        if trainer is not None:  # the sender's ModelCheckpoint paths name its directory: this group's own instead
            own_checkpoint_paths(trainer, received)
        self._restore_from_peer(received)
        return received

    def _restore_from_peer(self, checkpoint: dict[str, Any]) -> None:
        """What Lightning does not restore itself from a live group's checkpoint (``_read_checkpoint``): nothing
        under DDP (it loads the weights and optimizer states as from a file)."""

    def teardown(self) -> None:
        ctx, self._ctx = self._ctx, None
        self._quorum_open = False
        self._in_step_with_others = False
        markers, self._markers = self._markers, []
        release_output_dirs(markers)
        try:
            super().teardown()
        finally:
            for part in self.parts:
                if isinstance(part, _FaultTolerancePart):
                    part.release_exchange()  # (also where the parts' own teardown did not run)
            if ctx is not None:
                report = self.ft_report
                rank_zero_info(
                    f"ddp_sync_ft: replica group {self.replica_group.group_id} (life {self.replica_group.restart}): "
                    f"{report['committed']} steps committed, {report['redone']} run again after a failed commit, "
                    f"{report['missing_shards']} data shards of missing groups not trained"
                    f"{', ' + str(report['taken_over']) + ' trained by the live groups' if report['taken_over'] else ''}"
                    f", recovered from a live group {report['healed']} time(s).")
                ctx.close()


class FaultTolerantDDPStrategy(_FaultTolerance, SyncDDPStrategy):
    """``SyncDDPStrategy`` in each replica group, and torchft across the groups: a lost group stops nothing
    (the others go on at the next step) and a restarted one resumes from a live group. Run under
    ``lsync-ft-run --replicas R -- python train.py`` with ``Trainer(strategy="ddp_sync_ft", devices=1)``, or with
    ``P`` processes a group, ``lsync-ft-run --replicas R --nproc-per-replica P -- python train.py`` with
    ``devices=P``.

    Accepts every :class:`~lightning_sync.SyncDDPStrategy` argument (a ``seed`` every group knows is required:
    pass ``seed=`` or call ``seed_everything``), plus:

    Args:
        min_replicas: the fewest groups a step may commit with (default: ``lsync-ft-run --min-replicas``, 1: one
            survivor trains on; the number of groups: every step waits for a lost group's replacement). A step
            with groups missing skips their data shards (counted), except with ``world_size_invariant=True``,
            where the live groups split the whole global batch among them: nothing is skipped.
        timeout: seconds torchft waits for an all-reduce, a commit or a recovery (default 30).
        quorum_timeout: seconds a step boundary waits for a quorum (default 120).
        max_step_retries: how many times in a row a step that is not committed is run again before the run
            stops with an error (default 10).
    """

    strategy_name = "ddp_sync_ft"

    def __init__(self, *args: Any, min_replicas: int | None = None, timeout: float = 30.0,
                 quorum_timeout: float = 120.0, max_step_retries: int = 10, **kwargs: Any) -> None:
        if kwargs.get("static_graph") or kwargs.get("find_unused_parameters") is False:
            raise ValueError(
                "FaultTolerantDDPStrategy: DDP must keep its first gradient bucket layout (a recovering group's "
                "buckets are summed element by element with the others'), which it does only with "
                "find_unused_parameters=True and static_graph=False (torchft's DDP does the same): drop those "
                "arguments.")
        kwargs["find_unused_parameters"] = True
        super().__init__(*args, min_replicas=min_replicas, timeout=timeout, quorum_timeout=quorum_timeout,
                         max_step_retries=max_step_retries, **kwargs)

    def configure_ddp(self) -> None:
        super().configure_ddp()
        if self._ctx is None or self.model is None:
            return
        model: Any = self.model  # DistributedDataParallel
        try:
            model.register_comm_hook(self, _replica_allreduce_hook)
        except RuntimeError as err:
            raise LightningSyncError(
                f"ddp_sync_ft averages gradients across replica groups in DDP's communication hook, but the model "
                f"has one already ({err}). Drop DDPStrategy(ddp_comm_hook=...) under ddp_sync_ft.") from err
        # DDP's broadcast of rank 0's buffers before a training forward (BatchNorm's running statistics): across
        # the groups, from the quorum's first one, at the same points (none where broadcast_buffers=False)
        register_buffer_sync_hook(model, self, _replica_buffer_broadcast)


class FaultTolerantModelParallelStrategy(_FaultTolerance, SyncModelParallelStrategy):
    """``SyncModelParallelStrategy`` (FSDP2: ``fully_shard`` in ``configure_model``) in each replica group, and
    torchft across the groups, as :class:`FaultTolerantDDPStrategy` does it for DDP. Run under
    ``lsync-ft-run --replicas R --nproc-per-replica P -- python train.py`` with
    ``Trainer(strategy="model_parallel_sync_ft", devices=P)``.

    Process ``r`` of every group holds shard ``r`` of the weights, the gradients and the optimizer state (the
    groups have the same number of processes and shard alike). After the backward (FSDP2's reduce-scatter: the
    mean over the group), each process averages its gradient shards with process ``r`` of the quorum's other
    groups, over torchft's process group; a restarted group's process ``r`` is sent process ``r``'s shards of a
    live group (nothing is gathered, no file is read).

    Accepts every :class:`~lightning_sync.SyncModelParallelStrategy` argument (``tensor_parallel_size`` 1 only:
    FSDP2 over the group's processes), and ``min_replicas``, ``timeout``, ``quorum_timeout`` and
    ``max_step_retries`` as :class:`FaultTolerantDDPStrategy` documents them, plus:

    Args:
        bucket_cap_mb: the most megabytes of gradient shards a process sends across the groups in one all-reduce
            (default 25, DDP's default bucket; a larger shard goes alone). Two buckets are in flight at most: the
            memory this costs is at most twice the larger of that and the largest gradient shard, whatever the
            model's size.

    ``timeout`` is torchft's (seconds), as under :class:`FaultTolerantDDPStrategy`: the group's own process group
    keeps Lightning's default timeout. ``on_after_backward`` sees the gradients averaged over the group (FSDP2's
    reduce-scatter); they are averaged across the groups after the closure, before gradient clipping and
    ``on_before_optimizer_step``.
    """

    strategy_name = "model_parallel_sync_ft"

    def __init__(self, data_parallel_size: Literal["auto"] | int = "auto",
                 tensor_parallel_size: Literal["auto"] | int = "auto", *args: Any, min_replicas: int | None = None,
                 timeout: float = 30.0, quorum_timeout: float = 120.0, max_step_retries: int = 10,
                 bucket_cap_mb: float = 25.0, **kwargs: Any) -> None:
        if tensor_parallel_size not in ("auto", 1):
            raise ValueError(
                f"FaultTolerantModelParallelStrategy(tensor_parallel_size={tensor_parallel_size!r}): tensor "
                "parallelism inside a replica group is not supported yet (FSDP2 over the group's processes is): "
                "leave it \"auto\" or 1.")
        if not bucket_cap_mb > 0:
            raise ValueError(f"FaultTolerantModelParallelStrategy(bucket_cap_mb={bucket_cap_mb}): more than 0.")
        self.bucket_cap_mb = float(bucket_cap_mb)
        super().__init__(data_parallel_size, 1, *args, min_replicas=min_replicas, timeout=timeout,
                         quorum_timeout=quorum_timeout, max_step_retries=max_step_retries, **kwargs)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._sending:
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.model is not None  # this process's shards, whatever save_distributed_checkpoint says
        state: dict[str, Any] = _local_shards(get_model_state_dict(self.model,
                                                                   options=StateDictOptions(full_state_dict=False)))
        return state

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if not self._sending:
            return super().optimizer_state(optimizer)
        from lightning.pytorch.core.optimizer import LightningOptimizer
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        assert self.model is not None
        state = get_optimizer_state_dict(self.model, optimizer, options=StateDictOptions(full_state_dict=False))
        shards: dict[str, Any] = _local_shards(state)
        return shards

    def _restore_from_peer(self, checkpoint: dict[str, Any]) -> None:
        # (Lightning's ModelParallelStrategy loads the weights and optimizer states while it reads a checkpoint
        # directory, and does nothing when it is handed the checkpoint's entries)
        self._load_weights_and_optimizers(checkpoint)

    def _load_weights_and_optimizers(self, checkpoint: dict[str, Any]) -> None:
        """A live group's process ``r``'s shards (``_state_for_peer``) into this process's, shard for shard."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        module = self.lightning_module
        assert module is not None and self.model is not None
        trainer = _compat.attached_trainer(module)
        options = StateDictOptions(full_state_dict=False, strict=module.strict_loading)
        own = get_model_state_dict(self.model, options=options)
        set_model_state_dict(self.model, {k: _as_shard_of(v, own.get(k)) for k, v in checkpoint["state_dict"].items()},
                             options=options)
        # (the optimizer state's names are the state dict's: without torch.compile's or activation
        # checkpointing's wrapper prefixes, which named_parameters keeps)
        for optimizer, state in zip(trainer.optimizers if trainer is not None else (), checkpoint["optimizer_states"]):
            shards = {"state": {name: {k: _as_shard_of(v, own.get(name)) for k, v in entries.items()}
                                for name, entries in state["state"].items()},
                      "param_groups": state["param_groups"]}
            set_optimizer_state_dict(self.model, optimizer, shards, options=options)

    def _average_across_groups(self) -> None:
        """Each gradient shard of this process averaged with process ``r``'s of the quorum's other groups: flat
        buckets of ``bucket_cap_mb`` (the parameters in order, every group alike), two in flight at most. Each
        bucket ends with a flag a parameter (1: it has a gradient in this group); a parameter without a gradient
        here sends zeros, and takes the mean, zeros included, where some group's flag says it had one: one decision
        for every process of every group (FSDP2 gives a group's processes the same gradients or none), as DDP
        decides a globally unused parameter."""
        ctx = self._ctx
        assert ctx is not None and self.model is not None
        cap = max(1, int(self.bucket_cap_mb * 2**20))
        pending: collections.deque[tuple[list[_GradShard], torch.Tensor, Any]] = collections.deque()
        for bucket in _gradient_buckets(self.model, cap):
            if len(pending) == 2:  # (two flat buckets at most: the oldest put back before the next is made)
                _put_back(*pending.popleft())
            used = torch.tensor([float(shard.local is not None) for shard in bucket], dtype=bucket[0].dtype,
                                device=bucket[0].device)
            flat = torch.cat([*(shard.flat() for shard in bucket), used])
            pending.append((bucket, flat, ctx.allreduce_mean(flat)))
        while pending:
            _put_back(*pending.popleft())


class _FaultTolerancePart(Part):
    """The strategy's steps Lightning has no strategy hook for: the next quorum after a committed step, the
    counts logged, and a restarted group's ``fit`` pointed at a live group."""

    def __init__(self, strategy: _FaultTolerance) -> None:
        self._strategy = strategy
        self._exchange: Any = False  # the SyncBatchNorm exchange set before this fit set its own (False: none set)

    def callbacks(self, strategy: Any) -> tuple[Any, ...]:
        return (_StepBoundary(self._strategy),)

    def setup(self, strategy: Any, trainer: Any) -> None:
        module = strategy.lightning_module
        groups = self._strategy.replica_group.num_groups
        if module is None or groups < 2 or trainer is None or trainer.state.fn != "fit":
            return
        synced = any(isinstance(m, SyncBatchNorm) for m in module.modules())
        if synced and self._exchange is False:  # sync_batchnorm=True: over every live group's rows, not the group's
            self._exchange = exchange_across(functools.partial(_rows_across_groups, self._strategy))
        norms = [name for name, m in module.named_modules() if isinstance(m, BatchNormBase)
                 and not isinstance(m, SyncBatchNorm) and m.training]
        if norms:
            invariant = self._strategy.part(WorldSizeInvariantPart) is not None
            sharded = isinstance(self._strategy, FaultTolerantModelParallelStrategy)
            fix = (". Lightning's ModelParallelStrategy ignores Trainer(sync_batchnorm=True) (and FSDP2 synchronises "
                   "no buffer): use a normalisation without batch statistics (LayerNorm, GroupNorm), or "
                   "strategy=\"ddp_sync_ft\" with sync_batchnorm=True" if sharded else
                   ". Pass Trainer(sync_batchnorm=True): under ddp_sync_ft it synchronises them over every live "
                   "replica group's processes (lightning_sync.SyncBatchNorm; a layer left out of the conversion stays "
                   "as it is)")
            rank_zero_warn(
                f"{self._strategy.strategy_name}: BatchNorm layers {', '.join(norms[:5])}"
                f"{', ...' if len(norms) > 5 else ''} compute "
                "their batch statistics over this process's own rows (torch's SyncBatchNorm: over its replica "
                "group's), not every replica group's, so training depends on how many groups take part in a step"
                + (", and world_size_invariant=True does not give the one-process model" if invariant else "")
                + fix + ".")

    def after_teardown(self, strategy: Any) -> None:
        self.release_exchange()

    def release_exchange(self) -> None:
        """Put back the SyncBatchNorm exchange set before this fit (none, as a rule)."""
        if self._exchange is not False:
            exchange_across(self._exchange)
            self._exchange = False

    def on_train_start(self, strategy: Any, trainer: Any) -> None:
        if self._strategy._ctx is not None and trainer is not None:
            # each group saves as rank 0: none may write where another group of the run writes (an error here,
            # that ends the run under lsync-ft-run: every life of this group would meet it again)
            try:
                self._strategy._markers = claim_output_dirs(output_dirs(trainer),
                                                            self._strategy.replica_group.group_id, run_key())
            except LightningSyncError as err:
                report_fatal(str(err))
                raise
            self._strategy.mark_step_boundary(trainer)  # (restored, or at the start: the first step's boundary)
            self._strategy._in_step_with_others = True

    def configure_launcher(self, strategy: Any) -> None:
        _recover_from_peer(self._strategy)  # (under torchrun too: _compat.ensure_launcher)


def _recover_from_peer(strategy: _FaultTolerance) -> None:
    """``fit`` without ``ckpt_path`` takes the checkpoint of a live group ahead of this one, if any (``FT_PEER``)."""
    from lightning_sync.resume.auto import fill_fit_ckpt_path

    def live_peer(trainer: Any) -> _LivePeerCheckpoint:
        strategy._peer_checkpoint = _LivePeerCheckpoint(FT_PEER)
        return strategy._peer_checkpoint

    fill_fit_ckpt_path(_compat.ensure_launcher(strategy), live_peer)


class _StepBoundary(pl.Callback):
    def __init__(self, strategy: _FaultTolerance) -> None:
        self._strategy = strategy
        self._logged: tuple[int, int] | None = None  # the counts last logged

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        strategy = self._strategy
        if strategy._ctx is None:
            return
        report = strategy.ft_report
        counts = (report["participants"], report["missing_shards"])
        if counts != self._logged or trainer.global_step % max(1, trainer.log_every_n_steps) == 0:
            # (a log call costs Lightning's bookkeeping: logged where the logger writes, and whenever they change)
            self._logged = counts
            pl_module.log("ft/participants", float(counts[0]), on_step=True, on_epoch=False)
            pl_module.log("ft/missing_shards", float(counts[1]), on_step=True, on_epoch=False)
        # where a checkpoint of this step would be written: a group recovering from this one at the next step's
        # quorum (at its start, after every hook of this one) is sent this position with the weights it has then
        strategy.mark_step_boundary(trainer)


def _refuse(message: str) -> NoReturn:
    """A set-up error of ``ddp_sync_ft``, which every life of the group would meet again: ``lsync-ft-run`` is told not
    to restart the group (``report_fatal``), then the error is raised."""
    report_fatal(message)
    raise LightningSyncError(message)


def _refuse_accumulation(trainer: Any) -> None:
    if trainer.accumulate_grad_batches != 1:
        _refuse(f"ddp_sync_ft: accumulate_grad_batches={trainer.accumulate_grad_batches} is not supported yet "
                "(torchft commits every optimizer step); pass a larger batch instead, or use strategy=\"ddp_sync\".")


def _replica_allreduce_hook(strategy: FaultTolerantDDPStrategy, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP's gradient bucket averaged over the replica groups of this step's quorum: over the group's processes
    first (DDP's own all-reduce, where the group has several), then across the groups (torchft's process group,
    between the processes of one rank in every group), so each bucket ends as the mean over every live process.

    The all-reduce across the groups is not waited for here: DDP goes on with the backward while the bucket
    crosses the groups and waits for every bucket at the end of it, as under ``ddp``. A failure of it (a group
    lost in the middle) completes the future all the same and surfaces where it belongs, in ``should_commit``
    (``ReplicaContext.allreduce_mean``)."""
    buffer = bucket.buffer()
    if strategy.world_size > 1:
        group: Any = torch.distributed.group.WORLD  # (the group's processes: DDP's own process group)
        allreduce_hook(group, bucket).wait()  # (their mean, in place: DDP's default hook)
    ctx = strategy._ctx
    assert ctx is not None
    future: torch.futures.Future[torch.Tensor] = ctx.allreduce_mean(buffer)
    return future


@dataclass
class _OwnShare:
    """A step's batch, loss share and dropout rows as the invariant loader gave them (this group's slice of the
    global batch among every group), kept while the step may be run again under another quorum."""

    batch: Any
    share: StepShare | None
    dropout: DropoutStep | None


def _from_first_group(strategy: _FaultTolerance, tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` as the current quorum's first group holds it, on every group (a broadcast made of one torchft
    all-reduce: the first group sends its values, the others zeros, summed); ``None`` where the quorum failed
    meanwhile (the caller keeps its own value: the step is not committed, and the next quorum deals with it)."""
    manager = strategy.manager
    if manager.participating_rank() != 0:
        tensor = torch.zeros_like(tensor)
    manager.allreduce(tensor, reduce_op=torch.distributed.ReduceOp.SUM).wait()
    return None if manager.errored() is not None else tensor


def _rows_across_groups(strategy: _FaultTolerance, rows: torch.Tensor) -> torch.Tensor:
    """A ``SyncBatchNorm`` exchange's rows (one per process of this group) and every other live group's, in the order
    of the quorum (participant ``p``'s rows at ``p``): one torchft all-reduce of a zero tensor each group writes its
    rows into (a sum with zeros: exact). Only inside a training step's forward and backward, which every group of
    the quorum runs (not in a hook around it: a restarted group runs ``on_train_epoch_start`` alone); where the
    quorum fails meanwhile, this group's rows (the step is not committed and is run again)."""
    if strategy._ctx is None or not strategy._in_step:
        return rows
    manager = strategy.manager
    participants, participant = manager.num_participants(), manager.participating_rank()
    if participants <= 1:
        return rows
    k = rows.shape[0]
    wire = rows.new_zeros((participants * k, *rows.shape[1:]))
    if participant is not None:
        wire[participant * k:(participant + 1) * k] = rows
    manager.allreduce(wire, reduce_op=torch.distributed.ReduceOp.SUM).wait()
    if manager.errored() is not None or participant is None:
        return rows
    return wire


def _replica_buffer_broadcast(strategy: FaultTolerantDDPStrategy, buffers: dict[str, torch.Tensor]) -> None:
    """DDP's buffer sync, where DDP makes it (before a training forward, and before the first evaluation forward
    after training): inside the group, rank 0's buffers to every process (DDP's own broadcast, where the group has
    several); then across the replica groups of the current quorum, every group takes the buffers of the quorum's
    first group, as DDP's ranks take rank 0's. One torchft all-reduce of the buffers' bytes (the first group sends
    them, the others zeros: the byte-wise sum is the first group's bytes, whatever the dtypes); where the quorum
    fails meanwhile, the buffers are the group's (the step is not committed and is run again)."""
    if not buffers:
        return
    trainer = _compat.attached_trainer(getattr(strategy, "lightning_module", None))
    # (a restarted group's sanity check runs alone: the others are training)
    across = strategy._ctx is not None and trainer is not None and not trainer.sanity_checking
    if strategy.world_size == 1 and not across:
        return
    tensors = list(buffers.values())
    views = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    wire = torch.cat(views)  # bytes: one collective whatever the dtypes
    if strategy.world_size > 1:
        torch.distributed.broadcast(wire, src=0)
    decided = _from_first_group(strategy, wire) if across else None
    if decided is not None:
        wire = decided
    offset = 0
    for t, v in zip(tensors, views):
        t.copy_(wire[offset:offset + v.numel()].clone().view(t.dtype).view(t.shape))  # (clone: aligned for t.dtype)
        offset += v.numel()


def _local_shards(tree: Any) -> Any:
    """``tree`` (a state dict) with each DTensor replaced by this process's shard of it, a plain tensor: torchft's
    transport sends a DTensor's device mesh with it, which the receiving process has its own of."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return tree.to_local().detach()
    if isinstance(tree, dict):
        return {k: _local_shards(v) for k, v in tree.items()}
    if type(tree) in (list, tuple):
        return type(tree)(_local_shards(v) for v in tree)
    return tree


def _as_shard_of(value: Any, like: Any) -> Any:
    """``value`` (a shard process ``r`` of a live group sent) laid out as ``like`` is (this process's DTensor of the
    same name: a parameter, or its entry in the state dict), where ``like`` is one and its shard has ``value``'s
    shape; otherwise ``value`` (a buffer, an optimizer's step count)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    local = like.to_local().detach()
    if value.dim() == 0 or value.shape != local.shape:
        return value
    return DTensor.from_local(value.to(local.device), like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


@dataclass
class _GradShard:
    """A parameter's gradient shard on this process (``local``: ``None`` where it has no gradient in this step)."""

    param: Any
    local: torch.Tensor | None
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def flat(self) -> torch.Tensor:
        if self.local is None:
            return torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        return self.local.reshape(-1)


def _gradient_buckets(model: torch.nn.Module, cap: int) -> Iterator[list[_GradShard]]:
    """The trainable parameters' gradient shards in order, in buckets of at most ``cap`` bytes (one dtype and
    device a bucket; a larger shard alone)."""
    from torch.distributed.tensor import DTensor

    bucket: list[_GradShard] = []
    size, key = 0, None
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                continue
            mine: torch.Tensor = p.to_local() if isinstance(p, DTensor) else p
            grad = p.grad
            local: torch.Tensor | None = grad.to_local() if isinstance(grad, DTensor) else grad
            shard = _GradShard(p, local, mine.shape, mine.dtype, mine.device)
            nbytes = shard.numel * mine.element_size()
            if bucket and ((mine.dtype, mine.device) != key or size + nbytes > cap):
                yield bucket
                bucket, size = [], 0
            bucket.append(shard)
            size, key = size + nbytes, (mine.dtype, mine.device)
    if bucket:
        yield bucket


def _put_back(bucket: list[_GradShard], flat: torch.Tensor, averaged: Any) -> None:
    """A bucket's mean over the groups (``averaged``: ``ReplicaContext.allreduce_mean``'s future) into the
    gradients it was made of."""
    from torch.distributed.tensor import DTensor

    averaged.wait()
    offset = 0
    # the flags after the gradients: read only where this group has a parameter without a gradient (a host sync)
    used = flat[-len(bucket):].tolist() if any(shard.local is None for shard in bucket) else None
    with torch.no_grad():
        for i, shard in enumerate(bucket):
            mean = flat[offset:offset + shard.numel].view(shard.shape)
            offset += shard.numel
            if shard.local is not None:
                shard.local.copy_(mean)
            elif used is not None and used[i] > 0:  # (a parameter unused here, used by another group: rare)
                p = shard.param
                p.grad = (DTensor.from_local(mean.clone(), p.device_mesh, p.placements, run_check=False,
                                             shape=p.shape, stride=p.stride())
                          if isinstance(p, DTensor) else mean.clone())


# DDP compares the hook's annotations with the objects themselves (this module's are strings)
_replica_allreduce_hook.__annotations__.update(bucket=getattr(torch.distributed, "GradBucket"),
                                               **{"return": torch.futures.Future[torch.Tensor]})


def register(strategy_registry: Any) -> None:
    """Register ``"ddp_sync_ft"`` and ``"model_parallel_sync_ft"`` (idempotent; torchft is needed only when the
    strategy is built)."""
    if "ddp_sync_ft" not in strategy_registry:
        strategy_registry.register("ddp_sync_ft", FaultTolerantDDPStrategy, start_method="popen",
                                   description="ddp_sync in each replica group, torchft across groups (lsync-ft-run)")
    if "model_parallel_sync_ft" not in strategy_registry:
        strategy_registry.register("model_parallel_sync_ft", FaultTolerantModelParallelStrategy,
                                   description="model_parallel_sync (FSDP2) in each replica group, torchft across "
                                               "groups (lsync-ft-run)")
