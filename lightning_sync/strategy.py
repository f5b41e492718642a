"""``SyncDDPStrategy``: Lightning's DDP plus explicit, checked synchronisation.

Registered as ``"ddp_sync"`` (Lightning's subprocess launcher, torchrun, SLURM), ``"ddp_sync_spawn"``
and ``"ddp_sync_notebook"`` (forked ranks: Jupyter) by ``import lightning_sync``.
"""

from __future__ import annotations

from typing import Any, Literal

from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_sync._compat import lightning_api as _compat
from lightning_sync._compat.lightning_api import StrategyRegistryType
from lightning_sync.callbacks.batchnorm import portable_layer_sync
from lightning_sync.checkpoint_io import AtomicCheckpointIO
from lightning_sync.guard.core import CollectiveGuard
from lightning_sync.parts.mixin import SyncStrategyMixin
from lightning_sync.parts.defaults import default_parts

__all__ = ["SyncDDPStrategy"]


class SyncDDPStrategy(SyncStrategyMixin, DDPStrategy):
    """Lightning's ``DDPStrategy`` with every part of ``lightning_sync.parts``: a broadcast root seed and
    seed lineage, exact evaluation, the resumable data path and its checkpoint state, the collective
    guard, uneven-batch checks, SLURM requeue at a step boundary and a clean teardown.

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
            with more would hang in DDP's all-reduce): ``"error"`` raises an
            ``UnevenTrainingError``/``RankMismatchError`` on every rank (at epoch start where every
            rank's loader has a length, else at the batch where the first runs out);
            ``"stop_together"`` ends every rank's epoch when the shortest rank runs out; ``"join"``
            trains on every batch of every rank: a rank that ran out runs stand-in steps with a zero
            contribution until the last rank is done (see ``docs/uneven.md``).
        exact_eval: evaluate every sample of validate, test, fit's validation and predict on exactly
            one rank, once (no padding), in equal step counts wherever possible, and reduce
            ``self.log(..., sync_dist=True)`` epoch means exactly (see ``lightning_sync.sampling``).
            ``False``: Lightning's padded ``DistributedSampler``.
        resume: ``"auto"``: when ``fit`` gets no ``ckpt_path``, resume from the newest checkpoint of
            the run that loads completely (after an elastic restart or a requeue); a directory: search
            there. ``None`` (default): only ``ckpt_path``. See ``docs/resume.md``.
        world_size_invariant: train, on any number of ranks, the model one process trains: the training
            loader's ``batch_size`` is the *global* batch, each rank takes its slice of every global batch of
            the one-process epoch (no padding; a resume on another world size continues at the same batch),
            random numbers drawn in ``dataset[i]`` are keyed by (root seed, epoch, ``i``), ``nn.Dropout*``
            masks are drawn for the global batch, and a step split unevenly is weighted by its samples.
            ``False`` (default): Lightning's per-rank batches and streams. See ``docs/invariance.md``.

    After set-up, ``trainer.strategy.seed`` is the root seed, identical on every rank. Samplers use
    it (disjoint, complete shards), layers built in ``setup``/``configure_model`` are initialised under
    it (identical on every rank from the start; a model built before ``fit`` becomes identical when
    DDP's wrap broadcasts rank 0's weights), then every rank's RNGs switch to their own derived
    stream (dropout and augmentation differ across ranks and workers). Per-rank RNG states are
    saved in checkpoints and restored on resume.
    """

    strategy_name = "ddp_sync"

    def __init__(self, *args: Any, seed: int | None = None, guard: bool | CollectiveGuard = True,
                 guard_timeout: float | None = None,
                 uneven_batches: Literal["error", "stop_together", "join"] = "error", resume: str | None = None,
                 exact_eval: bool = True, world_size_invariant: bool = False,
                 **kwargs: Any) -> None:
        # the parts first: a bad argument of ours fails before Lightning builds anything
        parts = default_parts(owner="SyncDDPStrategy", seed=seed, guard=guard, guard_timeout=guard_timeout,
                              uneven_batches=uneven_batches, resume=resume, exact_eval=exact_eval,
                              world_size_invariant=world_size_invariant)
        super().__init__(*args, **kwargs)
        self.uneven_batches = uneven_batches
        self.exact_eval = bool(exact_eval)
        self.world_size_invariant = world_size_invariant
        self._init_parts(parts)

    # ------------------------------------------------------------------ DDP's own steps

    @override
    def setup(self, trainer: Any) -> None:
        # sync_batchnorm=True built torch's SyncBatchNorm conversion (CUDA only); use the portable one.
        _compat.set_layer_sync(self, portable_layer_sync(_compat.layer_sync(self)))
        super().setup(trainer)

    @override
    def configure_ddp(self) -> None:
        assert self.model is not None
        guard = self.guard
        if guard is not None:
            from lightning_sync.callbacks.consistency import warn_if_initial_parameters_differ

            warn_if_initial_parameters_differ(self.model, _compat.ddp_kwargs(self))  # only what DDP will not overwrite
        super().configure_ddp()
        if guard is not None and self.model is not None:
            guard.watch_module(self.model)

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

    # ------------------------------------------------------------------ registry

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        # Overridden so DDPStrategy's names ("ddp", ...) are not registered a second time.
        register(strategy_registry)


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
