"""``SyncStrategyMixin``: a Lightning strategy plus an ordered list of parts (``lightning_sync.parts``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import contextlib
import sys

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sync._compat import lightning_api as _compat
from lightning_sync._compat.lightning_api import PathLike
from lightning_sync.collectives import backend_for, check_same_layout
from lightning_sync.guard.core import CollectiveGuard
from lightning_sync.parts.base import Part
from lightning_sync.parts.evaluation import ALL_GATHER_FIX, ExactEvalPart
from lightning_sync.parts.guard import GuardPart
from lightning_sync.parts.seed import SeedLineagePart
from lightning_sync.parts.uneven import UnevenBatchPart
from lightning_sync.resume.restart import init_process_group_after_restart
from lightning_sync.sampling import is_integer_mean
from lightning_sync.seeding import SeedLineage
from lightning_sync.strategy_callbacks import install_first

__all__ = ["SyncStrategyMixin"]


def _all_reduce(tensor: Tensor, group: Any, reduce_op: Any) -> Tensor:
    """Lightning's ``sync_dist`` reduction in place, without its barrier ("mean" is a sum divided by the
    world size on gloo, which has no AVG; integer tensors keep their dtype, as Lightning's do). Written
    here because Lightning's issues the barrier inside; tests/test_strategy.py checks that both give the
    same tensors for every op and dtype."""
    group = dist.group.WORLD if group is None else group
    mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
    if mean and backend_for(group, tensor.device) == "gloo":  # (gloo has no AVG)
        op = dist.ReduceOp.SUM
    elif isinstance(reduce_op, str):
        op = getattr(dist.ReduceOp, "AVG" if mean else reduce_op.upper())
        mean = False
    else:
        op, mean = reduce_op, False
    dist.all_reduce(tensor, op=op, group=group)
    return _divide_by_world(tensor, dist.get_world_size(group)) if mean else tensor


def _divide_by_world(tensor: Tensor, world: int) -> Tensor:
    """A sum made a mean, in place, as Lightning's gloo ``mean`` does (integer tensors keep their dtype)."""
    return tensor.copy_(tensor / world) if not torch.is_floating_point(tensor) else tensor.div_(world)


_P = TypeVar("_P", bound=Part)


class SyncStrategyMixin:
    """A Lightning strategy plus an ordered list of parts: put it first in the bases,
    ``class SyncXStrategy(SyncStrategyMixin, XStrategy)``, and pass the parts to ``_init_parts``.

    It overrides the Lightning strategy methods the parts need and calls every part's hook around
    ``super()``: nothing about one guarantee lives in the strategy class.
    """

    _parts: tuple[Part, ...] = ()
    _step_parts: tuple[Part, ...] = ()
    _loss_parts: tuple[Part, ...] = ()
    _uneven: UnevenBatchPart | None = None

    def _init_parts(self, parts: Sequence[Part]) -> None:
        self._parts = tuple(parts)
        # the parts with per-step hooks: the others cost nothing on the hot path
        self._step_parts = tuple(p for p in parts if type(p).step_context is not Part.step_context)
        self._loss_parts = tuple(p for p in parts if type(p).scale_loss is not Part.scale_loss)
        self._uneven = self.part(UnevenBatchPart)

    @property
    def parts(self) -> tuple[Part, ...]:
        """The parts in the order their hooks run."""
        return self._parts

    def part(self, kind: type[_P]) -> _P | None:
        """This strategy's part of type ``kind``, or ``None`` when it has none (switched off)."""
        return next((p for p in self._parts if isinstance(p, kind)), None)

    # ------------------------------------------------------------------ Lightning's strategy methods

    _kept_group = False  # the last teardown kept the process group for this strategy's next trainer call
    _failed = False  # the current run failed: teardown skips the collectives of a healthy group

    def setup_distributed(self) -> None:
        self._sync_setup_distributed(super().setup_distributed)  # type: ignore[misc]

    def _sync_setup_distributed(self, create: Any) -> None:
        """Create the process group with ``create`` (the Lightning strategy's own step), the parts around it."""
        for p in self._parts:
            p.before_setup_distributed(self)
        strategy: Any = self  # the Lightning strategy this mixin is combined with
        device = strategy.root_device
        init_process_group_after_restart(_compat.process_group_backend(strategy), _compat.process_group_timeout(strategy),
                                         device if device.type != "cpu" else None)
        existed = dist.is_available() and dist.is_initialized()
        create()
        # The group this strategy kept at its last teardown (fit, then validate/test/predict): the parts
        # agreed on what they need once per group. (No reference to the group object is held: it would
        # keep a destroyed group's store serving stale rendezvous keys on MASTER_PORT.)
        fresh = not (existed and self._kept_group)
        self._kept_group = False
        self._failed = False
        for p in self._parts:
            p.setup_distributed(self, fresh)

    # ------------------------------------------------------------------ what the parts hold

    @property
    def seed(self) -> int | None:
        """The root seed every rank agreed on (``None`` before the process group is set up)."""
        lineage = self.seed_lineage
        return lineage.root if lineage is not None else None

    @property
    def seed_lineage(self) -> SeedLineage | None:
        """How every stream of this run derives from the root seed."""
        part = self.part(SeedLineagePart)
        return part.lineage if part is not None else None

    @property
    def guard(self) -> CollectiveGuard | None:
        """The collective guard (``None`` when turned off)."""
        part = self.part(GuardPart)
        return part.guard if part is not None else None

    @property
    def stand_in_step(self) -> bool:
        """True while this rank runs a stand-in training step (``uneven_batches="join"``: it ran out of data
        and repeats its last batch, with no contribution, until every rank is done). Code in
        ``training_step`` that records or writes per-sample results can skip such steps."""
        share = self._uneven.current if self._uneven is not None else None
        return share is not None and share.shadow

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The root seed reaches the DistributedSampler Lightning injects explicitly (Lightning reads
        # PL_GLOBAL_SEED only when no seed is given): no environment variable carries it.
        kwargs = dict(super().distributed_sampler_kwargs)  # type: ignore[misc]
        if self.seed is not None:
            kwargs["seed"] = self.seed
        return kwargs

    # ------------------------------------------------------------------ collectives Lightning makes

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        uneven = self._uneven
        # (the share's ranks are the data plan's: where they are not this group's, ddp_sync_ft's replica groups,
        # the reduction is the group's own, unweighted)
        if (uneven is not None and (uneven.in_step or uneven.in_weighted_step) and isinstance(tensor, Tensor)
                and uneven.current is not None and len(uneven.current.sizes) == getattr(self, "world_size", 1)):
            # inside a step with stand-ins (uneven_batches="join"): the ranks with data only; a step of slices of
            # different sizes (world_size_invariant, "join"): a mean weighted by them
            out = uneven.reduce(tensor, reduce_op, lambda t, op: self._guarded_reduce(t, group, op))
            if out is not None:
                return out
        exact = self.part(ExactEvalPart)
        if exact is not None and isinstance(tensor, Tensor):
            exact.check_step_collective(self, "self.log(..., sync_dist=True)")
            if is_integer_mean(tensor, reduce_op):  # self.log's sample count: a float mean is exact
                dtype = torch.get_default_dtype() if torch.get_default_dtype() == torch.float64 else torch.float32
                return self._guarded_reduce(tensor.to(dtype), group, reduce_op)
        return self._guarded_reduce(tensor, group, reduce_op)

    def _guarded_reduce(self, tensor: Any, group: Any | None, reduce_op: Any) -> Any:
        # One guarded check for Lightning's barrier + all_reduce pair (self.log(sync_dist=True)).
        guard = self.part(GuardPart)
        if (guard is None or guard.guard is None or not isinstance(tensor, Tensor)
                or not (dist.is_available() and dist.is_initialized())):  # (Lightning's: the value as it is)
            return super().reduce(tensor, group=group, reduce_op=reduce_op)  # type: ignore[misc]
        op = reduce_op if isinstance(reduce_op, str) else str(reduce_op).rsplit(".", 1)[-1].lower()
        match = f"{str(tensor.dtype).removeprefix('torch.')}[{', '.join(map(str, tensor.shape))}] op={op}"
        several = dist.get_world_size(group) > 1
        with guard.guarded("strategy.reduce", match, group) as confirmed:
            if confirmed and several:
                # Every rank's token of this call was compared before its data moves (confirm_first):
                # Lightning's barrier before the all_reduce, which pairs a rank-0-only self.log harmlessly
                # elsewhere, would be one more round trip a step that checks nothing more.
                return _all_reduce(tensor, group, reduce_op)
            return super().reduce(tensor, group=group, reduce_op=reduce_op)  # type: ignore[misc]

    def all_gather(self, tensor: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
        exact = self.part(ExactEvalPart)
        if exact is not None:
            exact.check_step_collective(self, "all_gather")
        strategy: Any = self
        guard = self.guard
        if guard is not None and self._uneven is not None and self._uneven.in_step:
            guard._refuse("self.all_gather", sys._getframe(1))  # a step with stand-ins: named as the user wrote it
        if isinstance(tensor, Tensor) and strategy.world_size > 1:
            # torch's all_gather needs one shape on every rank; with another, gloo aborts one rank and hands
            # the other garbage. Exact evaluation gives ranks last batches of different sizes, so say so first.
            check_same_layout(tensor, "self.all_gather", ALL_GATHER_FIX if exact is not None else "", group=group)
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)  # type: ignore[misc]

    # ------------------------------------------------------------------ Lightning's strategy steps

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # type: ignore[misc]
        for p in self._parts:
            p.setup(self, trainer)
        install_first(trainer, [cb for p in self._parts for cb in p.callbacks(self)])

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._step_parts:
            return super().training_step(*args, **kwargs)  # type: ignore[misc]
        with self._step_context():
            return super().training_step(*args, **kwargs)  # type: ignore[misc]

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._step_parts:
            return super().validation_step(*args, **kwargs)  # type: ignore[misc]
        with self._step_context():
            return super().validation_step(*args, **kwargs)  # type: ignore[misc]

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._step_parts:
            return super().test_step(*args, **kwargs)  # type: ignore[misc]
        with self._step_context():
            return super().test_step(*args, **kwargs)  # type: ignore[misc]

    def _step_context(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for p in self._step_parts:
            stack.enter_context(p.step_context(self))
        return stack

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        for p in self._loss_parts:
            closure_loss = p.scale_loss(self, closure_loss)
        try:
            if not self._step_parts:
                return super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc]
            with self._step_context():
                return super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc]
        except RuntimeError as err:
            # DDP's gradient all-reduce failed in C++ (a peer that failed first closed its connections): the
            # guard's report says why, where it has one, instead of gloo's "Connection closed by peer" (kept as
            # the error's backend_error: one traceback, not two)
            guard = self.guard
            explained = guard._explain(err) if guard is not None and guard.active else err
            if explained is err:
                raise
            raise explained from None

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        trainer = _compat.attached_trainer(getattr(self, "lightning_module", None))
        for p in self._parts:
            dataloader = p.process_dataloader(self, dataloader, trainer)
        for observer in tuple(self.__dict__.get("_dataloader_observers", ())):
            dataloader = observer(dataloader)
        return dataloader

    def observe_dataloaders(self, observer: Callable[[object], object]) -> Callable[[], None]:
        """Have ``observer(dataloader) -> dataloader`` see every loader, after the parts; returns the undo.

        The seam for callbacks that must see a dataloader after the Trainer prepared it and before its
        first ``iter()`` (``ValidationGather``'s index recording); ``_compat.observe_dataloaders`` gives
        the same on Lightning's own strategies.
        """
        observers: list[Callable[[object], object]] = self.__dict__.setdefault("_dataloader_observers", [])
        observers.append(observer)

        def undo() -> None:
            if observer in observers:
                observers.remove(observer)

        return undo

    def barrier(self, name: str | None = None) -> None:
        module = getattr(self, "lightning_module", None)
        if _compat.is_run_stage_barrier(name) and module is not None:
            for p in self._parts:
                p.run_stage_started(self, module.trainer)
        super().barrier(name)  # type: ignore[misc]

    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        module = getattr(self, "lightning_module", None)
        trainer = module.trainer if module is not None else None
        for p in self._parts:
            p.on_train_start(self, trainer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Any | None = None) -> None:
        directory = self.sharded_checkpoint_directory(filepath, saving=True)
        for p in self._parts:  # called on every rank by trainer.save_checkpoint
            p.on_save_checkpoint(self, checkpoint, directory)
        # A sharded save broadcasts rank 0's path first (_compat: ModelParallelStrategy.save_checkpoint) and
        # writes there on every rank: the ranks' own files go there too, not to a path a rank computed for
        # itself (Lightning's SLURM requeue names hpc_ckpt_<n+1> on each rank: a rank that looks after rank
        # 0 created hpc_ckpt_<n+1> names the next one). Taken from that broadcast: no collective of our own.
        agreed: list[Any] = []
        self.__dict__["_save_path_broadcast"] = agreed
        try:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]
        finally:
            self.__dict__.pop("_save_path_broadcast", None)
        if directory is not None and agreed and _compat.save_broadcasts_path_first():
            directory = self.sharded_checkpoint_directory(agreed[0], saving=True)
        for p in self._parts:
            p.after_save_checkpoint(self, directory)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        # src passed only where it is not the default, as Lightning's own callers do (its tests patch the
        # method with a one-argument stand-in: strategies/test_model_parallel.py)
        out = super().broadcast(obj, src) if src else super().broadcast(obj)  # type: ignore[misc]
        pending = self.__dict__.get("_save_path_broadcast")
        if pending is not None and not pending:  # the first broadcast inside save_checkpoint: its path
            pending.append(out)
        return out

    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = self._read_checkpoint(checkpoint_path, weights_only)
        trainer = _compat.attached_trainer(getattr(self, "lightning_module", None))
        fitting = trainer is not None and trainer.state.fn == "fit"
        directory = self.sharded_checkpoint_directory(checkpoint_path, saving=False)
        for p in self._parts:
            p.on_load_checkpoint(self, checkpoint, fitting, directory)
        return checkpoint

    def _read_checkpoint(self, checkpoint_path: PathLike, weights_only: bool | None) -> dict[str, Any]:
        """The checkpoint at ``checkpoint_path`` (a strategy may read it from elsewhere: a live peer)."""
        # Lightning passes weights_only from 2.6.0 on; older ones have no such parameter.
        checkpoint: dict[str, Any] = super().load_checkpoint(  # type: ignore[misc]
            checkpoint_path, **_compat.load_checkpoint_kwargs(weights_only))
        return checkpoint

    def sharded_checkpoint_directory(self, path: PathLike, saving: bool) -> Path | None:
        """The directory a sharded checkpoint at ``path`` is (to be) written to by every rank, or None when
        the strategy writes (reads) one file. No collective: each rank's own ``path``."""
        return None

    def _configure_launcher(self) -> None:  # compat: Lightning's launcher hook (_compat.TOUCH_POINTS)
        super()._configure_launcher()  # type: ignore[misc]
        strategy: Any = self
        if _compat.start_method(strategy) == "popen":  # under Hydra: ranks replay only their job (launcher.py)
            from lightning_sync.launcher import HydraDDPLauncher, hydra_active

            if hydra_active():
                assert strategy.cluster_environment is not None
                _compat.set_launcher(strategy, HydraDDPLauncher(strategy.cluster_environment, strategy.num_processes,
                                                                strategy.num_nodes))
        for p in self._parts:
            p.configure_launcher(self)

    def on_exception(self, exception: BaseException) -> None:
        for p in self._parts:
            p.on_exception(self, exception)
        super().on_exception(exception)  # type: ignore[misc]

    def teardown(self) -> None:
        for p in self._parts:
            p.before_teardown(self)
        super().teardown()  # type: ignore[misc]  # unwraps the model, reverts layer sync, moves it to CPU
        if not (dist.is_available() and dist.is_initialized()):
            return
        try:
            if not self._failed:
                for p in self._parts:
                    p.closing(self)
        except BaseException:
            self._failed = True
            raise
        finally:
            for p in self._parts:
                p.after_teardown(self)
