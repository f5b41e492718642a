"""No silent drift: replicas, data sharding, batch counts and logged keys checked across ranks.

* :class:`ParameterConsistencyCheck` (public): every ``every_n_steps`` optimizer steps, compares
  parameter, buffer (and optionally optimizer-state) checksums across ranks with one small gather.
* :func:`warn_if_initial_parameters_differ`: called by the strategy just before the DDP wrap; warns
  only about initial values that differ across ranks and that the wrap does not overwrite.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_sync import collectives
from lightning_sync._compat.torch_api import DDP_IGNORE_ATTR, ddp_ignored_names
from lightning_sync.errors import ParameterDivergenceError, RankMismatchError, format_ranks
from lightning_sync.guard.checksums import checksum, named_tensors, replica_group_key

__all__ = ["ParameterConsistencyCheck", "check_replicas", "warn_if_initial_parameters_differ"]


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "module", module)


def _ddp_synced_buffers(module: torch.nn.Module) -> set[str]:
    """Buffers DDP overwrites with rank 0's before every forward: they may differ in between."""
    if not isinstance(module, torch.nn.parallel.DistributedDataParallel) or not module.broadcast_buffers:
        return set()
    ignored = ddp_ignored_names(module.module)
    return {name for name, _ in module.module.named_buffers() if name not in ignored}


def check_replicas(module: torch.nn.Module, buffers: bool = True, optimizer: torch.optim.Optimizer | None = None,
                   where: str = "") -> None:
    """Raise :class:`~lightning_sync.ParameterDivergenceError` unless every rank holds the same values.

    All ranks must call it; it blocks for one gather of one float64 checksum per tensor.
    Buffers that DDP broadcasts before every forward (``broadcast_buffers=True``) are skipped: they
    legitimately differ between forwards (BatchNorm statistics of each rank's batch). Sharded
    tensors (FSDP2's and tensor parallelism's ``DTensor``) are compared on their local shards among
    the ranks that hold the same shard; with FSDP2 over every rank no two ranks do, so only the
    replicated tensors (buffers, parameters left unsharded) are compared there.

    Args:
        module: the model, DDP-wrapped or not.
        buffers: compare buffers too.
        optimizer: also compare its state tensors (momentum, Adam moments).
        where: shown in the error (e.g. ``"after step 40"``).
    """
    if not collectives.is_distributed():
        return
    skip = _ddp_synced_buffers(module)
    named = [(name, replica_group_key(t), checksum(t)) for name, t in named_tensors(_unwrap(module), buffers, skip)]
    if optimizer is not None:
        for i, state in enumerate(optimizer.state.values()):
            for key, value in sorted(state.items()):
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    named.append((f"optimizer.state[{i}].{key}", replica_group_key(value), checksum(value)))
    gathered = collectives.gather_objects(named, safe=True)
    assert gathered is not None
    names = [[n for n, _, _ in rank_items] for rank_items in gathered]
    if any(n != names[0] for n in names):
        raise RankMismatchError(f"check_replicas: ranks hold different sets of tensors: "
                                f"{format_ranks({r: len(n) for r, n in enumerate(names)})} tensors. Build the same "
                                "model on every rank.", {r: len(n) for r, n in enumerate(names)})
    for i, name in enumerate(names[0]):
        holders: dict[str, dict[int, float]] = {}  # which shard -> the ranks holding it -> their checksum
        for r, items in enumerate(gathered):
            holders.setdefault(items[i][1], {})[r] = items[i][2]
        for shard, values in holders.items():
            if shard == "partial" or len(set(values.values())) <= 1 or all(math.isnan(v) for v in values.values()):
                continue
            ignored = ddp_ignored_names(_unwrap(module))
            hint = (f"it is listed in {DDP_IGNORE_ATTR}, so DDP never syncs it: synchronise it by "
                    "hand or stop excluding it" if name in ignored else
                    "a buffer is updated on some ranks only, or DDP runs with broadcast_buffers=False" if
                    name in dict(_unwrap(module).named_buffers()) else
                    "optimizer state is per rank: a rank-dependent step or a restored state on one rank only"
                    if name.startswith("optimizer.") else
                    "look for a parameter update outside the optimizer step on some ranks, a parameter DDP does not "
                    "manage (frozen, excluded, or created after the wrap), or find_unused_parameters issues")
            what = f"{name!r} ({shard}, held by ranks {sorted(values)})" if shard else repr(name)
            raise ParameterDivergenceError(
                f"model replicas diverged{' ' + where if where else ''}: {what} has checksum "
                f"{format_ranks({r: f'{v:.17g}' for r, v in values.items()})}; {hint}. Every rank must apply the "
                "same updates to every parameter and buffer.", name, values)


def _kept_at_wrap(module: torch.nn.Module, ddp_kwargs: Mapping[str, Any] | None) -> dict[str, str]:
    """Tensors the DDP wrap will NOT overwrite with rank 0's values -> why (torch's init sync rules)."""
    kwargs = {} if ddp_kwargs is None else dict(ddp_kwargs)
    ignored = ddp_ignored_names(module)
    if not kwargs.get("init_sync", True):
        why = "DDP(init_sync=False) broadcasts nothing at wrap time"
        return {n: why for n, _ in [*module.named_parameters(), *module.named_buffers()]}
    buffers_synced = kwargs.get("forward_sync_buffers") is not None or kwargs.get("broadcast_buffers") is not False
    kept = {n: f"listed in {DDP_IGNORE_ATTR}" for n, _ in
            [*module.named_parameters(), *module.named_buffers()] if n in ignored}
    if not buffers_synced:
        kept |= {n: "a buffer, and DDP runs with broadcast_buffers=False" for n, _ in module.named_buffers()
                 if n not in kept}
    return kept


def warn_if_initial_parameters_differ(module: torch.nn.Module, ddp_kwargs: Mapping[str, Any] | None = None,
                                      wrapped: bool = True) -> list[str]:
    """Before the DDP wrap: warn (on rank 0) about initial values that differ across ranks AND survive it.

    All ranks must call it (one small gather). DDP's wrap broadcasts rank 0's parameters and buffers,
    so a model built in ``__init__`` before the process group exists, with a different seed per rank,
    still starts equal everywhere: no warning. What the wrap leaves alone keeps its per-rank values:
    parameters and buffers DDP is told to ignore (``DDP_IGNORE_ATTR``), buffers when DDP runs with
    ``broadcast_buffers=False``, everything with ``init_sync=False`` or without a DDP wrap
    (``wrapped=False``). Only those are compared, and the warning names each one that differs.

    Args:
        module: the model about to be wrapped (or a wrapped one).
        ddp_kwargs: the keyword arguments DDP is built with (``broadcast_buffers``, ``init_sync``, ...).
        wrapped: False when no DDP wrap follows (every tensor keeps its per-rank value).

    Returns:
        The names of the tensors that differ across ranks and will stay different.
    """
    if not collectives.is_distributed():
        return []
    module = _unwrap(module)
    kept = ({n: "no DDP wrap copies rank 0's values" for n, _ in [*module.named_parameters(),
                                                                    *module.named_buffers()]}
            if not wrapped else _kept_at_wrap(module, ddp_kwargs))
    # only what the wrap keeps (usually nothing): a checksum reads its whole tensor. The gather runs
    # on every rank even with nothing to compare, so the ranks stay in step.
    mine = [(name, checksum(tensor)) for name, tensor in named_tensors(module, buffers=True) if name in kept]
    gathered = collectives.gather_objects(mine, safe=True)
    assert gathered is not None
    if all(g == gathered[0] for g in gathered):
        return []
    by_rank = [dict(g) for g in gathered]
    order = [n for n, _ in mine]
    names = order + sorted(set().union(*by_rank) - set(order))
    differ = [n for n in names if len({r.get(n) for r in by_rank}) > 1
              and not all(isinstance(r.get(n), float) and math.isnan(r[n]) for r in by_rank)]
    if not differ:
        return []
    shown = "; ".join(f"{n!r} ({kept.get(n, 'not on every rank')}): checksum "
                      f"{format_ranks({r: f'{d[n]:.10g}' if n in d else 'missing' for r, d in enumerate(by_rank)})}"
                      for n in differ[:5])
    more = f"; and {len(differ) - 5} more" if len(differ) > 5 else ""
    rank_zero_warn(
        f"The ranks built the model with different initial values in {len(differ)} tensor(s) that the DDP wrap does "
        f"not overwrite with rank 0's, so they stay different on every rank: {shown}{more}. The random seeds were "
        "not synchronised when the model was built (typically a per-rank or time-based seed before trainer.fit). "
        "Build these tensors in configure_model/setup (ddp_sync seeds them from the shared root seed), seed every "
        "rank identically before building the model, or copy rank 0's values yourself "
        "(torch.distributed.broadcast)."
    )
    return differ


class ParameterConsistencyCheck(pl.Callback):
    """Raise :class:`~lightning_sync.ParameterDivergenceError` as soon as model replicas drift apart.

    Every ``every_n_steps`` optimizer steps (and at the end of training) every rank computes one
    float64 checksum per parameter and buffer (optionally per optimizer-state tensor) and the ranks
    compare them with one small gather. Catches a buffer updated on some ranks only, a parameter
    excluded from DDP (listed in the module's DDP ignore list) or updated outside the optimizer, and
    optimizer state that differs. Buffers DDP re-broadcasts before every forward are skipped.

    Works with any DDP strategy, and with FSDP2 (``ModelParallelStrategy``, ``"model_parallel_sync"``):
    there sharded parameters and optimizer states are compared on the local shards of the ranks that hold
    the same shard (none, with FSDP2 over every rank), replicated tensors on every rank. All ranks must run
    it (add it to the Trainer on every rank).

    Args:
        every_n_steps: check period in optimizer steps.
        buffers: compare buffers.
        optimizer_state: compare the first optimizer's state tensors.
    """

    def __init__(self, every_n_steps: int = 100, buffers: bool = True, optimizer_state: bool = False) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"ParameterConsistencyCheck(every_n_steps={every_n_steps!r}): must be a positive int.")
        self.every_n_steps = every_n_steps
        self.buffers = buffers
        self.optimizer_state = optimizer_state
        self.checks = 0

    def _check(self, trainer: pl.Trainer, where: str) -> None:
        model = trainer.strategy.model
        assert model is not None
        optimizer = trainer.optimizers[0] if self.optimizer_state and trainer.optimizers else None
        check_replicas(model, buffers=self.buffers, optimizer=optimizer, where=where)
        self.checks += 1

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step and step % self.every_n_steps == 0 and step != getattr(self, "_last", None):
            self._last = step
            self._check(trainer, f"after optimizer step {step}")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check(trainer, "at the end of training")
