"""The private Lightning names lightning_sync uses. See ``lightning_sync._compat``."""

from __future__ import annotations

import functools
import inspect
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import lightning
from lightning.fabric.strategies.launchers.subprocess_script import (
    _launch_process_observer as launch_process_observer,
)
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed as set_num_threads_if_needed
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher as MultiProcessingLauncher,
)
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)
from packaging.version import Version

from lightning_sync._compat import TouchPoint

__all__ = [
    "LIGHTNING_VERSION",
    "TOUCH_POINTS",
    "PathLike",
    "StrategyRegistryType",
    "MultiProcessingLauncher",
    "SubprocessScriptLauncher",
    "attached_trainer",
    "batch_size_of",
    "running_results",
    "check_can_spawn_children",
    "checkpoint_io_load_kwargs",


    "FIT_IMPL_NAME",
    "dataloader_with_batch_sampler",
    "observe_dataloaders",
    "rewrap_index_batch_sampler",
    "with_batch_sampler",
    "ddp_kwargs",
    "own_checkpoint_io",
    "set_own_checkpoint_io",
    "model_parallel_sizes",
    "set_model_parallel_sizes",
    "index_batch_sampler",
    "install_step_flag_broadcast",
    "is_run_stage_barrier",
    "PADDED_SAMPLER_WARNING",
    "restore_warning",
    "silence_not_resumable_warning",
    "ignore_in_place",
    "silence_padded_sampler_warning",
    "raise_sigterm_exception",
    "remove_step_flag_broadcast",
    "slurm_requeue_signal",
    "unwrap_index_batch_sampler",
    "wrapped_sampler",
    "current_hook_name",
    "launch_process_observer",
    "loop_dataloaders",
    "layer_sync",
    "load_pending_train_loader_state",
    "load_checkpoint_kwargs",
    "process_group_backend",
    "seen_batch_indices",
    "process_group_timeout",
    "set_launcher",
    "ensure_launcher",
    "set_main_port",
    "set_layer_sync",
    "set_num_threads_if_needed",
    "saves_distributed_checkpoint",
    "start_method",
    "stop_epoch_after",
    "train_combined_loader",
]

LIGHTNING_VERSION = Version(lightning.__version__)

#: A file path as Lightning's checkpoint API takes it (Lightning's own alias, ``_PATH``, is private).
PathLike = Union[str, Path]

if TYPE_CHECKING:
    from lightning.fabric.strategies.registry import _StrategyRegistry as StrategyRegistryType
else:
    StrategyRegistryType = type(StrategyRegistry)  # the class of the public registry object


# --------------------------------------------------------------------------- strategy


def process_group_backend(strategy: DDPStrategy) -> str:
    """The backend the strategy will create its process group with (also before it exists)."""
    return str(strategy._get_process_group_backend())


def process_group_timeout(strategy: DDPStrategy) -> Any:
    """The ``timeout`` the strategy creates its process group with (a ``timedelta``)."""
    return strategy._timeout


def current_hook_name(module: object) -> str | None:
    """The LightningModule hook Lightning is running now (``"training_step"``, ...), for messages."""
    name = getattr(module, "_current_fx_name", None)
    return name if isinstance(name, str) else None


def layer_sync(strategy: object) -> Any:
    """The strategy's ``LayerSync`` plugin (``sync_batchnorm=True``), or None."""
    return getattr(strategy, "_layer_sync", None)


def set_layer_sync(strategy: DDPStrategy, plugin: Any) -> None:
    strategy._layer_sync = plugin


def start_method(strategy: DDPStrategy) -> str:
    """``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``."""
    return str(getattr(strategy, "_start_method", "popen"))  # strategies without one start ranks as scripts


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """Whether a ``ModelParallelStrategy`` writes sharded (DCP directory) checkpoints."""
    return bool(getattr(strategy, "_save_distributed_checkpoint", False))


@functools.lru_cache(maxsize=None)
def save_broadcasts_path_first() -> bool:
    """Whether ``ModelParallelStrategy.save_checkpoint``'s first ``self.broadcast`` is rank 0's path, which
    every rank then writes to (the sharded checkpoints' per-rank files follow it; read from its source)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    try:
        source = inspect.getsource(ModelParallelStrategy.save_checkpoint)
    except (OSError, TypeError):
        return False
    first = source.find("self.broadcast(")
    return first >= 0 and source.startswith("self.broadcast(filepath)", first)


def ddp_kwargs(strategy: DDPStrategy) -> dict[str, Any]:
    """The keyword arguments the strategy passes to ``DistributedDataParallel``."""
    return dict(getattr(strategy, "_ddp_kwargs", {}) or {})


def model_parallel_sizes(strategy: Any) -> tuple[Any, Any]:
    """``ModelParallelStrategy``'s data- and tensor-parallel sizes as given (``"auto"`` or an int)."""
    return strategy._data_parallel_size, strategy._tensor_parallel_size


def set_model_parallel_sizes(strategy: Any, data_parallel: Any, tensor_parallel: Any) -> None:
    """Set them before ``setup_environment`` resolves ``"auto"`` and builds the device mesh from them."""
    strategy._data_parallel_size, strategy._tensor_parallel_size = data_parallel, tensor_parallel


def own_checkpoint_io(strategy: Any) -> Any:
    """The ``CheckpointIO`` plugin set on the strategy (None: Lightning would build its default)."""
    return strategy._checkpoint_io


def set_own_checkpoint_io(strategy: Any, io: Any) -> None:
    strategy._checkpoint_io = io


#: The name of Trainer's ``fit`` body, which Lightning's launcher runs (``launcher.launch(trainer._fit_impl, ...)``).
FIT_IMPL_NAME = "_fit_impl"


def _fit_impl_fits() -> bool:
    from lightning.pytorch import Trainer

    fit = inspect.getsource(Trainer.fit)
    return callable(getattr(Trainer, FIT_IMPL_NAME, None)) and f"self.{FIT_IMPL_NAME}" in fit \
        and "ckpt_path" in _params(getattr(Trainer, FIT_IMPL_NAME))


def set_launcher(strategy: DDPStrategy, launcher: Any) -> None:
    """Replace the launcher Lightning built (called from the strategy's ``_configure_launcher`` override)."""
    strategy._launcher = launcher


def ensure_launcher(strategy: Any) -> Any:
    """The strategy's launcher; where Lightning built none (``ModelParallelStrategy`` where the processes exist
    already: torchrun, a rank it started), first a script launcher, as ``DDPStrategy`` always builds: it starts no
    process there and just calls the function, and gives a part's step before ``fit`` (auto-resume, ``ddp_sync_ft``'s
    recovery from a live group) a place to run."""
    if strategy.launcher is None:
        set_launcher(strategy, SubprocessScriptLauncher(strategy.cluster_environment, strategy.num_processes,
                                                        strategy.num_nodes))
    return strategy.launcher


def set_main_port(environment: Any, port: int) -> bool:
    """Point the cluster environment (and ``MASTER_PORT``) at ``port`` for the next process group.
    ``LightningEnvironment`` reads ``MASTER_PORT`` once and keeps it; False where the environment does
    not report the new port afterwards (another kind: nothing changed for it)."""
    import os

    if not isinstance(getattr(environment, "_main_port", None), int):
        return False
    old_port, old_env = environment._main_port, os.environ.get("MASTER_PORT")
    environment._main_port = port
    os.environ["MASTER_PORT"] = str(port)
    if environment.main_port == port:
        return True
    environment._main_port = old_port
    if old_env is not None:
        os.environ["MASTER_PORT"] = old_env
    return False


_LOAD_CHECKPOINT_TAKES_WEIGHTS_ONLY = "weights_only" in inspect.signature(DDPStrategy.load_checkpoint).parameters
_CHECKPOINT_IO_TAKES_WEIGHTS_ONLY = "weights_only" in inspect.signature(TorchCheckpointIO.load_checkpoint).parameters


def load_checkpoint_kwargs(weights_only: bool | None) -> dict[str, Any]:
    """``weights_only`` for ``Strategy.load_checkpoint`` where Lightning takes it (2.6.0 on)."""
    if weights_only is None or not _LOAD_CHECKPOINT_TAKES_WEIGHTS_ONLY:
        return {}
    return {"weights_only": weights_only}


def checkpoint_io_load_kwargs(weights_only: bool | None) -> dict[str, Any]:
    """``weights_only`` for ``TorchCheckpointIO.load_checkpoint`` where Lightning takes it (2.6.0 on)."""
    if weights_only is None or not _CHECKPOINT_IO_TAKES_WEIGHTS_ONLY:
        return {}
    return {"weights_only": weights_only}


def attached_trainer(module: object) -> Any:
    """The Trainer a LightningModule is attached to, or None (``module.trainer`` raises instead)."""
    return getattr(module, "_trainer", None)


# --------------------------------------------------------------------------- evaluation loaders (exact_eval)


class RecentBatches:
    """Lightning's ``seen_batch_indices`` list, holding only the batches still to be read.

    Lightning's ``_IndexBatchSamplerWrapper`` appends every batch's index list for the whole
    prediction epoch (~36 bytes a sample: 360 MB per 1e7 samples on a rank) although its only
    reader, the predict loop's ``_store_data_for_prediction_writer``, reads
    ``seen_batch_indices[batch_idx]`` once per batch, in order, and only with a
    ``BasePredictionWriter`` attached. Here the length and the indexing stay those of the full list;
    reading batch ``i`` forgets the batches before it, and at most ``window`` batches are held when
    nothing reads (the sampler runs ahead of the loop by the loader's prefetching only).
    """

    def __init__(self, window: int) -> None:
        from collections import deque

        self.window = window
        self._first = 0  # the batch index of self._held[0]
        self._held: Any = deque()

    def append(self, batch: list[int]) -> None:
        self._held.append(batch)
        if len(self._held) > self.window:
            self._held.popleft()
            self._first += 1

    def __len__(self) -> int:
        return self._first + len(self._held)

    def __iter__(self) -> Any:
        """The batches still held, oldest first (reading them this way drops nothing)."""
        return iter(list(self._held))

    def __getitem__(self, index: int) -> list[int]:
        if index < 0:
            index += len(self)
        if not self._first <= index < len(self):
            raise IndexError(f"prediction batch {index}: its indices are no longer held (batches "
                             f"{self._first}..{len(self) - 1} are); they are read once, in order")
        while self._first < index:
            self._held.popleft()
            self._first += 1
        return self._held[0]  # type: ignore[no-any-return]


def index_batch_sampler(batch_sampler: Any, window: int = 64) -> Any:
    """Wrap a batch sampler as Lightning does for prediction loaders, holding only recent batch indices.

    An instance of Lightning's ``_IndexBatchSamplerWrapper`` (the predict loop checks that type)
    whose ``seen_batch_indices`` is a :class:`RecentBatches` of ``window`` batches at most.
    """
    return _RecentIndexBatchSampler(batch_sampler, window)


class _RecentIndexBatchSampler(_IndexBatchSamplerWrapper):
    def __init__(self, batch_sampler: Any, window: int) -> None:
        super().__init__(batch_sampler)  # (replaces __dict__: the attributes below come after it)
        self._recent_window = window
        self.seen_batch_indices = RecentBatches(window)  # type: ignore[assignment]

    def __iter__(self) -> Any:
        super().__iter__()
        self.seen_batch_indices = RecentBatches(self._recent_window)  # type: ignore[assignment]
        return self


def unwrap_index_batch_sampler(batch_sampler: Any) -> Any:
    """The batch sampler inside Lightning's prediction index wrapper (itself when not wrapped)."""
    return batch_sampler._batch_sampler if isinstance(batch_sampler, _IndexBatchSamplerWrapper) else batch_sampler


def wrapped_sampler(sampler: Any) -> Any:
    """The user's sampler inside Lightning's ``DistributedSamplerWrapper`` family, or None.

    The wrappers shard a ``_DatasetSamplerWrapper`` "dataset" that holds the sampler as ``_sampler``.
    """
    from lightning.fabric.utilities.distributed import _DatasetSamplerWrapper

    dataset = getattr(sampler, "dataset", None)
    return dataset._sampler if isinstance(dataset, _DatasetSamplerWrapper) else None


def rewrap_index_batch_sampler(outer: Any, inner: Any) -> Any:
    """``inner`` wrapped as ``outer`` wraps its batch sampler in Lightning's prediction index wrapper (else ``inner``)."""
    if isinstance(outer, _RecentIndexBatchSampler):
        return _RecentIndexBatchSampler(inner, outer._recent_window)
    if isinstance(outer, _IndexBatchSamplerWrapper):
        return _IndexBatchSamplerWrapper(inner)
    return inner


def dataloader_with_batch_sampler(dataloader: Any, batch_sampler: Any) -> Any:
    """A copy of ``dataloader`` (its class and arguments, as Lightning re-creates loaders) with ``batch_sampler``."""
    import copy

    from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls
    from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs

    inner = unwrap_index_batch_sampler(dataloader.batch_sampler)
    if inner is not dataloader.batch_sampler:
        # Lightning's prediction loader (its own copy) wraps a plain BatchSampler; let the re-instantiation see
        # the plain one, which it knows how to handle (DataLoader refuses attribute assignment after __init__)
        dataloader = copy.copy(dataloader)
        object.__setattr__(dataloader, "batch_sampler", inner)
    args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, inner.sampler)
    kwargs.update(sampler=None, shuffle=False, batch_sampler=batch_sampler, batch_size=1, drop_last=False)
    return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)


def with_batch_sampler(dataloader: Any, batch_sampler: Any = None, sampler: Any = None) -> Any:
    """A shallow copy of ``dataloader`` drawing its batches from ``batch_sampler`` (a loader without one,
    ``batch_size=None``: its indices from ``sampler``).

    Nothing is re-created: the copy keeps the loader's class, every attribute (``.sampler`` too) and the
    arguments Lightning recorded in a ``*_dataloader`` hook, so later re-creations work as on the
    original. The user's loader is not modified. DataLoader refuses these assignments after
    ``__init__`` (a running iterator would not see them): the copy has no iterator yet.
    """
    import copy

    out = copy.copy(dataloader)
    object.__setattr__(out, "_iterator", None)
    if batch_sampler is not None:
        object.__setattr__(out, "batch_sampler", batch_sampler)
    if sampler is not None:
        object.__setattr__(out, "sampler", sampler)
    return out


def observe_dataloaders(strategy: Any, observer: Any) -> Any:
    """Have ``observer(dataloader) -> dataloader`` see every loader ``strategy.process_dataloader`` returns.

    A sync strategy offers this itself (``SyncStrategyMixin.observe_dataloaders``). Any other strategy's
    ``process_dataloader`` (public) is wrapped on the instance while it has observers. Returns the undo.
    """
    own = getattr(strategy, "observe_dataloaders", None)
    if own is not None:
        return own(observer)
    observers: list[Any] | None = strategy.__dict__.get(_OBSERVERS)
    if observers is None:
        observers = []
        original = strategy.process_dataloader
        watching = observers

        def process_dataloader(dataloader: object) -> object:
            dataloader = original(dataloader)
            for fn in tuple(watching):
                dataloader = fn(dataloader)
            return dataloader

        strategy.__dict__[_OBSERVERS] = observers
        strategy.__dict__[_OBSERVED] = strategy.__dict__.get("process_dataloader")
        strategy.process_dataloader = process_dataloader

    def undo() -> None:
        current = strategy.__dict__.get(_OBSERVERS)
        if current is None or observer not in current:
            return
        current.remove(observer)
        if not current:  # the last observer: the strategy's own process_dataloader again
            strategy.__dict__.pop(_OBSERVERS)
            previous = strategy.__dict__.pop(_OBSERVED, None)
            if previous is None:
                strategy.__dict__.pop("process_dataloader", None)
            else:
                strategy.__dict__["process_dataloader"] = previous

    observers.append(observer)
    return undo


_OBSERVERS = "_lightning_sync_dataloader_observers"
_OBSERVED = "_lightning_sync_process_dataloader"


def _exact_eval_names_fit() -> bool:
    from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
    from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs
    from torch.utils.data import BatchSampler, SequentialSampler

    inner = SequentialSampler(range(3))
    wrapper = DistributedSamplerWrapper(inner, num_replicas=1, rank=0)
    return (wrapped_sampler(wrapper) is inner and callable(_reinstantiate_wrapped_cls)
            and {"dataloader", "sampler", "mode"} <= _params(_get_dataloader_init_args_and_kwargs)
            and unwrap_index_batch_sampler(_IndexBatchSamplerWrapper(BatchSampler(inner, 2, False))).batch_size == 2)


# --------------------------------------------------------------------------- trainer loops


def stop_epoch_after(trainer: Any, batches: int, val_check_batch: int | None) -> None:
    """End the running training epoch after ``batches`` batches (validating at ``val_check_batch``).

    Lightning has no public way to shorten the running epoch; its epoch loop reads ``max_batches``.
    """
    trainer.fit_loop.max_batches = batches
    if val_check_batch is not None:
        trainer.val_check_batch = val_check_batch


def batch_size_of(batch: Any) -> int:
    """A batch's sample count as ``self.log`` infers it (the first tensor's length; 1 when there is none)."""
    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        return int(extract_batch_size(batch))
    except Exception:  # noqa: BLE001 - Lightning raises MisconfigurationException on a batch without tensors
        return 1


def running_results(trainer: Any) -> dict[str, Any]:
    """The running loop's logged values (``self.log`` in its hooks: training, or the evaluation running now): a
    dict of torchmetrics ``Metric`` objects whose states hold the epoch's accumulation (``_ResultMetric``:
    ``value``, ``cumulated_batch_size``). Keys appear as they are first logged."""
    results = trainer._results
    return results if results is not None else {}


def train_combined_loader(trainer: Any) -> Any:
    """The fit loop's ``CombinedLoader`` (its ``limits`` hold the batch count of each training loader).

    ``trainer.train_dataloader`` gives the loaders but not their limits; a resume on another world
    size re-counts them (``lightning_sync.resume.EpochLengthSync``).
    """
    return trainer.fit_loop._combined_loader


def load_pending_train_loader_state(trainer: Any) -> bool:
    """Apply the checkpoint's training-loader state if Lightning set the loader up before loading it.

    ``trainer.estimated_stepping_batches`` (read in ``configure_optimizers`` by every schedule that
    needs the total step count, e.g. OneCycleLR) makes the fit loop set up its data and create the
    iterator before the checkpoint is restored. Lightning then never applies the checkpoint's loader
    state (``_FitLoop._load_combined_loader_states`` runs only inside that first set-up) and a
    mid-epoch resume replays the epoch from its first batch. Returns whether it applied a state
    (the training iterator is created anew).
    """
    loop = trainer.fit_loop
    if not loop.restarting or not loop._combined_loader_states_to_load or loop._combined_loader is None:
        return False
    loop._load_combined_loader_states()
    if loop._data_fetcher is not None:
        iter(loop._data_fetcher)  # the resumed iterator, from the loaded position
    return True


def slurm_requeue_signal(trainer: Any) -> int | None:
    """The signal Lightning's SLURM auto-requeue handler listens to, or None when it has none."""
    from lightning.fabric.plugins.environments.slurm import SLURMEnvironment

    env = getattr(trainer.strategy, "cluster_environment", None)
    if not isinstance(env, SLURMEnvironment) or not env.auto_requeue:
        return None
    return env.requeue_signal if env.requeue_signal is not None else int(signal.SIGUSR1)


#: The start of Lightning's warning that its padded DistributedSampler evaluates some samples twice
#: (``_DataConnector._resolve_sampler``, under validate/test): untrue under ddp_sync's exact evaluation.
PADDED_SAMPLER_WARNING = r"Using `DistributedSampler` with the dataloaders\. During `trainer\.(validate|test)\(\)`"


def silence_padded_sampler_warning() -> Any:
    """Filter out :data:`PADDED_SAMPLER_WARNING` (only that one); returns the filter for :func:`restore_warning`."""
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    return ignore_in_place(PADDED_SAMPLER_WARNING, PossibleUserWarning)


#: Lightning's warning at a mid-epoch resume with a training loader it has no state of
#: (``_TrainingEpochLoop.reset``): untrue under ``world_size_invariant=True``, whose loader's position is in
#: ddp_sync's checkpoint entry.
NOT_RESUMABLE_WARNING = r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader"


def silence_not_resumable_warning() -> Any:
    """Filter out :data:`NOT_RESUMABLE_WARNING` (only that one); returns the filter for :func:`restore_warning`."""
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    return ignore_in_place(NOT_RESUMABLE_WARNING, PossibleUserWarning)


def _not_resumable_warning_fits() -> bool:
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    return NOT_RESUMABLE_WARNING in inspect.getsource(_TrainingEpochLoop.reset)


def restore_warning(entry: Any) -> None:
    """Remove a filter :func:`ignore_in_place` (or a ``silence_*`` function) added (idempotent)."""
    import warnings

    filters: list[Any] = warnings.filters  # type: ignore[assignment]  # a list at run time
    if entry in filters:
        filters.remove(entry)  # in place, as ignore_in_place added it


def ignore_in_place(message: str, category: type[Warning]) -> Any:
    """An "ignore" filter for ``message`` (a regular expression, as ``warnings.filterwarnings`` takes it) put first
    in ``warnings.filters`` in place, without ``warnings.filterwarnings``: that also tells every module's
    registry to forget which warnings it has shown, so each "default" warning Lightning and torch had already shown
    once (a deprecation at each evaluation) would be shown again at every ``validate``/``test``. An ignored warning
    leaves no entry in a registry, so nothing is cached while the filter is in or after it is removed."""
    import re
    import warnings

    entry = ("ignore", re.compile(message, re.I), category, None, 0)  # the tuple filterwarnings makes
    filters: list[Any] = warnings.filters  # type: ignore[assignment]  # a list at run time
    filters.insert(0, entry)
    return entry


def _padded_warning_fits() -> bool:
    import re

    from lightning.pytorch.trainer.connectors.data_connector import _DataConnector

    source = inspect.getsource(_DataConnector._resolve_sampler)
    return re.search(PADDED_SAMPLER_WARNING.replace("(validate|test)", r"{trainer_fn\.value}"), source) is not None


def is_run_stage_barrier(name: str | None) -> bool:
    """Whether ``strategy.barrier(name)`` is the one ``Trainer._run_stage`` calls first, right after
    ``Trainer._run`` registered the signal handlers (SLURM's requeue handler among them)."""
    return name == "run-stage"


def install_step_flag_broadcast(trainer: Any, step_boundary: Any) -> Any:
    """Replace, on this trainer's training epoch loop, the broadcast of rank 0's SIGTERM flag that
    Lightning runs at the start of every training step (``_TrainingEpochLoop._broadcast_sigterm_tensor``,
    with more than one rank) by ``step_boundary(trainer)``. Returns the loop."""
    loop = trainer.fit_loop.epoch_loop
    loop._broadcast_sigterm_tensor = lambda: step_boundary(trainer)
    return loop


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """The checkpoint dict ``trainer.save_checkpoint`` would write now, before the strategy's parts add theirs
    (``Trainer._checkpoint_connector.dump_checkpoint``)."""
    checkpoint: dict[str, Any] = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    return checkpoint


def loops_state(trainer: Any) -> dict[str, Any]:
    """The ``"loops"`` entry of the checkpoint ``dump_checkpoint`` would make now (the loops' progress and the
    training loader's position)."""
    state: dict[str, Any] = trainer._checkpoint_connector._get_loops_state_dict()
    return state


def remove_step_flag_broadcast(loop: Any) -> None:
    if loop is not None:
        loop.__dict__.pop("_broadcast_sigterm_tensor", None)


def raise_sigterm_exception() -> None:
    """What Lightning's step broadcast does when rank 0 got SIGTERM: meet, then leave the loop."""
    import contextlib

    import torch.distributed as dist
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    with contextlib.suppress(Exception):
        dist.barrier()
    raise SIGTERMException()


# --------------------------------------------------------------------------- launcher


def check_can_spawn_children(launcher: Any) -> None:
    launcher._check_can_spawn_children()


# --------------------------------------------------------------------------- checks


def _ddp_vars() -> dict[str, Any]:
    return vars(DDPStrategy())


def _trainer() -> Any:
    from lightning.pytorch import Trainer

    return Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   accelerator="cpu", devices=1)


def _params(fn: Any) -> set[str]:
    return set(inspect.signature(fn).parameters)


# --------------------------------------------------------------------------- evaluation / predict loops


def loop_dataloaders(loop: Any) -> list[Any]:
    """An evaluation or predict loop's processed dataloaders, flattened (``dataloader_idx`` order)."""
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    combined = getattr(loop, "_combined_loader", None)
    return list(combined.flattened) if isinstance(combined, CombinedLoader) else []


def seen_batch_indices(batch_sampler: object) -> list[Any] | None:
    """The list in which Lightning's index batch-sampler wrapper keeps every batch's indices, if any."""
    seen = getattr(batch_sampler, "seen_batch_indices", None)
    return seen if isinstance(seen, list) else None


def _wrapper_keeps_indices() -> bool:
    from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
    from torch.utils.data import BatchSampler, SequentialSampler

    wrapper = _IndexBatchSamplerWrapper(BatchSampler(SequentialSampler(range(3)), 2, False))
    return list(wrapper) == [[0, 1], [2]] and seen_batch_indices(wrapper) == [[0, 1], [2]]


def _step_broadcast_fits() -> bool:
    from lightning.pytorch import Trainer
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    run, run_stage = inspect.getsource(Trainer._run), inspect.getsource(Trainer._run_stage)
    return (callable(getattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", None))
            and "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
            and run.index("register_signal_handlers()") < run.index("self._run_stage()")
            and run_stage.lstrip().split("\n")[0].startswith("def _run_stage")
            and 'self.strategy.barrier("run-stage")' in run_stage)


def _module_has_fx_name() -> bool:
    from lightning.pytorch import LightningModule

    return "_current_fx_name" in vars(LightningModule())


def _result_metric_file_fits() -> bool:
    from lightning.pytorch.trainer.connectors.logger_connector import result

    from lightning_sync._compat.torch_api import LIGHTNING_RESULT_FILE

    # compute (epoch-end sync) and update (per-step sync) call the strategy's reduce with the metric as self
    methods = [getattr(result._ResultMetric, name, None) for name in ("compute", "update")]
    return all(callable(m) and m.__code__.co_filename.endswith(LIGHTNING_RESULT_FILE)
               and "meta" in m.__code__.co_names for m in methods)


def _training_results_fit() -> bool:
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection, _ResultMetric
    from torchmetrics import Metric

    return (isinstance(_trainer().fit_loop.epoch_loop._results, _ResultCollection) and issubclass(_ResultMetric, Metric)
            and isinstance(getattr(type(_trainer()), "_results", None), property))


def _main_port_fits() -> bool:
    from lightning.fabric.plugins.environments.lightning import LightningEnvironment

    env = LightningEnvironment()  # a throwaway one; os.environ untouched
    if not isinstance(getattr(env, "_main_port", None), int):
        return False
    env._main_port = 29123
    return env.main_port == 29123


def _model_parallel_fits() -> bool:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return all(callable(getattr(ModelParallelStrategy, name, None))
               for name in ("_setup_distributed", "_get_process_group_backend", "_configure_launcher")) and \
        {"_timeout", "_save_distributed_checkpoint", "_data_parallel_size", "_tensor_parallel_size"} <= set(
            vars(ModelParallelStrategy()))


def _model_checkpoint_modules() -> set[str]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return {ModelCheckpoint.__module__, "pytorch_lightning.callbacks.model_checkpoint"}


def called_from_model_checkpoint(frame: Any) -> bool:
    """Whether ``frame`` (a strategy method's caller) is Lightning's ``ModelCheckpoint`` (its ``file_exists``, its
    "did the monitored value improve" and its time-based skip: ``strategy.reduce_boolean_decision`` or, before
    Lightning 2.6, ``strategy.broadcast`` of a bool)."""
    return frame is not None and frame.f_globals.get("__name__") in _model_checkpoint_modules()


def _model_checkpoint_decides_through_strategy() -> bool:
    from lightning.pytorch.callbacks import ModelCheckpoint

    source = inspect.getsource(ModelCheckpoint.file_exists)  # (Lightning < 2.6: strategy.broadcast of a bool)
    return "trainer.strategy.reduce_boolean_decision(" in source or "trainer.strategy.broadcast(" in source


TOUCH_POINTS: tuple[TouchPoint, ...] = (
    TouchPoint("lightning.pytorch.callbacks.ModelCheckpoint.file_exists (its strategy.reduce_boolean_decision, "
               "or strategy.broadcast before Lightning 2.6)",
               "ddp_sync_ft keeps ModelCheckpoint's decisions inside the replica group",
               _model_checkpoint_decides_through_strategy),
    TouchPoint("lightning.pytorch.strategies.DDPStrategy._ddp_kwargs", "initial-parameter check: what DDP will not "
               "overwrite", lambda: isinstance(getattr(DDPStrategy(), "_ddp_kwargs", None), dict)),
    TouchPoint("lightning.pytorch.strategies.Strategy._checkpoint_io", "the atomic CheckpointIO as the default",
               lambda: hasattr(DDPStrategy(), "_checkpoint_io")),
    TouchPoint("lightning.pytorch.Trainer._fit_impl", "resume='auto': the launched fit without ckpt_path",
               _fit_impl_fits),
    TouchPoint("lightning.pytorch.trainer.connectors.data_connector._DataConnector._resolve_sampler (its warning "
               "text)", "exact evaluation silences Lightning's 'evaluated exactly once' warning", _padded_warning_fits),
    TouchPoint("lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop.reset (its warning text)",
               "world_size_invariant's resumed loader silences Lightning's 'dataloader is not resumable' warning",
               _not_resumable_warning_fits),
    TouchPoint("lightning.pytorch.strategies.DDPStrategy._get_process_group_backend",
               "NCCL flight recorder configured before the process group exists",
               lambda: callable(getattr(DDPStrategy(), "_get_process_group_backend", None))),
    TouchPoint("lightning.pytorch.LightningModule._current_fx_name", "names the running hook in guard messages",
               _module_has_fx_name),
    TouchPoint("lightning.pytorch.strategies.DDPStrategy._layer_sync", "sync_batchnorm=True -> portable SyncBatchNorm",
               lambda: "_layer_sync" in _ddp_vars()),
    TouchPoint("lightning.pytorch.strategies.DDPStrategy._start_method, _launcher and _configure_launcher",
               "the Hydra-aware launcher",
               lambda: {"_start_method", "_launcher"} <= set(_ddp_vars())
               and callable(getattr(DDPStrategy, "_configure_launcher", None))),
    TouchPoint("lightning.pytorch.strategies.ModelParallelStrategy._setup_distributed, _timeout, "
               "_save_distributed_checkpoint, _get_process_group_backend, _data_parallel_size and "
               "_tensor_parallel_size",
               "SyncModelParallelStrategy: the parts around the group's creation; sharded checkpoints' per-rank "
               "files; data parallel over every rank for 'auto' sizes",
               _model_parallel_fits),
    TouchPoint("lightning.pytorch.strategies.ModelParallelStrategy.save_checkpoint (its first self.broadcast: "
               "the path)", "sharded checkpoints: each rank's state file goes where rank 0's path says",
               save_broadcasts_path_first),
    TouchPoint("DDPStrategy.load_checkpoint and TorchCheckpointIO.load_checkpoint (weights_only=...)",
               "resume: weights_only passed only where Lightning takes it (2.6.0 on)",
               lambda: _LOAD_CHECKPOINT_TAKES_WEIGHTS_ONLY == (LIGHTNING_VERSION >= Version("2.6.0"))
               and _CHECKPOINT_IO_TAKES_WEIGHTS_ONLY == (LIGHTNING_VERSION >= Version("2.6.0"))),
    TouchPoint("lightning.pytorch.loops._FitLoop.max_batches and Trainer.val_check_batch",
               "uneven_batches='stop_together'",
               lambda: hasattr(_trainer().fit_loop, "max_batches")
               and "trainer.val_check_batch" in inspect.getsource(type(_trainer().fit_loop))),
    TouchPoint("lightning.pytorch.Trainer._results (the running loop's dict of _ResultMetric, torchmetrics Metrics)",
               "uneven_batches='join': a stand-in step's self.log values are not accumulated",
               _training_results_fit),
    TouchPoint("lightning.pytorch.loops._FitLoop._combined_loader (CombinedLoader.limits)",
               "resume on another world size: batch count of later epochs",
               lambda: hasattr(_trainer().fit_loop, "_combined_loader")),
    TouchPoint("lightning.pytorch.Trainer._checkpoint_connector.dump_checkpoint(weights_only=...) and "
               "_get_loops_state_dict",
               "ddp_sync_ft: the checkpoint a recovering replica group is sent, at a step boundary",
               lambda: "weights_only" in _params(_trainer()._checkpoint_connector.dump_checkpoint)
               and callable(getattr(_trainer()._checkpoint_connector, "_get_loops_state_dict", None))),
    TouchPoint("lightning.pytorch.strategies.DDPStrategy._timeout", "torchrun restart: process group timeout",
               lambda: "_timeout" in _ddp_vars()),
    TouchPoint("lightning.pytorch.loops._FitLoop (_combined_loader_states_to_load, _load_combined_loader_states, "
               "_data_fetcher)", "mid-epoch resume when configure_optimizers read estimated_stepping_batches",
               lambda: callable(getattr(_trainer().fit_loop, "_load_combined_loader_states", None))
               and hasattr(_trainer().fit_loop, "_combined_loader_states_to_load")
               and hasattr(_trainer().fit_loop, "_data_fetcher")),
    TouchPoint("lightning.fabric.strategies.launchers.subprocess_script._launch_process_observer",
               "Hydra launcher: the job ends when a rank dies", lambda: "child_processes" in _params(launch_process_observer)),
    TouchPoint("lightning.fabric.plugins.environments.LightningEnvironment._main_port",
               "Hydra launcher: a fresh port for each trainer call's process group", _main_port_fits),
    TouchPoint("lightning.fabric.utilities.distributed._set_num_threads_if_needed", "Hydra launcher: threads per rank",
               lambda: "num_processes" in _params(set_num_threads_if_needed)),
    TouchPoint("lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher (get_extra_results, "
               "update_main_process_results)", "spawned/forked ranks hand the root seed back to the launching process",
               lambda: all(callable(getattr(MultiProcessingLauncher, n, None))
                           for n in ("get_extra_results", "update_main_process_results"))
               and {"strategy", "start_method"} <= _params(MultiProcessingLauncher.__init__)),
    TouchPoint("lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher "
               "(_call_children_scripts, _check_can_spawn_children, procs)", "base class of HydraDDPLauncher",
               lambda: all(callable(getattr(SubprocessScriptLauncher, n, None))
                           for n in ("launch", "_call_children_scripts", "_check_can_spawn_children"))),
    TouchPoint("lightning.pytorch.loops (_EvaluationLoop, _PredictionLoop)._combined_loader",
               "ValidationGather / PredictionWriter: which loader a batch came from",
               lambda: hasattr(_trainer().predict_loop, "_combined_loader")
               and hasattr(_trainer().validate_loop, "_combined_loader")),
    TouchPoint("lightning.pytorch.overrides.distributed._IndexBatchSamplerWrapper.seen_batch_indices",
               "PredictionWriter empties it (it keeps every index of the epoch) when nothing reads it",
               _wrapper_keeps_indices),
    TouchPoint("lightning.pytorch.LightningModule._trainer", "exact_eval: the trainer state before attaching",
               lambda: "_trainer" in vars(__import__("lightning.pytorch", fromlist=["LightningModule"]).LightningModule())),
    TouchPoint("lightning.pytorch.utilities.data._get_dataloader_init_args_and_kwargs, "
               "lightning.fabric.utilities.data._reinstantiate_wrapped_cls, _IndexBatchSamplerWrapper._batch_sampler, "
               "_DatasetSamplerWrapper._sampler", "exact_eval: evaluation loaders re-cut with an exact batch sampler; "
               "index recording: Lightning's index wrapper kept outermost",
               _exact_eval_names_fit),
    TouchPoint("lightning.pytorch.loops._TrainingEpochLoop._broadcast_sigterm_tensor (called by advance each step); "
               "Trainer._run registers signal handlers, then _run_stage calls strategy.barrier('run-stage')",
               "SLURM requeue checkpoint at a step every rank agrees on (lightning_sync.preemption)",
               _step_broadcast_fits),
    TouchPoint("lightning.pytorch.trainer.connectors.logger_connector.result._ResultMetric.compute (its file name)",
               "the collective guard names the logged metric Lightning is syncing (compute and update)", _result_metric_file_fits),
    TouchPoint("lightning.fabric.strategies.registry._StrategyRegistry", "type of StrategyRegistry (annotations)",
               lambda: callable(getattr(StrategyRegistry, "register", None))
               and {"name", "strategy", "description", "override"} <= _params(StrategyRegistry.register)),
)
