"""``SyncDDPStrategy``: Lightning's DDP plus explicit, checked synchronisation.

Registered as ``"ddp_sync"`` (Lightning's subprocess launcher, torchrun, SLURM), ``"ddp_sync_spawn"``
and ``"ddp_sync_notebook"`` (forked ranks: Jupyter) by ``import lightning_sync``.
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_sync._compat import lightning_api as _compat
from lightning_sync._compat.lightning_api import PathLike, StrategyRegistryType
from lightning_sync.callbacks.batchnorm import portable_layer_sync
from lightning_sync.checkpoint_io import AtomicCheckpointIO
from lightning_sync.collectives import _device_barrier, check_same_layout, validate_seed
from lightning_sync.errors import UnevenEvaluationError
from lightning_sync.guard.core import CollectiveGuard
from lightning_sync.guard.nccl import configure_nccl_flight_recorder
from lightning_sync.sampling import ExactEvaluation, evaluation_limit, exact_eval_dataloader, is_integer_mean
from lightning_sync.peers import Peer, gather_peers, lost_peer_message
from lightning_sync.preemption import DeferredRequeue
from lightning_sync.resume import ResumeHooks, init_process_group_after_restart, make_resumable
from lightning_sync.seeding import CHECKPOINT_KEY, SeedLineage, WorkerSeeder
from lightning_sync.strategy_callbacks import install_first

__all__ = ["SyncDDPStrategy"]

log = logging.getLogger(__name__)

_ALL_GATHER_FIX = (
    "Under ddp_sync every evaluation sample is evaluated once (no padding), so the ranks' last batches can "
    "differ in size. Gather rows with lightning_sync.collectives.all_gather_uneven(tensor) (every rank's rows "
    "concatenated in rank order, and each rank's row count), collect per-sample outputs with "
    "lightning_sync.ValidationGather, or pass SyncDDPStrategy(exact_eval=False) for Lightning's padded sampler "
    "(equal batches, some samples twice).")


class SyncDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with a broadcast root seed, seed lineage and clean teardown.

    Accepts every :class:`~lightning.pytorch.strategies.DDPStrategy` argument, plus:

    Args:
        seed: the root seed (rank 0's value wins). ``None``: rank 0's ``seed_everything`` seed if
            it called one, else a fresh seed from OS entropy on rank 0; either way it is broadcast.
        guard: check every collective across ranks before it runs, and the classic DDP mistakes
            (see ``docs/guard.md``). ``False`` turns it off; a :class:`~lightning_sync.CollectiveGuard`
            sets its options.
        guard_timeout: seconds without progress (a rank missing from a collective, a frozen rank)
            before the guard raises (default 120; sets the guard object's ``timeout``, not a
            ``hang_timeout`` set on it).
        uneven_batches: what to do when ranks have different numbers of training batches (a rank
            with more would hang in DDP's all-reduce): ``"error"`` raises at epoch start;
            ``"stop_together"`` ends every rank's epoch when the shortest rank runs out.
        exact_eval: evaluate every sample of validate, test, fit's validation and predict on exactly
            one rank, once (no padding), in equal step counts wherever possible, and reduce
            ``self.log(..., sync_dist=True)`` epoch means exactly (see ``lightning_sync.sampling``).
            ``False``: Lightning's padded ``DistributedSampler``.
        resume: ``"auto"``: when ``fit`` gets no ``ckpt_path``, resume from the newest checkpoint of
            the run that loads completely (after an elastic restart or a requeue); a directory: search
            there. ``None`` (default): only ``ckpt_path``. See ``docs/resume.md``.

    After set-up, ``trainer.strategy.seed`` is the root seed, identical on every rank. Samplers use
    it (disjoint, complete shards), layers built in ``setup``/``configure_model`` are initialised under
    it (identical on every rank from the start; a model built before ``fit`` becomes identical when
    DDP's wrap broadcasts rank 0's weights), then every rank's RNGs switch to their own derived
    stream (dropout and augmentation differ across ranks and workers). Per-rank RNG states are
    saved in checkpoints and restored on resume.
    """

    strategy_name = "ddp_sync"

    def __init__(self, *args: Any, seed: int | None = None, guard: bool | CollectiveGuard = True,
                 guard_timeout: float | None = None, uneven_batches: str = "error", resume: str | None = None,
                 exact_eval: bool = True,
                 **kwargs: Any) -> None:
        validate_seed(seed, "SyncDDPStrategy(seed=...)")
        if resume is not None and not isinstance(resume, str):
            raise TypeError(f"SyncDDPStrategy(resume={resume!r}): use None, 'auto' or a directory path.")
        if uneven_batches not in ("error", "stop_together"):
            raise ValueError(f"SyncDDPStrategy(uneven_batches={uneven_batches!r}): use 'error' or 'stop_together'.")
        super().__init__(*args, **kwargs)
        self._seed_arg = seed
        self._guard: CollectiveGuard | None = (
            guard if isinstance(guard, CollectiveGuard) else CollectiveGuard() if guard else None)
        if self._guard is not None and guard_timeout is not None:
            # hang_timeout follows timeout unless the user set it on their own guard
            self._guard.timeout = CollectiveGuard(timeout=guard_timeout).timeout
        self.uneven_batches = uneven_batches
        self.exact_eval = bool(exact_eval)
        self._exact_eval = ExactEvaluation() if exact_eval else None
        self._lineage: SeedLineage | None = None
        self._pending_checkpoint_state: dict[str, Any] | None = None
        self._failed = False
        self._peers: list[Peer] = []
        self._resume_arg = resume
        self._resume = ResumeHooks()
        self._requeue = DeferredRequeue()  # SLURM's requeue signal handled at a step boundary
        self._quiet_warning: Any = None
        self._kept_group = False  # its last teardown kept the process group for the next call

    @property
    def seed(self) -> int | None:
        """The root seed every rank agreed on (``None`` before the process group is set up)."""
        return self._lineage.root if self._lineage is not None else None

    def _adopt_root(self, root: int) -> None:
        """In the launching process of spawned/forked ranks: the root seed rank 0 agreed on (its next
        ``fit``/``validate`` agrees on it again)."""
        if self._lineage is None or self._lineage.root != root:
            self._lineage = SeedLineage(root=root, world_size=self.world_size, origin="rank 0 of the last run",
                                        local_seeds=[root])

    @property
    def seed_lineage(self) -> SeedLineage | None:
        """How every stream of this run derives from the root seed."""
        return self._lineage

    # ------------------------------------------------------------------ set-up

    @property
    def guard(self) -> CollectiveGuard | None:
        """The collective guard (``None`` when turned off)."""
        return self._guard

    @override
    def setup_distributed(self) -> None:
        if self._guard is not None and _compat.process_group_backend(self) == "nccl":
            configure_nccl_flight_recorder()  # read by NCCL at process-group creation: set it first
        init_process_group_after_restart(_compat.process_group_backend(self), _compat.process_group_timeout(self),
                                         self.root_device if self.root_device.type != "cpu" else None)
        existed = dist.is_available() and dist.is_initialized()
        super().setup_distributed()
        # The group this strategy kept at its last teardown (fit, then validate/test/predict): the ranks'
        # hosts and the root seed were agreed on it already. (No reference to the group object is held:
        # it would keep a destroyed group's store serving stale rendezvous keys on MASTER_PORT.)
        same_group = existed and self._kept_group and self._lineage is not None
        self._kept_group = False
        if not same_group:
            self._peers = gather_peers()  # host and address per rank: names a lost peer (on_exception)
        if self._guard is not None and not self._guard.install_if_real(
                context=lambda: _compat.current_hook_name(self.lightning_module)):
            self._guard = None
        self._failed = False
        if same_group:
            return
        # One root seed for the strategy's life: fit, then validate/test/predict (or a second fit) keep it
        previous = self._lineage
        lineage = SeedLineage.agree(self._seed_arg if previous is None else previous.root)
        if previous is None or previous.root != lineage.root:
            self._lineage = lineage
            rank_zero_info(lineage.describe())

    @override
    def setup(self, trainer: Any) -> None:
        # sync_batchnorm=True built torch's SyncBatchNorm conversion (CUDA only); use the portable one.
        _compat.set_layer_sync(self, portable_layer_sync(_compat.layer_sync(self)))
        super().setup(trainer)
        assert self._lineage is not None
        # Model set-up (configure_model, DDP's broadcast) is done: from here on each rank draws its own
        # random numbers. A checkpoint being resumed supplies the exact states instead.
        self._lineage.load_checkpoint_state(self._pending_checkpoint_state, self.global_rank)
        self._pending_checkpoint_state = None
        self._lineage.seed_rank_streams(self.global_rank)
        install_first(trainer, self._own_callbacks())
        if self._exact_eval is not None and self.world_size > 1 and self._quiet_warning is None:
            # Lightning warns that its padded sampler evaluates some samples twice: not under exact evaluation
            self._quiet_warning = _compat.silence_padded_sampler_warning()

    def _own_callbacks(self) -> list[Any]:
        """The strategy's callbacks, run before every other callback (``lightning_sync.strategy_callbacks``)."""
        from lightning_sync.callbacks.resume import ResumeEpochLength
        from lightning_sync.strategy_checks import SamplerCheck, UnevenBatchCheck

        own: list[Any] = [UnevenBatchCheck(self.uneven_batches), ResumeEpochLength()]
        if self._guard is not None:
            own.append(SamplerCheck())
        own.append(self._requeue)  # saves SLURM's requeue checkpoint at an agreed step end
        return own

    @override
    def configure_ddp(self) -> None:
        assert self.model is not None
        if self._guard is not None:
            from lightning_sync.callbacks.consistency import warn_if_initial_parameters_differ

            warn_if_initial_parameters_differ(self.model, _compat.ddp_kwargs(self))  # only what DDP will not overwrite
        super().configure_ddp()
        if self._guard is not None and self.model is not None:
            self._guard.watch_module(self.model)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if self._exact_eval is not None and isinstance(tensor, Tensor):
            self._check_step_collective("self.log(..., sync_dist=True)")
            if is_integer_mean(tensor, reduce_op):  # self.log's sample count: a float mean is exact
                dtype = torch.get_default_dtype() if torch.get_default_dtype() == torch.float64 else torch.float32
                return self._reduce(tensor.to(dtype), group, reduce_op)
        return self._reduce(tensor, group, reduce_op)

    def _check_step_collective(self, what: str) -> None:
        module = self.lightning_module
        trainer = _compat.attached_trainer(module)
        if self._exact_eval is not None and trainer is not None:
            self._exact_eval.check_step_collective(what, _compat.current_hook_name(module), evaluation_limit(trainer))

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        self._check_step_collective("all_gather")
        if isinstance(tensor, Tensor) and self.world_size > 1:
            # torch's all_gather needs one shape on every rank; with another, gloo aborts one rank and hands
            # the other garbage. Exact evaluation gives ranks last batches of different sizes, so say so first.
            check_same_layout(tensor, "self.all_gather", _ALL_GATHER_FIX if self._exact_eval is not None else "",
                              group=group)
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    def _reduce(self, tensor: Any, group: Any | None, reduce_op: Any) -> Any:
        # One guarded check for Lightning's barrier + all_reduce pair (self.log(sync_dist=True)).
        if self._guard is None or not isinstance(tensor, Tensor):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        op = reduce_op if isinstance(reduce_op, str) else str(reduce_op).rsplit(".", 1)[-1].lower()
        match = f"{str(tensor.dtype).removeprefix('torch.')}[{', '.join(map(str, tensor.shape))}] op={op}"
        with self._guard.guarded("strategy.reduce", match, group):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        # a mid-epoch checkpoint's loader position (if Lightning set the loader up before restoring it),
        # then its RNG states, now that the iterator exists
        self._resume.on_train_start(trainer)
        self._unguard_on_sigterm()

    def _unguard_on_sigterm(self) -> None:
        # Lightning's SIGTERM handler (installed after strategy.setup) broadcasts from rank 0. When a
        # peer died, torchrun SIGTERMs the survivors, and a guarded broadcast would wait for ranks that
        # are gone until the launcher's SIGKILL (30 s). Stop guarding first; unguarded, gloo fails at once.
        if self._guard is None or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if not callable(previous) or getattr(previous, "_lsync_unguard", False):
            return
        guard = self._guard

        def handler(signum: int, frame: Any) -> None:
            guard.uninstall()
            previous(signum, frame)

        handler._lsync_unguard = True  # type: ignore[attr-defined]
        signal.signal(signal.SIGTERM, handler)  # Lightning's teardown restores the original handler

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The root seed reaches the DistributedSampler Lightning injects explicitly (Lightning reads
        # PL_GLOBAL_SEED only when no seed is given): no environment variable carries it.
        kwargs = dict(super().distributed_sampler_kwargs)
        if self._lineage is not None:
            kwargs["seed"] = self._lineage.root
        return kwargs

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = _compat.attached_trainer(self.lightning_module)
        if self._exact_eval is not None and trainer is not None and self.world_size > 1 and (
                trainer.sanity_checking or trainer.validating or trainer.testing or trainer.predicting):
            dataloader = exact_eval_dataloader(dataloader, self.global_rank, self.world_size,
                                               predicting=trainer.predicting, monitor=self._exact_eval)
        if self._lineage is not None and getattr(dataloader, "worker_init_fn", "absent") is None:
            dataloader.worker_init_fn = WorkerSeeder(self._lineage, self.global_rank)  # type: ignore[attr-defined]
        trainer = self._attached_trainer()
        if trainer is not None and trainer.training:  # the training loader resumes mid-epoch (resume.py)
            dataloader = make_resumable(dataloader)
            self._resume.check_training_loader(dataloader)
        return dataloader

    # ------------------------------------------------------------------ checkpoints

    def _attached_trainer(self) -> Any:
        try:
            return self.lightning_module.trainer if self.lightning_module is not None else None
        except RuntimeError:  # a LightningModule not attached to a Trainer
            return None

    @property
    def checkpoint_io(self) -> Any:
        # Lightning's default stages the file in $TMPDIR and moves it into place: not atomic across
        # file systems. Ours writes beside the target and renames (lightning_sync.checkpoint_io).
        io = _compat.own_checkpoint_io(self)
        if io is None:
            io = AtomicCheckpointIO()
            _compat.set_own_checkpoint_io(self, io)
        elif hasattr(type(io), "checkpoint_io") and io.checkpoint_io is None:
            io.checkpoint_io = AtomicCheckpointIO()  # AsyncCheckpointIO and friends wrap another IO, maybe not set yet
        return io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        _compat.set_own_checkpoint_io(self, io)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Any | None = None) -> None:
        # Called on every rank by trainer.save_checkpoint; the RNG states come from every rank.
        if self._lineage is not None:
            state = self._lineage.checkpoint_state(self._resume.loader_payload(checkpoint),
                                                   checkpoint.get("global_step"))
            if state is not None:
                checkpoint[CHECKPOINT_KEY] = state
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        # Lightning passes weights_only from 2.6.0 on; older ones have no such parameter.
        checkpoint = super().load_checkpoint(checkpoint_path, **_compat.load_checkpoint_kwargs(weights_only))
        trainer = self._attached_trainer()
        fitting = trainer is not None and trainer.state.fn == "fit"
        self._resume.on_load(checkpoint, self.world_size, self.global_rank, fitting)  # each rank's loader state
        self._pending_checkpoint_state = checkpoint.get(CHECKPOINT_KEY)
        return checkpoint

    @override
    def _configure_launcher(self) -> None:  # compat: Lightning's launcher hook (_compat.TOUCH_POINTS)
        super()._configure_launcher()
        method = _compat.start_method(self)
        if method in ("spawn", "fork", "forkserver"):
            # the ranks run in child processes: bring rank 0's seed lineage back with its results
            _compat.set_launcher(self, _LineageReturningLauncher(self, start_method=method))  # type: ignore[arg-type]
        if _compat.start_method(self) == "popen":  # under Hydra: ranks replay only their job (launcher.py)
            from lightning_sync.launcher import HydraDDPLauncher, hydra_active

            if hydra_active():
                assert self.cluster_environment is not None
                _compat.set_launcher(self, HydraDDPLauncher(self.cluster_environment, self.num_processes,
                                                            self.num_nodes))
        if self._resume_arg is not None:  # resume="auto": fit without ckpt_path picks the newest checkpoint
            from lightning_sync.resume import auto_resume_directories, install_auto_resume

            install_auto_resume(self.launcher, auto_resume_directories(self._resume_arg))

    # ------------------------------------------------------------------ teardown

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Every rank raises UnevenEvaluationError at the same point: the group is healthy, tear down cleanly
        # (a peer that skipped the barrier could re-join the next run's rendezvous on the old store).
        self._failed = not isinstance(exception, UnevenEvaluationError)
        lost = lost_peer_message(exception, self._peers, self.global_rank)
        if lost:  # gloo only names an address: say which rank(s) that is
            log.error("lightning_sync: %s", lost)
        # No checked collectives after a failure: Lightning's SIGTERM handler broadcasts during
        # teardown, and the guard would wait for peers that are gone until the launcher's SIGKILL
        # (30 s under torchrun); unguarded, gloo fails at once.
        self._end_guard()
        super().on_exception(exception)

    def _end_guard(self) -> None:
        guard = self._guard
        if guard is None or not guard.active:
            return
        found = guard.failure is not None
        guard.uninstall()
        if found and self.global_rank == 0:
            # Rank 0 hosts the store: stay a few watchdog turns, so the peers read the error it posted
            # there instead of only "the store stopped answering" once it is gone.
            time.sleep(min(1.0, 5 * guard.interval))

    @override
    def barrier(self, name: str | None = None) -> None:
        if _compat.is_run_stage_barrier(name) and self.lightning_module is not None:
            # Lightning registered its signal handlers just before: in fit, SLURM's requeue signal waits
            # for a training step boundary from here on, through the sanity check and validation too
            self._requeue.install(self.lightning_module.trainer)
        super().barrier(name)

    @override
    def teardown(self) -> None:
        self._requeue.uninstall()
        _compat.restore_warning(self._quiet_warning)
        self._quiet_warning = None
        super().teardown()  # unwraps DDP, reverts layer sync, moves the model to CPU
        if dist.is_available() and dist.is_initialized():
            env = self.cluster_environment
            assert env is not None
            keep = self._keeps_process_group()
            if not keep or self._failed:
                # Free DDP's reducer before the process group goes: destroying them in the wrong order at
                # interpreter exit is what makes gloo processes SIGABRT ("terminate called without an
                # active exception") after a successful run. (destroy_at_exit does it for a kept group.)
                gc.collect()
            try:
                if not self._failed:
                    if self._guard is not None:
                        # the run's last collectives were compared after they ran: a mismatch among them
                        # (ranks that synced different metrics at the last epoch end) is raised here
                        self._guard.closing_check()
                    if not keep:
                        # nobody destroys the group while a peer still uses it
                        ids = self.determine_ddp_device_ids()
                        _device_barrier(device_index=ids[0] if ids else None)
            except BaseException:
                self._failed = True
                raise
            finally:
                self._end_guard()
                if keep and not self._failed:
                    # The next validate/test/predict/fit of this process reuses the group, as under Lightning's
                    # ddp; it is destroyed cleanly (barrier first) when the interpreter exits.
                    self._kept_group = True
                    destroy_at_exit()
                else:
                    destroy_default_group(env.main_address, env.main_port)

    def _keeps_process_group(self) -> bool:
        """Whether the process group outlives this trainer call: yes for ranks that live on (Lightning's
        subprocess launcher, torchrun, SLURM); no for spawned/forked ranks (they end with the call) and
        under the Hydra launcher (every job of a sweep gets fresh ranks and its own group)."""
        if _compat.start_method(self) != "popen":
            return False
        from lightning_sync.launcher import HydraDDPLauncher

        return not isinstance(self.launcher, HydraDDPLauncher)

    # ------------------------------------------------------------------ registry

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        # Overridden so DDPStrategy's names ("ddp", ...) are not registered a second time.
        register(strategy_registry)


class _LineageReturningLauncher(_compat.MultiProcessingLauncher):
    """Lightning's launcher for spawned and forked ranks (notebooks), which also hands rank 0's seed lineage
    back to the launching process, so ``trainer.strategy.seed`` is the run's root seed there too."""

    def get_extra_results(self, trainer: Any) -> dict[str, Any]:
        extra: dict[str, Any] = super().get_extra_results(trainer)
        lineage = getattr(trainer.strategy, "seed_lineage", None)
        if lineage is not None:
            extra["lightning_sync_root_seed"] = lineage.root
        return extra

    def update_main_process_results(self, trainer: Any, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        root = extra.get("lightning_sync_root_seed")
        if root is not None and isinstance(trainer.strategy, SyncDDPStrategy):
            trainer.strategy._adopt_root(int(root))


_exit_hook_registered = False


def destroy_at_exit(timeout: float = 60.0) -> None:
    """At interpreter exit: free what still holds the default group, wait for every rank (at most
    ``timeout`` s), then destroy it. Registered once per process (idempotent).

    Destroying gloo's group (and DDP's reducer) in the interpreter's own shutdown order is what makes
    processes abort after a successful run ("terminate called without an active exception"); a rank
    that crashed meanwhile makes the others wait ``timeout`` s, then exit without the barrier.
    """
    global _exit_hook_registered
    if _exit_hook_registered:
        return
    _exit_hook_registered = True
    import atexit
    from datetime import timedelta

    def destroy() -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        gc.collect()
        try:
            work = _device_barrier(async_op=True)  # on NCCL, wait(timeout) aborts the communicator if it expires
            if work is not None:
                work.wait(timedelta(seconds=timeout))
        except RuntimeError:  # a peer is gone: destroying could block until the group's own timeout
            return
        dist.destroy_process_group()

    atexit.register(destroy)


def destroy_default_group(main_address: str, main_port: int, wait: float = 3.0) -> None:
    """``destroy_process_group()``; ranks > 0 then wait (at most ``wait`` s) until rank 0's store is closed.

    Rank 0 serves the rendezvous store on ``MASTER_PORT``. A rank that raced ahead into the next
    ``trainer.fit``/``validate`` of the same script would otherwise reach the old server, still open
    while rank 0 tears down, and fail when it closes ("Connection was likely closed"). Under torchrun
    the agent serves the store and keeps it: nothing to wait for.
    """
    import os
    import socket

    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            socket.create_connection((main_address, main_port), timeout=0.5).close()
        except OSError:
            return  # refused: the old server is gone
        time.sleep(0.02)


def register(strategy_registry: StrategyRegistryType) -> None:
    """Register ``"ddp_sync"``, ``"ddp_sync_spawn"`` and ``"ddp_sync_notebook"`` (idempotent)."""
    entries = (
        ("ddp_sync", "popen", "DDP with seed broadcast, exact gather support and clean teardown"),
        ("ddp_sync_spawn", "spawn", "ddp_sync started with torch.multiprocessing.spawn"),
        # Lightning allows only fork-started strategies in Jupyter and other interactive sessions
        ("ddp_sync_notebook", "fork", "ddp_sync for Jupyter notebooks (ranks forked, like ddp_notebook)"),
    )
    for name, start_method, description in entries:
        if name not in strategy_registry:
            strategy_registry.register(name, SyncDDPStrategy, description=description, start_method=start_method)
