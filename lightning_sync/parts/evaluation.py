"""``ExactEvalPart``: every evaluation sample on exactly one rank, once, and exact ``sync_dist`` means."""

from __future__ import annotations

from typing import Any

from lightning_sync._compat import lightning_api as _compat
from lightning_sync.parts.base import Part
from lightning_sync.sampling import ExactEvaluation, evaluation_limit, exact_eval_dataloader

__all__ = ["ALL_GATHER_FIX", "ExactEvalPart"]

ALL_GATHER_FIX = (
    "Under exact evaluation every sample is evaluated once (no padding), so the ranks' last batches can "
    "differ in size. Gather rows with lightning_sync.collectives.all_gather_uneven(tensor) (every rank's rows "
    "concatenated in rank order, and each rank's row count), collect per-sample outputs with "
    "lightning_sync.ValidationGather, or pass exact_eval=False to the strategy for Lightning's padded sampler "
    "(equal batches, some samples twice).")


class ExactEvalPart(Part):
    """Re-cuts validate, test, fit's validation and predict loaders into disjoint, complete shards
    (``lightning_sync.sampling``) and watches per-step collectives on uneven shards."""

    def __init__(self) -> None:
        self.monitor = ExactEvaluation()
        self._quiet_warning: Any = None

    def setup(self, strategy: Any, trainer: Any) -> None:
        if strategy.world_size > 1 and self._quiet_warning is None:
            # Lightning warns that its padded sampler evaluates some samples twice: not under exact evaluation
            self._quiet_warning = _compat.silence_padded_sampler_warning()

    def process_dataloader(self, strategy: Any, dataloader: Any, trainer: Any) -> Any:
        if trainer is None or not (trainer.sanity_checking or trainer.validating or trainer.testing
                                   or trainer.predicting):
            return dataloader
        # the data-parallel ranks (all ranks under DDP; under tensor parallelism, one per replica)
        shards = strategy.distributed_sampler_kwargs
        replicas, rank = int(shards.get("num_replicas", strategy.world_size)), int(shards.get("rank", strategy.global_rank))
        if replicas > 1:
            dataloader = exact_eval_dataloader(dataloader, rank, replicas, predicting=trainer.predicting,
                                               monitor=self.monitor)
        return dataloader

    def check_step_collective(self, strategy: Any, what: str) -> None:
        """A per-step collective (``self.log(sync_dist=True)``, ``self.all_gather``) where ranks' evaluation
        shards differ in length raises ``UnevenEvaluationError`` on every rank instead of hanging."""
        module = strategy.lightning_module
        trainer = _compat.attached_trainer(module)
        if trainer is not None:
            self.monitor.check_step_collective(what, _compat.current_hook_name(module), evaluation_limit(trainer))

    def before_teardown(self, strategy: Any) -> None:
        _compat.restore_warning(self._quiet_warning)
        self._quiet_warning = None
