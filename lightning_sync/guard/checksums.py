"""Checksums of parameters and buffers (replicas must agree bit for bit).

A sharded tensor (a ``DTensor``, as FSDP2 and tensor parallelism make) is checked on its local shard:
the ranks that hold the same shard (the same coordinates on every mesh dimension it is sharded
over; any coordinate on a replicated one) must agree, and ranks with different shards are not
compared. :func:`replica_group_key` names that shard.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["checksum", "parameter_checksums", "replica_group_key"]


@functools.cache
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without DTensor (or without distributed)
        return None
    return DTensor


def replica_group_key(tensor: Tensor) -> str:
    """``""`` for an ordinary tensor (every rank holds all of it); for a ``DTensor``, which shard of it this
    rank holds (``"shard (1,) of mesh dims (0,)"``): ranks with the same key hold equal values; ``"partial"``
    when the local values are unreduced partial sums (they differ by design: not compared)."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(tensor, dtensor):
        return ""
    sharded: Any = tensor
    placements = sharded.placements
    if any(p.is_partial() for p in placements):
        return "partial"
    coordinate = sharded.device_mesh.get_coordinate() or []
    dims = tuple(d for d, p in enumerate(placements) if p.is_shard())
    if not dims:
        return ""  # replicated over the whole mesh: every rank holds all of it
    return f"shard {tuple(coordinate[d] for d in dims)} of mesh dims {dims}"


def checksum(tensor: Tensor) -> float:
    """The float64 sum plus an index-weighted sum of ``tensor``'s values (of its local shard for a DTensor).

    The weighted term makes permutations of the same values visible; both are exact for identical
    tensors, so replicas must agree bit for bit.
    """
    dtensor = _dtensor_type()
    local: Tensor = tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor) else tensor  # type: ignore[attr-defined]
    flat = local.detach().reshape(-1).to(torch.float64)
    if flat.numel() == 0:
        return 0.0
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device).remainder_(7919)
    return float(flat.sum()) + float((flat * weights).sum()) * 1e-3


def parameter_checksums(module: torch.nn.Module, buffers: bool = True,
                        skip: set[str] | None = None) -> Iterator[tuple[str, float]]:
    """``(name, checksum)`` per parameter (and buffer); see :func:`checksum`. Sharded tensors
    (``DTensor``) give their local shard's checksum: pair them with :func:`replica_group_key`."""
    for name, tensor in named_tensors(module, buffers=buffers, skip=skip):
        yield name, checksum(tensor)


def named_tensors(module: torch.nn.Module, buffers: bool = True,
                  skip: set[str] | None = None) -> Iterator[tuple[str, Tensor]]:
    """The parameters (and buffers) of ``module`` by name, without ``skip``."""
    named: list[tuple[str, Tensor]] = list(module.named_parameters())
    if buffers:
        named += list(module.named_buffers())
    for name, tensor in named:
        if not (skip and name in skip):
            yield name, tensor
