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


#: Elements per step of :func:`checksum`: its temporaries are two float64 buffers of about this many
#: elements (8 MiB each), whatever the tensor's size. Every rank uses the same value, so the same chunks.
_CHUNK = 1 << 20
_PERIOD = 7919  # the index weights are (i + 1) % _PERIOD


def _pieces(tensor: Tensor, start: int, stop: int) -> Iterator[Tensor]:
    """Views of ``tensor`` whose row-major elements, one after the other, are its flat elements
    ``[start, stop)``: no copy, whatever its strides (a transposed or sliced tensor too)."""
    if start >= stop:
        return
    if tensor.dim() <= 1 or tensor.is_contiguous():
        yield tensor.reshape(-1)[start:stop]  # a view: 0-d, 1-d (any stride) and contiguous tensors
        return
    inner = tensor.numel() // tensor.shape[0]  # elements per index of dim 0 (> 0: the tensor is not empty)
    row = start // inner
    if start % inner or stop < (row + 1) * inner:  # the range starts (or ends) inside one row
        end = min(stop, (row + 1) * inner)
        yield from _pieces(tensor[row], start - row * inner, end - row * inner)
        start, row = end, row + 1
    full = stop // inner
    if full > row:
        yield tensor[row:full]  # whole rows, as one strided view
        row = full
    if stop > max(start, row * inner):  # the last, partial row
        yield from _pieces(tensor[row], 0, stop - row * inner)


def checksum(tensor: Tensor) -> float:
    """The float64 sum plus an index-weighted sum of ``tensor``'s values (of its local shard for a DTensor).

    ``sum(x) + 1e-3 * sum(x[i] * ((i + 1) % 7919))`` over the row-major flat index ``i``: the
    weighted term makes permutations of the same values visible. Both sums run over fixed chunks of
    the flat tensor (``_CHUNK`` elements, converted to float64 one chunk at a time, so the temporaries
    are O(chunk), not O(tensor)); the chunks depend only on the number of elements, not on the
    tensor's memory layout, so identical tensors give bit-identical checksums on every rank. The
    partial sums stay on the tensor's device: one host sync per call, at the end.
    """
    dtensor = _dtensor_type()
    local: Tensor = tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor) else tensor  # type: ignore[attr-defined]
    local = local.detach()
    numel = local.numel()
    if numel == 0:
        return 0.0
    chunk = min(numel, _CHUNK)
    with torch.no_grad():
        # weights[o % P : o % P + n] are the weights of the n elements at flat offset o: (o + j + 1) % P
        weights = torch.arange(1, chunk + 1 + (_PERIOD if numel > chunk else 0), dtype=torch.float64,
                               device=local.device).remainder_(_PERIOD)
        buffer = torch.empty(chunk, dtype=torch.float64, device=local.device)
        total = torch.zeros((), dtype=torch.float64, device=local.device)
        weighted = torch.zeros((), dtype=torch.float64, device=local.device)
        for start in range(0, numel, chunk):
            stop = min(numel, start + chunk)
            values = buffer[:stop - start]
            filled = 0
            for piece in _pieces(local, start, stop):
                values[filled:filled + piece.numel()].view(piece.shape).copy_(piece)  # the dtype conversion
                filled += piece.numel()
            total += values.sum()
            offset = start % _PERIOD
            weighted += values.mul_(weights[offset:offset + values.numel()]).sum()
        plain, index_weighted = torch.stack((total, weighted)).tolist()
    return float(plain) + float(index_weighted) * 1e-3


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
