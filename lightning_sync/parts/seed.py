"""``SeedLineagePart``: one root seed from rank 0, then a derived stream per rank and data-loader worker."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from lightning_sync._compat import lightning_api as _compat
from lightning_sync.parts.base import Part
from lightning_sync.seeding import SeedLineage, WorkerSeeder

__all__ = ["SeedLineagePart", "stream_rank"]


def stream_rank(strategy: Any) -> int:
    """The rank a process's random streams derive from: its global rank, or, where processes of different
    process groups train one model (``FaultTolerantDDPStrategy``'s replica groups), its rank across them
    (``strategy.seed_stream_rank``)."""
    return int(getattr(strategy, "seed_stream_rank", strategy.global_rank))


class SeedLineagePart(Part):
    """The root seed every rank agrees on (rank 0's wins) once per process group and kept for the
    strategy's life; model set-up runs under it (identical layers on every rank), then each rank and
    each data-loader worker switches to its own derived stream. A checkpoint's per-rank RNG states
    replace those streams on resume (``CheckpointStatePart`` stores and hands them over)."""

    def __init__(self, seed: int | None) -> None:
        self.seed_arg = seed
        self.lineage: SeedLineage | None = None
        self.pending_state: dict[str, Any] | None = None  # a checkpoint's lightning_sync state, until setup
        self._announced: int | None = None  # the root seed the banner last named

    def setup_distributed(self, strategy: Any, fresh: bool) -> None:
        if not fresh and self.lineage is not None:
            return
        previous = self.lineage  # one root seed for the strategy's life: fit, then validate/test/predict
        lineage = SeedLineage.agree(self.seed_arg if previous is None else previous.root)
        if previous is None or previous.root != lineage.root:
            self.lineage = lineage  # announced at setup, once a checkpoint being resumed may have replaced it

    def setup(self, strategy: Any, trainer: Any) -> None:
        if self.lineage is None:  # set up without a process group (strategy.setup called directly)
            return
        # Model set-up (configure_model, DDP's broadcast) is done: from here on each rank draws its own
        # random numbers. A checkpoint being resumed supplies the exact states instead.
        self.lineage.load_checkpoint_state(self.pending_state, strategy.global_rank)
        self.pending_state = None
        if self._announced != self.lineage.root:  # one banner, naming the seed the run uses
            self._announced = self.lineage.root
            rank_zero_info(self.lineage.describe(stream_rank(strategy) - strategy.global_rank))
        self.lineage.seed_rank_streams(stream_rank(strategy))

    def process_dataloader(self, strategy: Any, dataloader: Any, trainer: Any) -> Any:
        if self.lineage is not None and getattr(dataloader, "worker_init_fn", "absent") is None:
            dataloader.worker_init_fn = WorkerSeeder(self.lineage, stream_rank(strategy))
        return dataloader

    def configure_launcher(self, strategy: Any) -> None:
        method = _compat.start_method(strategy)
        if method in ("spawn", "fork", "forkserver"):
            # the ranks run in child processes: bring rank 0's seed lineage back with its results
            _compat.set_launcher(strategy, _LineageReturningLauncher(strategy, start_method=method))  # type: ignore[arg-type]

    def adopt_root(self, root: int, world_size: int) -> None:
        """In the launching process of spawned/forked ranks: the root seed rank 0 agreed on."""
        if self.lineage is None or self.lineage.root != root:
            self.lineage = SeedLineage(root=root, world_size=world_size, origin="rank 0 of the last run",
                                       local_seeds=[root])


class _LineageReturningLauncher(_compat.MultiProcessingLauncher):
    """Lightning's launcher for spawned and forked ranks (notebooks), which also hands rank 0's seed lineage
    back to the launching process, so ``trainer.strategy.seed`` is the run's root seed there too."""

    def get_extra_results(self, trainer: Any) -> dict[str, Any]:
        extra: dict[str, Any] = super().get_extra_results(trainer)
        part = _seed_part(trainer.strategy)
        if part is not None and part.lineage is not None:
            extra["lightning_sync_root_seed"] = part.lineage.root
        return extra

    def update_main_process_results(self, trainer: Any, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        root = extra.get("lightning_sync_root_seed")
        part = _seed_part(trainer.strategy)
        if root is not None and part is not None:
            part.adopt_root(int(root), trainer.strategy.world_size)


def _seed_part(strategy: Any) -> SeedLineagePart | None:
    find = getattr(strategy, "part", None)
    return find(SeedLineagePart) if callable(find) else None
