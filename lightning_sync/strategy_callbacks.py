"""Where a sync strategy's own callbacks go in ``trainer.callbacks``: first, on every rank.

Lightning calls a hook on every callback in list order, and some of its callbacks act on rank 0
only: the progress bars compute the epoch's logged metrics (``sync_dist`` reductions, torchmetrics
syncs) in their own ``on_train_epoch_end``, a logger's ``rank_zero_only`` code may read
``trainer.callback_metrics``. Under plain ``ddp`` those reductions still pair up, because every other
rank makes the same ones a moment later (Lightning's logger connector). A collective of ours placed
after such a callback would run first on the ranks that lack it and pair with a metric reduction
on rank 0. So the strategy's own callbacks run before any other in every hook, and lightning_sync's
user-facing callbacks (``ValidationGather``, ``PredictionWriter``, ...) right after them: the order
of our collectives within a hook then depends on nothing a rank has on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["install_first"]

_PACKAGE = __name__.split(".", 1)[0] + "."


def _is_ours(callback: object) -> bool:
    return type(callback).__module__.startswith(_PACKAGE)


def install_first(trainer: Any, own: Sequence[Any]) -> None:
    """Put ``own`` (the strategy's callbacks, in order) first in ``trainer.callbacks``, then every other
    lightning_sync callback, then the rest in their order (idempotent; Lightning's own reordering,
    checkpoint callbacks last, is done by the time the strategy is set up).

    A callback of ``own``'s type that the user added is kept in ``own``'s place instead of a second copy.
    """
    callbacks = getattr(trainer, "callbacks", None)
    if not isinstance(callbacks, list):  # a stand-in trainer (tests call strategy.setup with a mock)
        return
    first: list[Any] = []
    for cb in own:
        present = next((c for c in callbacks if c is cb or type(c) is type(cb)), None)
        first.append(present if present is not None else cb)
    rest = [c for c in callbacks if not any(c is f for f in first)]
    callbacks[:] = first + [c for c in rest if _is_ours(c)] + [c for c in rest if not _is_ours(c)]
