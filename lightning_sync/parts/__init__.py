"""The guarantees of a sync strategy, as parts that any Lightning strategy composes.

A sync strategy is a Lightning strategy plus an ordered list of parts::

    class SyncDDPStrategy(SyncStrategyMixin, DDPStrategy): ...        # every part
    class SyncXStrategy(SyncStrategyMixin, XStrategy): ...            # the parts that fit X

``SyncStrategyMixin`` (``mixin.py``) overrides the Lightning strategy methods once and calls each
part's hooks, in list order, around ``super()``. A part (``Part``) holds one guarantee and its state,
owns its callbacks (put first in ``trainer.callbacks``, on every rank), is switched off by leaving it
out of the list, and never calls another part except through ``strategy.part(Kind)``.

The parts, in the order ``default_parts`` lists them (their hooks run in this order):

=======================  ===============================================================  ==========
part                     guarantee                                                        module
=======================  ===============================================================  ==========
``GuardPart``            a collective on some ranks only is an error naming the call      guard.py
                         sites, never a hang (``guard=``, ``guard_timeout=``)
``ExactEvalPart``        every evaluation sample on one rank, once; exact ``sync_dist``   evaluation.py
                         means (``exact_eval=``)
``SeedLineagePart``      one root seed from rank 0, derived per-rank/worker streams       seed.py
                         (``seed=``)
``CheckpointStatePart``  per-rank RNG and loader state in ``checkpoint["lightning_sync"]``  checkpoint.py
                         (sharded checkpoints: a file of each rank's own in the directory)
``ResumableDataPart``    mid-epoch resume at the exact batch (``resume=``)                data.py
``UnevenBatchPart``      uneven training data: a clear error, a common stop, or every     uneven.py
                         batch of every rank trained on (``uneven_batches=``)
``RequeuePart``          SLURM requeue and SIGTERM met at a step boundary                 requeue.py
``TeardownPart``         clean end on every rank; the group kept or destroyed (last)      teardown.py
=======================  ===============================================================  ==========

Hooks (``Part``; every one optional, called on every rank): ``before_setup_distributed``,
``setup_distributed(strategy, fresh)``, ``setup(strategy, trainer)``, ``callbacks(strategy)``,
``process_dataloader(strategy, loader, trainer)``, ``step_context`` (around each training, validation
and test step, and each backward), ``scale_loss``, ``run_stage_started``, ``on_train_start``,
``on_save_checkpoint(strategy, checkpoint, directory)``, ``after_save_checkpoint(strategy, directory)``,
``on_load_checkpoint(strategy, checkpoint, fitting, directory)`` (``directory``: a sharded checkpoint's),
``configure_launcher``, ``on_exception``, ``before_teardown``, ``closing`` (the run's last collectives,
group healthy), ``after_teardown`` (always). Callbacks that must see each prepared dataloader before
its first ``iter()`` register with ``strategy.observe_dataloaders`` (after the parts; on Lightning's own
strategies ``_compat.observe_dataloaders`` gives the same).

Add a guarantee: a ``Part`` subclass in a module of its own here, with the hooks it needs, put in
``default_parts`` (and in the list of every strategy it fits) behind a constructor argument.
Add a strategy: ``class SyncXStrategy(SyncStrategyMixin, XStrategy)`` in its own module, whose
``__init__`` takes X's arguments plus the parts' and calls ``self._init_parts([...])``; what is
specific to X (DDP's ``configure_ddp``, say) stays in that class.

The names below are resolved on first use (as in ``lightning_sync.guard``), so a part's module
importing ``parts.base`` does not import every other part.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["CheckpointStatePart", "ExactEvalPart", "GuardPart", "Part", "RequeuePart", "ResumableDataPart",
           "SeedLineagePart", "SyncStrategyMixin", "TeardownPart", "UnevenBatchPart", "default_parts"]

_WHERE = {
    "CheckpointStatePart": "checkpoint",
    "ExactEvalPart": "evaluation",
    "GuardPart": "guard",
    "Part": "base",
    "RequeuePart": "requeue",
    "ResumableDataPart": "data",
    "SeedLineagePart": "seed",
    "SyncStrategyMixin": "mixin",
    "TeardownPart": "teardown",
    "UnevenBatchPart": "uneven",
    "default_parts": "defaults",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
