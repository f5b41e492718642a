"""``PredictionWriter``: ``trainer.predict`` streamed to one Parquet file, in dataset order, each sample once.

Under DDP every rank predicts its own share, and Lightning's padded sampler repeats some samples.
``PredictionWriter`` records the dataset index of every row from the batch sampler
(:mod:`lightning_sync.recording`, shared with :class:`~lightning_sync.ValidationGather`), and each
rank streams its rows to part files of bounded size, sorted by index and written atomically. When the predict epoch ends, the ranks
exchange a short summary (row counts, columns, errors); rank 0 k-way merges every part into one
Parquet file ordered by ``"index"``, keeps each index once, writes it atomically and records a
manifest beside it; the other ranks wait for its verdict. No rank ever holds more than a bounded
buffer of rows, and the part files let ``resume=True`` skip the batches an interrupted run finished.
"""

from __future__ import annotations

import datetime
import json
import shutil
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.utils.data import IterableDataset

from lightning_sync import collectives, rowstore
from lightning_sync._compat.lightning_api import seen_batch_indices
from lightning_sync._compat.torch_api import default_store
from lightning_sync.errors import LightningSyncError, RankMismatchError, format_ranks
from lightning_sync.recording import (
    OUTPUT_KEY,
    BatchLog,
    Recorder,
    Stage,
    active_loaders,
    attach_recorder,
)

__all__ = ["PredictionWriter"]

WriteInterval = Literal["batch", "epoch"]
_COMPRESSIONS = ("snappy", "zstd", "gzip", "brotli", "lz4", "none")


class _PositionLog(BatchLog):
    """A batch log that also knows each batch's position in its sampler and can skip batches."""

    def __init__(self, writer: PredictionWriter) -> None:
        super().__init__()
        self._writer = writer
        self._next = 0
        self._positions: deque[int] = deque()
        self.position = 0  # the position of the batch most recently popped

    def start(self) -> None:
        super().start()
        self._next = 0
        self._positions.clear()

    def accept(self, batch: Any) -> bool:
        self._next += 1
        return self._writer._accept(batch)

    def push(self, batch: Any) -> None:
        super().push(batch)
        self._positions.append(self._next - 1)

    def pop(self) -> list[Any] | None:
        batch = super().pop()
        if batch is not None:
            self.position = self._positions.popleft()
        return batch


class PredictionWriter(pl.Callback):
    """Write ``trainer.predict`` outputs to one Parquet file: column ``"index"`` ascending, each index once.

    Works under ``strategy="ddp_sync"``, Lightning's ``"ddp"`` and in a single process. ``predict_step``
    returns per-sample rows: a dict whose values are tensors with the batch dimension first (vectors
    and higher-dimensional rows become fixed-size list columns), lists with one Python value per
    sample (strings, numbers, lists), or lists of tensors of different lengths (ragged sequences,
    stored as list columns); a single tensor is stored under ``"output"``. The file holds an int64
    column ``"index"`` (the dataset index of each row, from the sampler; a returned ``"index"``
    wins, which is how an ``IterableDataset`` supplies them) and one column per key in the order the
    step returned them (or the order of ``keys``). Padding duplicates of a ``DistributedSampler``
    are dropped by index (the copy from the lowest rank is kept). ``pyarrow.parquet.read_table``,
    pandas, polars and Hugging Face ``datasets`` read the file as it is.

    Beside ``path`` (``preds.parquet``): ``preds.manifest.json`` (rows, first and last index,
    per-rank counts, world size, the root seed under ``ddp_sync``, columns, the file's SHA-256) and,
    while running, ``preds.parts/`` (each rank's part files; removed after the merge unless
    ``keep_parts=True``). Both files appear atomically: a reader sees the old file or the new one.

    Memory per rank: one buffer of at most ``row_group_size`` rows (or 64 MiB) plus a batch; with
    ``write_interval="epoch"`` the rank's whole share. Rank 0's merge holds one chunk (up to 8192
    rows, 2 MiB) per open part file, at most 64 files at a time (more are merged in passes), plus
    one output row group. Files must be on a filesystem every rank can read (rank 0 merges every
    rank's parts): checked at set-up. Use ``trainer.predict(..., return_predictions=False)``, or
    Lightning also keeps every output in memory.

    Errors are raised on every rank with the rank and the key: a value whose batch dimension is not
    the batch's number of indices, keys or dtypes that change between batches or differ across
    ranks (at the end of the epoch; a rank stops predicting at its first bad batch), an existing
    target without ``overwrite=True`` / ``resume=True`` (at set-up). Nothing at ``path`` is
    replaced unless the whole dataset was written.

    Args:
        path: the Parquet file to write.
        keys: the output keys to write, in this order (``None``: every per-sample key, in the order
            ``predict_step`` returns them; 0-d values are skipped with a warning).
        write_interval: ``"batch"``: stream to part files while predicting (memory O(batch));
            ``"epoch"``: each rank keeps its rows and writes one part at the end (fewer files;
            memory O(rank's rows)).
        row_group_size: rows per Parquet row group of the output, and per part-file buffer.
        compression: ``"snappy"``, ``"zstd"``, ``"gzip"``, ``"brotli"``, ``"lz4"`` or ``"none"``.
        overwrite: replace an existing file (and any parts) at ``path``.
        resume: continue an interrupted run: batches whose dataset indices are all in complete part
            files of an earlier run are not loaded or predicted again (the same sampler order is
            not required: the test is by index); the result is the same file. Needs the same
            outputs (keys, dtypes, shapes) as the earlier run. Holds one bit per dataset index.
        format: ``"parquet"`` (the only format).
        keep_parts: keep ``preds.parts/`` after a successful merge.
        merge_timeout: seconds the other ranks wait for rank 0's merge before they raise (rank 0 alive
            but stuck); a rank 0 that dies is noticed at once.

    Attributes:
        manifest: after ``trainer.predict``, the manifest (also on ranks other than 0).
    """

    def __init__(self, path: str | Path, *, keys: Sequence[str] | None = None, write_interval: WriteInterval = "batch",
                 row_group_size: int = 65536, compression: str | None = "snappy", overwrite: bool = False,
                 resume: bool = False, format: str = "parquet", keep_parts: bool = False,
                 merge_timeout: float = 1800.0) -> None:
        if format != "parquet":
            raise ValueError(f"PredictionWriter(format={format!r}): only 'parquet' is supported.")
        if isinstance(keys, str):
            raise TypeError(f"PredictionWriter(keys={keys!r}): pass a list of keys, e.g. keys=[{keys!r}].")
        if keys is not None and rowstore.INDEX in keys:
            raise ValueError(f"PredictionWriter(keys={list(keys)!r}): 'index' is always the first column; leave it "
                             "out of keys.")
        if write_interval not in ("batch", "epoch"):
            raise ValueError(f"PredictionWriter(write_interval={write_interval!r}): use 'batch' or 'epoch'.")
        if isinstance(row_group_size, bool) or not isinstance(row_group_size, int) or row_group_size < 1:
            raise ValueError(f"PredictionWriter(row_group_size={row_group_size!r}): needs a positive int.")
        if compression is not None and compression.lower() not in _COMPRESSIONS:
            raise ValueError(f"PredictionWriter(compression={compression!r}): use one of {', '.join(_COMPRESSIONS)}.")
        if isinstance(merge_timeout, bool) or not isinstance(merge_timeout, (int, float)) or not merge_timeout > 0:
            raise ValueError(f"PredictionWriter(merge_timeout={merge_timeout!r}): needs positive seconds.")
        rowstore.require_pyarrow("PredictionWriter")
        self.merge_timeout = float(merge_timeout)
        self.path = Path(path)
        self.keys = list(keys) if keys is not None else None
        self.write_interval = write_interval
        self.row_group_size = row_group_size
        self.compression = None if compression is None or compression.lower() == "none" else compression.lower()
        self.overwrite = overwrite
        self.resume = resume
        self.keep_parts = keep_parts
        self.stages: tuple[Stage, ...] = ("predict",)
        self.manifest: dict[str, Any] | None = None
        self._recorder = Recorder(new_log=lambda: _PositionLog(self))
        self._detach: Callable[[], None] | None = None
        self._reset()

    @property
    def manifest_path(self) -> Path:
        """``preds.manifest.json`` beside ``preds.parquet``."""
        return self.path.with_name(f"{self.path.stem}.manifest.json")

    @property
    def parts_dir(self) -> Path:
        """``preds.parts/`` beside ``preds.parquet``: every rank's part files."""
        return self.path.with_name(f"{self.path.stem}.parts")

    def _reset(self) -> None:
        self._parts: rowstore.PartWriter | None = None
        self._done: rowstore.DoneSet | None = None
        self._error: str | None = None
        self._attempt = ""
        self._rank = 0
        self._skipped = 0
        self._batches = 0
        self._trim_lightning_indices = False
        self._warned: set[str] = set()

    # ---------------------------------------------------------------- set-up: target checks, resume state

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "predict":
            return
        if self._detach is None:
            self._detach = attach_recorder(trainer, self)
        self._reset()
        self._rank = trainer.global_rank
        decision: dict[str, Any] | None = None
        if self._rank == 0:
            try:
                decision = self._prepare_target()
            except OSError as err:
                decision = {"error": f"PredictionWriter: cannot prepare {self.parts_dir}: {err}", "kind": "OSError"}
        decision = collectives.broadcast_object(decision, src=0, safe=True)
        assert decision is not None
        if decision.get("error"):
            raise (FileExistsError if decision["kind"] == "FileExistsError" else OSError)(decision["error"])
        self._attempt = decision["attempt"]
        token = self.parts_dir / f".token-{self._attempt}"
        visible = collectives.gather_objects(token.exists(), safe=True)
        assert visible is not None
        blind = [r for r, seen in enumerate(visible) if not seen]
        if blind:
            raise OSError(f"PredictionWriter: rank(s) {blind} cannot see {self.parts_dir.resolve()}, which rank 0 "
                          "created: every rank must write to a filesystem that rank 0 can read (it merges every "
                          "rank's parts). Use a shared path (NFS, Lustre, a cloud bucket mount), not a node-local "
                          "directory.")
        self._parts = rowstore.PartWriter(self.parts_dir / f"rank-{self._rank:05d}", self._attempt,
                                          self.row_group_size if self.write_interval == "batch" else None)
        if self.resume:  # before the first batch is drawn (Lightning prefetches before on_predict_start)
            self._done = rowstore.DoneSet(rowstore.list_parts(self.parts_dir))

    def _prepare_target(self) -> dict[str, Any]:
        """Rank 0: refuse, clear or keep what is at the target; make the parts directory."""
        found = [p for p in (self.path, self.manifest_path) if p.exists()]
        parts = rowstore.list_parts(self.parts_dir) if self.parts_dir.is_dir() else []
        if self.path.is_dir():
            return {"error": f"PredictionWriter: {self.path} is a directory; pass the path of the Parquet file to "
                    "write (e.g. preds.parquet).", "kind": "FileExistsError"}
        if (found or parts) and not (self.overwrite or self.resume):
            what = [str(p) for p in found] + ([f"{len(parts)} part file(s) in {self.parts_dir}"] if parts else [])
            return {"error": f"PredictionWriter: the target is not empty: {', '.join(what)}. Pass overwrite=True to "
                    "replace it, resume=True to continue an interrupted run from its complete parts, or another "
                    "path.", "kind": "FileExistsError"}
        if self.path.exists() and not self.manifest_path.exists() and not self.overwrite:
            return {"error": f"PredictionWriter: {self.path} exists but has no {self.manifest_path.name}: it was not "
                    "written by PredictionWriter. Pass overwrite=True to replace it, or another path.",
                    "kind": "FileExistsError"}
        if self.parts_dir.is_dir() and not self.resume:
            shutil.rmtree(self.parts_dir)
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.parts_dir.glob("rank-*/.tmp-*"):  # parts an interrupted run did not finish
            stale.unlink()
        for stale in list(self.parts_dir.glob(".token-*")) + list(self.parts_dir.glob(".merge-*")):
            stale.unlink()
        attempt = f"{time.time_ns():x}{uuid.uuid4().hex[:6]}"
        (self.parts_dir / f".token-{attempt}").touch()
        return {"error": None, "attempt": attempt}

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        keeping = bool(getattr(trainer.predict_loop, "return_predictions", False))
        if keeping:
            rank_zero_warn("PredictionWriter: trainer.predict keeps every output in memory as well; pass "
                           "return_predictions=False to keep memory bounded.")
        self._trim_lightning_indices = not keeping and not any(
            isinstance(cb, BasePredictionWriter) for cb in getattr(trainer, "callbacks", []))

    # ---------------------------------------------------------------- per batch

    def _accept(self, batch: Any) -> bool:
        """Whether to load and predict a batch the sampler yielded (its dataset indices)."""
        if self._error is not None:
            return False  # this rank failed: finish quickly, the error is raised at the epoch end
        if self._done is not None:
            index = list(batch) if isinstance(batch, (list, tuple, Tensor)) else [batch]
            if all(isinstance(i, (int, np.integer)) or (isinstance(i, Tensor) and i.ndim == 0) for i in index):
                if self._done.contains_all([int(i) for i in index]):
                    self._skipped += 1
                    return False
        return True

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        loaders = active_loaders(trainer, "predict")
        log = self._recorder.lookup(loaders[dataloader_idx] if dataloader_idx < len(loaders) else None)
        recorded = log.pop() if isinstance(log, BatchLog) else None
        position = log.position if isinstance(log, _PositionLog) and recorded is not None else self._batches
        self._batches += 1
        if self._trim_lightning_indices and dataloader_idx < len(loaders):
            # Lightning's index wrapper keeps every batch's indices (Python ints, ~36 bytes a row) for
            # BasePredictionWriter / return_predictions; with neither, nothing reads them: drop them
            seen = seen_batch_indices(getattr(loaders[dataloader_idx], "batch_sampler", None))
            if seen is not None:
                seen.clear()
        if self._error is not None:
            return
        assert self._parts is not None
        try:
            if dataloader_idx != 0:
                raise ValueError(f"this trainer.predict call has several dataloaders (got dataloader_idx="
                                 f"{dataloader_idx}); PredictionWriter writes one file: predict each dataloader in "
                                 "its own call, with its own PredictionWriter(path).")
            index, columns = self._rows(outputs, recorded, log)
            self._parts.add(index, columns, position)
        except (TypeError, ValueError, OSError) as err:
            # Not raised here: the other ranks would wait in the epoch-end exchange until the
            # process-group timeout. This rank stops predicting (see _accept); every rank raises it.
            self._error = f"rank {self._rank}, batch {batch_idx}: {err}"

    def _rows(self, outputs: Any, recorded: list[Any] | None, log: BatchLog | str) -> tuple[np.ndarray, dict[str, Any]]:
        if outputs is None:
            outputs = {}
        elif isinstance(outputs, Tensor):
            outputs = {OUTPUT_KEY: outputs}
        elif not isinstance(outputs, Mapping):
            raise TypeError(f"predict_step returned {type(outputs).__name__}; PredictionWriter needs a dict of "
                            "per-sample tensors/lists, a single tensor, or None.")
        if rowstore.INDEX in outputs:
            index = outputs[rowstore.INDEX]
        elif recorded is None:
            why = log if isinstance(log, str) else "its batch sampler yielded no more batches than this"
            raise ValueError(f"no dataset indices for this batch: {why}. Return the dataset indices of the batch's "
                             f"samples under {rowstore.INDEX!r} from predict_step.")
        elif any(not isinstance(i, (int, np.integer, Tensor)) for i in recorded):
            raise ValueError("the sampler yielded something other than dataset indices; return the dataset indices "
                             f"of the batch's samples under {rowstore.INDEX!r} from predict_step.")
        else:
            index = recorded
        idx = torch.as_tensor(index).detach().reshape(-1).cpu()
        if idx.is_floating_point() or idx.is_complex():
            raise TypeError(f"the dataset indices must be integers; got {idx.dtype}.")
        index_np = idx.to(torch.int64).numpy()
        chosen = self.keys if self.keys is not None else [k for k in outputs if k != rowstore.INDEX]
        missing = [k for k in chosen if k not in outputs]
        if missing:
            raise ValueError(f"keys {missing} are not in predict_step's outputs (it returned {list(outputs)}); "
                             "return them, or leave them out of PredictionWriter(keys=...).")
        columns: dict[str, Any] = {}
        for key in chosen:
            value = outputs[key]
            if self.keys is None and (isinstance(value, (int, float, bool)) or
                                      (isinstance(value, Tensor) and value.ndim == 0)):
                if key not in self._warned:
                    self._warned.add(key)
                    rank_zero_warn(f"PredictionWriter: skipping {key!r}, a scalar rather than one row per sample. "
                                   "Pass keys=[...] to choose the columns.")
                continue
            columns[str(key)] = rowstore.to_arrow(str(key), value, len(index_np))
        return index_np, columns

    # ---------------------------------------------------------------- epoch end: check, merge, manifest

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._parts is not None
        if self._error is None:
            try:
                self._parts.flush()
            except OSError as err:
                self._error = f"rank {self._rank}: writing a part file failed: {err}"
        schema = self._parts.schema
        mine = {"error": self._error, "rows": self._parts.rows_written, "parts": self._parts.parts_written,
                "skipped": self._skipped, "batches": self._batches,
                "columns": None if schema is None else rowstore.describe_schema(schema)}
        summaries = collectives.gather_objects(mine, safe=True)
        assert summaries is not None
        errors = {r: s["error"] for r, s in enumerate(summaries) if s["error"]}
        if errors:
            raise ValueError(f"PredictionWriter: bad outputs on {len(errors)} of {len(summaries)} rank(s): "
                             + "; ".join(e.rstrip(".") for e in errors.values())
                             + f". Nothing was written to {self.path}.")
        layouts = {r: ", ".join(f"{c['name']}: {c['type']}" for c in s["columns"])
                   for r, s in enumerate(summaries) if s["columns"] is not None}
        if len(set(layouts.values())) > 1:
            raise RankMismatchError(
                f"PredictionWriter: ranks returned different outputs: {format_ranks(layouts)}. Return the same keys "
                "(in the same order) with the same dtypes and trailing shapes on every rank; only the number of "
                f"samples may differ. Nothing was written to {self.path}.", layouts)
        verdict: dict[str, Any] | None = None
        if self._rank == 0:
            try:
                verdict = {"manifest": self._merge(trainer, summaries, _dataset_length(trainer))}
            except Exception as err:  # noqa: BLE001 - raised on every rank below
                verdict = {"error": f"{type(err).__name__}: {err}", "kind": type(err).__name__}
        verdict = _from_rank0(verdict, f"lightning_sync/predict/{self._attempt}", len(summaries), self.merge_timeout,
                              f"merge the part files into {self.path}")
        if verdict.get("error"):
            kind = ValueError if verdict["kind"] == "ValueError" else RuntimeError
            raise kind(f"PredictionWriter: rank 0 could not write {self.path}: {verdict['error']}. The complete part "
                       f"files are kept in {self.parts_dir}: fix the cause and rerun with resume=True.")
        self.manifest = verdict["manifest"]

    def _merge(self, trainer: pl.Trainer, summaries: list[dict[str, Any]], length: int | None) -> dict[str, Any]:
        from lightning_sync import __version__

        start = time.monotonic()
        result = rowstore.merge_parts(self.parts_dir, self.path, row_group_size=self.row_group_size,
                                      compression=self.compression)
        ranks = sorted(set(range(len(summaries))) | set(result.rows_per_rank))
        manifest = {
            "format": "parquet",
            "file": self.path.name,
            "rows": result.rows,
            "index": {"first": result.first, "last": result.last,
                      "contiguous": result.rows == 0 or (result.first == 0 and result.last == result.rows - 1)},
            "world_size": len(summaries),
            "root_seed": getattr(trainer.strategy, "seed", None),
            "strategy": type(trainer.strategy).__name__,
            "ranks": [{"rank": r,
                       "rows_predicted": summaries[r]["rows"] if r < len(summaries) else 0,
                       "batches_skipped": summaries[r]["skipped"] if r < len(summaries) else 0,
                       "rows_in_parts": result.rows_per_rank.get(r, 0),
                       "parts": result.parts_per_rank.get(r, 0),
                       "rows_kept": result.kept_per_rank.get(r, 0)} for r in ranks],
            "duplicates_dropped": result.rows_in - result.rows,
            "dataset_length": length,
            "resumed": self.resume,
            "columns": rowstore.describe_schema(result.schema),
            "row_group_size": self.row_group_size,
            "compression": self.compression or "none",
            "merge_passes": result.passes,
            "merge_seconds": round(time.monotonic() - start, 3),
            "sha256": result.sha256,
            "lightning_sync": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        if length is not None and result.rows_in >= length > result.rows:
            # more rows than samples, yet samples missing: the ranks' samplers overlapped
            rank_zero_warn(
                f"PredictionWriter: {result.rows_in} rows were predicted for a data set of {length} samples, but "
                f"only {result.rows} distinct indices: {length - result.rows} samples were never predicted while "
                "others were predicted on several ranks. The ranks' samplers disagree: a shuffled sampler drawing "
                "its order from each rank's own random state (e.g. a RandomSampler, which Lightning wraps for "
                "predict). Give it a generator seeded alike on every rank, or use a DistributedSampler(shuffle=True,"
                " seed=...).")
        rowstore.write_json_atomic(self.manifest_path, manifest)
        if not self.keep_parts:
            shutil.rmtree(self.parts_dir, ignore_errors=True)
        return manifest

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "predict")  # Lightning skips the teardown hooks after an exception

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        detach, self._detach = self._detach, None
        if detach is not None:
            detach()
        self._parts = None
        self._done = None


def _dataset_length(trainer: pl.Trainer) -> int | None:
    """``len(dataset)`` of the predict dataloader when it has one (map-style), else None."""
    loaders = active_loaders(trainer, "predict")
    dataset = getattr(loaders[0], "dataset", None) if loaders else None
    try:
        return len(dataset) if dataset is not None and not isinstance(dataset, IterableDataset) else None
    except TypeError:
        return None


def _from_rank0(value: Any, key: str, world_size: int, timeout: float = 1800.0, doing: str = "finish") -> Any:
    """Rank 0's ``value`` on every rank, as long as rank 0 takes at most ``timeout`` s to produce it.

    Not a collective: ranks > 0 poll the rendezvous store, so rank 0 may merge for longer than the
    collective guard's timeout (a guarded broadcast would fail there), and a rank 0 that dies makes
    the store unreachable, which raises here at once instead of hanging. A rank 0 that is alive but
    stuck makes the others raise after ``timeout`` s (``PredictionWriter(merge_timeout=...)``).
    """
    if not collectives.is_distributed():
        return value
    try:
        store = default_store()
    except (AttributeError, RuntimeError, ValueError):  # pragma: no cover - no store: fall back to a collective
        return collectives.broadcast_object(value, src=0, safe=True)
    if dist.get_rank() == 0:
        store.set(key, json.dumps(value))
        return value
    delay, deadline = 0.01, time.monotonic() + timeout
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise LightningSyncError(
                f"PredictionWriter: rank {dist.get_rank()} waited {timeout:g} s for rank 0 to {doing}; rank 0 is "
                "alive (its store answers) but has not finished: stuck, or slower than that. Look at rank 0's stack "
                "(py-spy dump --pid PID); for data that takes longer, pass PredictionWriter(merge_timeout=...).")
        time.sleep(delay)
        delay = min(1.0, delay * 1.5)
    shared = json.loads(store.get(key))  # plain data: rank 0's bytes cannot run code here
    if store.add(f"{key}/read", 1) == world_size - 1:  # the last reader cleans up
        store.delete_key(key)
        store.delete_key(f"{key}/read")
    return shared
