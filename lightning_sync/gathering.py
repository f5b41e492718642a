"""Exactly-once gathering of per-sample rows keyed by dataset index (torch only, no Lightning).

A :class:`RowCollector` holds what one rank produced during an evaluation epoch: the dataset index
of every row and, per key, either tensor rows (batch dimension first) or Python objects (one per
row). :meth:`RowCollector.gather` is one collective step at the end of the epoch:

1. every rank sends a small description of what it holds (row count, keys, dtypes, trailing
   shapes, a deferred local error) with :func:`~lightning_sync.collectives.gather_objects`; ranks
   that disagree raise :class:`~lightning_sync.RankMismatchError` on every rank, before any large
   transfer could abort gloo or hang;
2. the index and every tensor key are packed into one byte row per sample and exchanged in ONE
   :func:`~lightning_sync.collectives.all_gather_uneven` (or
   :func:`~lightning_sync.collectives.gather_uneven` to a single rank); indices travel as raw int64
   bytes, never through a float;
3. Python objects travel in one :func:`~lightning_sync.collectives.gather_objects` call;
4. rows are deduplicated by index (the first occurrence in rank order wins: a padding duplicate is
   the same sample seen by the same weights) and ordered by ascending index.

:func:`dedup_by_index` and :func:`pack_rows` are the pure bookkeeping, usable without processes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sync import collectives
from lightning_sync.errors import RankMismatchError, format_ranks

__all__ = ["INDEX_KEY", "RowCollector", "dedup_by_index"]

#: The key under which gathered results hold the dataset indices.
INDEX_KEY = "index"
_INDEX_BYTES = 8  # int64


def dedup_by_index(index: Tensor) -> tuple[Tensor, Tensor]:
    """Keep the first occurrence of every index and order the survivors by ascending index.

    Args:
        index: 1-d integer tensor (any order, duplicates allowed).

    Returns:
        ``(unique, first)``: the distinct indices ascending (int64) and, for each, the position of
        its first occurrence in ``index``, so ``rows[first]`` are the matching rows.
    """
    if index.ndim != 1:
        raise ValueError(f"dedup_by_index: needs a 1-d index tensor; got shape {tuple(index.shape)}.")
    index = index.to(torch.int64)
    m = index.numel()
    if m == 0:
        return index.new_empty(0), index.new_empty(0)
    positions = torch.arange(m, dtype=torch.int64, device=index.device)
    lo, hi = int(index.min()), int(index.max())
    if lo >= 0 and hi < 2 * m + 1024:
        # Dense indices (the map-style case): a scatter-min over a table of size max+1 is O(m) and
        # needs no sort; `amin` makes "first occurrence" deterministic, unlike a plain index_put_.
        table = torch.full((hi + 1,), m, dtype=torch.int64, device=index.device)
        table.scatter_reduce_(0, index, positions, reduce="amin")
        present = table < m
        unique = torch.nonzero(present).flatten()
        return unique, table[present]
    unique, inverse = torch.unique(index, sorted=True, return_inverse=True)
    first = torch.full((unique.numel(),), m, dtype=torch.int64, device=index.device)
    first.scatter_reduce_(0, inverse, positions, reduce="amin")
    return unique, first


@dataclass(frozen=True)
class _TensorSpec:
    dtype: torch.dtype
    trailing: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.trailing) * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{tuple(self.trailing)} {str(self.dtype).removeprefix('torch.')}"


@dataclass
class _Schema:
    """What one rank holds; small, pickled and exchanged before the rows."""

    rows: int
    tensors: dict[str, _TensorSpec] | None  # None: this rank saw no batch, it adopts the others' layout
    objects: list[str] | None
    error: str | None = None

    def describe(self) -> str:
        if self.tensors is None or self.objects is None:
            return "no batches"
        parts = [f"{k}: {spec}" for k, spec in sorted(self.tensors.items())]
        parts += [f"{k}: list" for k in sorted(self.objects)]
        return "{" + ", ".join(parts) + "}"


def pack_rows(index: Tensor, tensors: Mapping[str, Tensor], rows: int | None = None,
              device: torch.device | None = None) -> Tensor:
    """Pack the int64 index and every tensor (keys in sorted order) into one uint8 row per sample.

    Args:
        index: ``(n,)`` int64.
        tensors: each ``(n, *trailing)``.
        rows: allocate this many rows (>= n); the extra rows are padding (zeros).
        device: where to build the buffer; ``index``'s device by default.

    Returns:
        ``(rows, 8 + sum(row bytes))`` uint8.
    """
    n = index.numel()
    rows = n if rows is None else rows
    device = index.device if device is None else device
    widths = [_INDEX_BYTES] + [math.prod(t.shape[1:]) * t.element_size() for _, t in sorted(tensors.items())]
    out = torch.zeros(rows, sum(widths), dtype=torch.uint8, device=device)
    offset = 0
    for width, t in zip(widths, [index.to(torch.int64)] + [t for _, t in sorted(tensors.items())]):
        if width:
            flat = t.detach().contiguous().reshape(n, width // t.element_size())
            out[:n, offset:offset + width].copy_(flat.view(torch.uint8))
        offset += width
    return out


def _unpack_column(packed: Tensor, select: Tensor, offset: int, spec: _TensorSpec) -> Tensor:
    """Rows ``select`` of one key's byte column, as a contiguous tensor of its dtype and shape."""
    if spec.row_bytes == 0:
        return torch.empty((select.numel(), *spec.trailing), dtype=spec.dtype, device=packed.device)
    # index_select on the strided column view writes one contiguous block: one copy per key
    column = torch.index_select(packed[:, offset:offset + spec.row_bytes], 0, select)
    return column.view(spec.dtype).reshape(select.numel(), *spec.trailing)


@dataclass
class RowCollector:
    """One rank's rows for one dataloader during one epoch; :meth:`gather` makes them exact.

    Args:
        offload_to_cpu: move every added tensor to CPU as it arrives (validation outputs then
            hold no accelerator memory; the gather runs over CPU tensors).
    """

    offload_to_cpu: bool = False
    _index: list[Tensor] = field(default_factory=list)
    _tensors: dict[str, list[Tensor]] | None = None
    _specs: dict[str, _TensorSpec] | None = None
    _objects: dict[str, list[Any]] | None = None
    _rows: int = 0
    _error: str | None = None
    _device: torch.device | None = None

    def __len__(self) -> int:
        return self._rows

    @property
    def failed(self) -> bool:
        return self._error is not None

    def fail(self, message: str) -> None:
        """Record a local problem; :meth:`gather` raises it on every rank (the first one wins)."""
        if self._error is None:
            self._error = message

    def add(self, index: Tensor | Sequence[int], tensors: Mapping[str, Tensor] | None = None,
            objects: Mapping[str, Sequence[Any]] | None = None) -> None:
        """Append one batch: ``n`` indices, tensors with ``n`` rows, object lists of length ``n``.

        Raises:
            ValueError: row counts disagree with the number of indices, or the keys, dtypes or
                trailing shapes differ from earlier batches. Nothing is stored then.
        """
        idx = torch.as_tensor(index, dtype=torch.int64).detach().reshape(-1).cpu()
        n = idx.numel()
        tensors = dict(tensors or {})
        objects = {k: list(v) for k, v in (objects or {}).items()}
        specs = {}
        for key, t in tensors.items():
            if t.ndim == 0 or t.shape[0] != n:
                raise ValueError(f"key {key!r} has shape {tuple(t.shape)} but the batch has {n} samples; return one "
                                 "row per sample (batch dimension first), e.g. loss with reduction='none'.")
            specs[key] = _TensorSpec(t.dtype, tuple(t.shape[1:]))
        for key, values in objects.items():
            if len(values) != n:
                raise ValueError(f"key {key!r} is a list of {len(values)} items but the batch has {n} samples; "
                                 "return one item per sample.")
        if self._specs is None or self._objects is None or self._tensors is None:
            self._specs, self._tensors, self._objects = specs, {k: [] for k in specs}, {k: [] for k in objects}
        elif specs != self._specs or set(objects) != set(self._objects):
            before = _Schema(0, self._specs, list(self._objects)).describe()
            now = _Schema(0, specs, list(objects)).describe()
            raise ValueError(f"batch {len(self._index)} returned {now} but earlier batches returned {before}. Return "
                             "the same keys with the same trailing shapes every batch; pad ragged rows to a fixed "
                             "length and return their lengths too, or return them as a list (one object per sample).")
        for key, t in tensors.items():
            t = t.detach()
            if self.offload_to_cpu:
                t = t.to("cpu")
            if self._device is None:
                self._device = t.device
            self._tensors[key].append(t)
        for key, values in objects.items():
            self._objects[key].extend(values)
        self._index.append(idx)
        self._rows += n

    def _schema(self) -> _Schema:
        return _Schema(self._rows, self._specs, None if self._objects is None else sorted(self._objects), self._error)

    def gather(self, dst: int | None = None, group: dist.ProcessGroup | None = None,
               what: str = "ValidationGather") -> dict[str, Any] | None:
        """Exchange every rank's rows; drop duplicates by index; order by index. Empties this collector.

        Every rank of ``group`` must call it with the same ``dst``; it blocks. Costs three
        collectives: one small description exchange, one packed-row gather, one object gather (only
        if there are object keys).

        Peak memory on a receiving rank: about twice the gathered bytes (the received buffer plus
        the ordered result), plus this rank's rows once more while packing; other ranks under
        ``dst``: twice their own rows.

        Args:
            dst: ``None``: every rank receives the result; a global rank: only that one does.
            group: the process group; the world by default.
            what: how errors name the caller.

        Returns:
            ``{"index": int64 (U,), key: (U, ...) tensor or list of U objects, ...}`` with ``U``
            distinct indices in ascending order; ``None`` on ranks other than ``dst``.

        Raises:
            RankMismatchError: ranks returned different keys, dtypes or trailing shapes.
            ValueError: some rank recorded a problem with :meth:`fail` or a bad batch.
        """
        mine = self._schema()
        schemas: list[_Schema] = collectives.gather_objects(mine, group=group)  # type: ignore[assignment]
        ranks = collectives._global_ranks(group) if collectives.is_distributed(group) else [0]
        errors = {r: s.error for r, s in zip(ranks, schemas) if s.error is not None}
        if errors:
            raise ValueError(f"{what}: bad outputs on {len(errors)} of {len(ranks)} ranks: "
                             + "; ".join(f"rank {r}: {e}" for r, e in errors.items()))
        known = [s for s in schemas if s.tensors is not None]
        layouts = {(tuple(sorted((k, str(v)) for k, v in (s.tensors or {}).items())), tuple(s.objects or ()))
                   for s in known}
        if len(layouts) > 1:
            shown = {r: s.describe() for r, s in zip(ranks, schemas)}
            raise RankMismatchError(
                f"{what}: ranks returned different outputs: {format_ranks(shown)}. Return the same keys, dtypes and "
                "trailing shapes on every rank (only the number of samples may differ); pad ragged rows to one "
                "length, or return them as lists.", shown)
        specs: dict[str, _TensorSpec] = dict(known[0].tensors or {}) if known else {}
        object_keys: list[str] = list(known[0].objects or []) if known else []
        counts = [s.rows for s in schemas]
        most = max(counts)

        # one packed byte row per sample: index, then each tensor key in sorted order
        index = torch.cat(self._index) if self._index else torch.empty(0, dtype=torch.int64)
        tensors: dict[str, Tensor] = {}
        for key, spec in specs.items():
            chunks = (self._tensors or {}).get(key, [])
            tensors[key] = (torch.cat(chunks) if len(chunks) > 1 else chunks[0]) if chunks else torch.empty(
                (0, *spec.trailing), dtype=spec.dtype)
        device = self._device or torch.device("cpu")
        local_objects = {k: (self._objects or {}).get(k, []) for k in object_keys}
        self._reset()
        # Every rank pads to the longest rank's row count, so the exchange below is one even
        # all-gather: no padding copy or concatenation inside it; pads are never selected.
        packed = pack_rows(index.to(device), {k: t.to(device) for k, t in tensors.items()}, rows=most, device=device)
        del tensors, index
        if dst is None:
            received: Tensor | None = collectives.all_gather_uneven(packed, group=group)[0]
        else:
            received = collectives.gather_uneven(packed, dst=dst, group=group)[0]
        del packed
        gathered_objects = (collectives.gather_objects(local_objects, dst=dst, group=group) if object_keys
                            else [{}] * len(ranks))
        if received is None or gathered_objects is None:
            return None

        # positions of the real rows (not the padding) inside the received buffer, in rank order
        real = torch.cat([torch.arange(c, dtype=torch.int64) + r * most for r, c in enumerate(counts)]).to(device)
        all_index = torch.index_select(received[:, :_INDEX_BYTES], 0, real).view(torch.int64).reshape(-1)
        unique, first = dedup_by_index(all_index)
        select = real[first]
        result: dict[str, Any] = {INDEX_KEY: unique}
        offset = _INDEX_BYTES
        for key, spec in sorted(specs.items()):
            result[key] = _unpack_column(received, select, offset, spec)
            offset += spec.row_bytes
        if object_keys:
            picks = first.tolist()
            for key in object_keys:
                flat = [item for rank_objects in gathered_objects for item in rank_objects[key]]
                result[key] = [flat[i] for i in picks]
        return result

    def _reset(self) -> None:
        self._index, self._tensors, self._specs, self._objects = [], None, None, None
        self._rows, self._error, self._device = 0, None, None
