"""Exactly-once gathering of per-sample rows keyed by dataset index (torch only, no Lightning).

A :class:`RowCollector` holds what one rank produced during an evaluation epoch: the dataset index
of every row and, per key, either tensor rows (batch dimension first) or Python objects (one per
row). :meth:`RowCollector.gather` is one collective step at the end of the epoch:

1. every rank sends a small description of what it holds (row count, keys, dtypes, trailing
   shapes, a deferred local error) with :func:`~lightning_sync.collectives.gather_objects`; ranks
   that disagree raise :class:`~lightning_sync.RankMismatchError` on every rank, before any large
   transfer could abort gloo or hang;
2. the int64 index, then each tensor key, is exchanged with one
   :func:`~lightning_sync.collectives.all_gather_uneven` (or
   :func:`~lightning_sync.collectives.gather_uneven` to a single rank) as raw bytes of its own
   dtype: indices never pass through a float; every rank pads to the longest rank while
   concatenating its batches, so each exchange is one even all-gather;
3. Python objects travel in one :func:`~lightning_sync.collectives.gather_objects` call;
4. rows are deduplicated by index (the first occurrence in rank order wins: a padding duplicate is
   the same sample seen by the same weights) and ordered by ascending index. When the gathered
   indices already ascend (``ddp_sync``'s exact shards of an unshuffled loader) there is nothing to
   drop or re-order: the result is a view of the received rows, without a copy.

:func:`dedup_by_index` is the pure bookkeeping, usable without processes.
"""

from __future__ import annotations

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
        if bool(present.all()):  # the usual case (every index 0..max seen): skip two large copies
            return positions[: hi + 1], table  # positions is arange(m), m > hi: reuse it, no new memory
        unique = torch.nonzero(present).flatten()
        return unique, table[present]
    unique, inverse = torch.unique(index, sorted=True, return_inverse=True)
    first = torch.full((unique.numel(),), m, dtype=torch.int64, device=index.device)
    first.scatter_reduce_(0, inverse, positions, reduce="amin")
    return unique, first


def _strictly_ascending(index: Tensor) -> bool:
    # one pass, no sort: true for exact contiguous shards of an unshuffled loader
    return index.numel() < 2 or bool((index[1:] > index[:-1]).all())


@dataclass(frozen=True)
class _TensorSpec:
    dtype: torch.dtype
    trailing: tuple[int, ...]

    def __str__(self) -> str:
        return f"{tuple(self.trailing)} {str(self.dtype).removeprefix('torch.')}"


@dataclass
class _Schema:
    """What one rank holds; small, pickled and exchanged before the rows."""

    rows: int
    tensors: dict[str, _TensorSpec] | None  # None: this rank saw no batch, it adopts the others' layout
    objects: list[str] | None
    error: str | None = None
    device_type: str = "cpu"  # where this rank's tensors live; a rank without batches adopts it

    def describe(self) -> str:
        if self.tensors is None or self.objects is None:
            return "no batches"
        parts = [f"{k}: {spec}" for k, spec in sorted(self.tensors.items())]
        parts += [f"{k}: list" for k in sorted(self.objects)]
        return "{" + ", ".join(parts) + "}"


def _padded_cat(chunks: Sequence[Tensor], n: int, most: int, dtype: torch.dtype, trailing: tuple[int, ...],
                device: torch.device) -> Tensor:
    """Concatenate ``n`` rows of batches into a buffer of ``most`` rows (zeros after row ``n``)."""
    buf = torch.empty((most, *trailing), dtype=dtype, device=device)
    if n:
        torch.cat([c.to(device=device, dtype=dtype) for c in chunks], out=buf[:n])
    if most > n:
        buf[n:].zero_()
    return buf


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
        return _Schema(self._rows, self._specs, None if self._objects is None else sorted(self._objects), self._error,
                       self._device.type if self._device is not None else "cpu")

    def gather(self, dst: int | None = None, group: dist.ProcessGroup | None = None,
               what: str = "ValidationGather") -> dict[str, Any] | None:
        """Exchange every rank's rows; drop duplicates by index; order by index. Empties this collector.

        Every rank of ``group`` must call it with the same ``dst``; it blocks. Collectives: one
        small description exchange, one gather for the index and one per tensor key, one object
        gather (only if there are object keys).

        Peak memory on a receiving rank, beyond its own collected rows: the result (gathered bytes,
        8 per index included) plus the largest key's received buffer, plus that key's local rows
        once more while they are padded; keys are processed one at a time. Ranks that do not
        receive (``dst`` set): about their own largest key once more.

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
        n = self._rows
        index_chunks = self._index
        tensor_chunks = dict(self._tensors or {})
        local_objects = {k: (self._objects or {}).get(k, []) for k in object_keys}
        fallback = self._device or (torch.device("cuda", torch.cuda.current_device()) if known and
                                    known[0].device_type == "cuda" else torch.device("cpu"))
        self._reset()

        def exchange(send: Tensor) -> Tensor | None:
            if dst is None:
                return collectives.all_gather_uneven(send, group=group)[0]
            return collectives.gather_uneven(send, dst=dst, group=group)[0]

        # Every rank pads each tensor to the longest rank's row count while concatenating its
        # batches (one copy it needs anyway), so each exchange is an even all-gather: no padding
        # copy or concatenation inside it; the padding rows are never selected below.
        received = exchange(_padded_cat(index_chunks, n, most, torch.int64, (), torch.device("cpu")))
        del index_chunks
        select: Tensor | None = None
        first: Tensor | None = None
        prefix: int | None = None  # rows[:prefix] is the result as it stands: no re-ordering copy
        result: dict[str, Any] = {}
        if received is not None:
            if min(counts) == most:
                all_index = received
            else:
                all_index = torch.cat([received[r * most: r * most + c] for r, c in enumerate(counts)])
            del received
            total = all_index.numel()
            if _strictly_ascending(all_index) and all(c == most for c in counts[:-1]):
                # exact shards in order (ddp_sync, not shuffled): no duplicate, nothing to re-order, and
                # the only padding (the last rank's) lies after the rows
                unique, prefix = all_index, total
            else:
                unique, first = dedup_by_index(all_index)
                del all_index
                if min(counts) == most:
                    select = first
                else:  # concatenated position -> padded position
                    starts = torch.tensor([0] + counts[:-1], dtype=torch.int64).cumsum(0)
                    rank = torch.searchsorted(starts, first, right=True) - 1
                    select = first + rank * most - starts[rank]
            result[INDEX_KEY] = unique
        # one key at a time: its batches are freed once packed, its received rows once selected
        for key in sorted(specs):
            spec = specs[key]
            chunks = tensor_chunks.pop(key, [])
            device = chunks[0].device if chunks else fallback
            rows = exchange(_padded_cat(chunks, n, most, spec.dtype, spec.trailing, device))
            del chunks
            if rows is not None and prefix is not None:
                result[key] = rows[:prefix]  # a view of the received buffer
            elif rows is not None and select is not None:
                result[key] = torch.index_select(rows, 0, select.to(rows.device))
            del rows
        gathered_objects = (collectives.gather_objects(local_objects, dst=dst, group=group) if object_keys
                            else [{}] * len(counts))
        if INDEX_KEY not in result or gathered_objects is None:
            return None
        if object_keys:
            for key in object_keys:
                flat = [item for rank_objects in gathered_objects for item in rank_objects[key]]
                result[key] = flat if first is None else [flat[i] for i in first.tolist()]
        return result

    def _reset(self) -> None:
        self._index, self._tensors, self._specs, self._objects = [], None, None, None
        self._rows, self._error, self._device = 0, None, None
