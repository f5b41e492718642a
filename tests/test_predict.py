"""PredictionWriter: conversions and the streaming merge (no processes), one-process Trainer runs, and
real 2-rank (ddp_sync) and 3-rank (Lightning's ddp) runs checked against a one-process forward pass,
including 2,000,003 rows with rank 0's memory measured, and a resume after a rank was SIGKILLed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_sync as ls
from lightning_sync import rowstore
from tests.distributed import run_ranks
from tests.launch import launch_script, load_script, read_reports

pa = pytest.importorskip("pyarrow")  # the "parquet" extra; the test extra installs it
pq = pytest.importorskip("pyarrow.parquet")

SCRIPT = Path(__file__).parent / "scripts" / "predict_parquet.py"
BIG = 2_000_003


def _script() -> Any:
    return load_script(SCRIPT)


# ---------------------------------------------------------------- no processes


def test_to_arrow_rows_and_errors() -> None:
    emb = rowstore.to_arrow("emb", torch.arange(6, dtype=torch.float32).reshape(3, 2), 3)
    assert emb.type == pa.list_(pa.float32(), 2) and emb.to_pylist() == [[0, 1], [2, 3], [4, 5]]
    assert rowstore.to_arrow("b", torch.tensor([1.5, 2.5], dtype=torch.bfloat16), 2).type == pa.float32()
    cube = rowstore.to_arrow("c", torch.zeros(2, 2, 3, dtype=torch.int16), 2)
    assert cube.type == pa.list_(pa.list_(pa.int16(), 3), 2)
    ragged = rowstore.to_arrow("t", [torch.arange(2), torch.arange(0), torch.arange(3)], 3)
    assert ragged.to_pylist() == [[0, 1], [], [0, 1, 2]]
    assert rowstore.to_arrow("s", ("a", "b"), 2).to_pylist() == ["a", "b"]
    with pytest.raises(ValueError, match=r"key 'emb' has shape \(2, 2\) but the batch has 3 samples"):
        rowstore.to_arrow("emb", torch.zeros(2, 2), 3)
    with pytest.raises(ValueError, match="list of 1 items but the batch has 2"):
        rowstore.to_arrow("s", ["a"], 2)
    with pytest.raises(ValueError, match="differ in their first dimension only"):
        rowstore.to_arrow("t", [torch.zeros(1, 2), torch.zeros(1, 3)], 2)
    with pytest.raises(TypeError, match="json.dumps"):
        rowstore.to_arrow("o", [object(), object()], 2)
    with pytest.raises(TypeError, match="view_as_real"):
        rowstore.to_arrow("z", torch.zeros(2, dtype=torch.complex64), 2)


def test_take_survives_pyarrow_sliced_nested_list_bug() -> None:
    rows = pa.FixedSizeListArray.from_arrays(pa.FixedSizeListArray.from_arrays(pa.array(np.arange(40.0)), 2), 2)
    table = pa.table({"square": rows}).slice(3)
    want = [[[36.0, 37.0], [38.0, 39.0]]]
    assert rowstore._take(table, np.array([6])).column(0).to_pylist() == want
    if table.take(pa.array([6])).column(0).to_pylist() == want:  # pragma: no cover - tells when the workaround can go
        print(f"pyarrow {pa.__version__} takes sliced nested fixed-size lists correctly now")


def test_bad_arguments_and_missing_pyarrow(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="only 'parquet'"):
        ls.PredictionWriter("p.csv", format="csv")
    with pytest.raises(ValueError, match="'batch' or 'epoch'"):
        ls.PredictionWriter("p.parquet", write_interval="step")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pass a list of keys"):
        ls.PredictionWriter("p.parquet", keys="emb")
    with pytest.raises(ValueError, match="positive int"):
        ls.PredictionWriter("p.parquet", row_group_size=0)
    with pytest.raises(ValueError, match="compression"):
        ls.PredictionWriter("p.parquet", compression="rar")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what an environment without pyarrow sees
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"pip install 'lightning_sync\[parquet\]'"):
        ls.PredictionWriter("p.parquet")


def _rank_parts(root: Path, rank: int, batches: list[list[int]], attempt: str = "a", flush: int | None = 4) -> None:
    writer = rowstore.PartWriter(root / f"rank-{rank:05d}", attempt, flush)
    for position, batch in enumerate(batches):
        index = np.array(batch, dtype=np.int64)
        writer.add(index, {"v": pa.array(index * 10 + rank), "s": pa.array([f"r{rank}i{i}" for i in batch])}, position)
    writer.flush()


@pytest.mark.parametrize("fan_in", [64, 2])
def test_merge_streams_orders_and_keeps_the_first_copy(tmp_path: Path, fan_in: int) -> None:
    """Shuffled batches on 3 'ranks' with duplicates (padding, a repeat within a rank); fan_in=2 forces passes."""
    rng = np.random.default_rng(0)
    perm = rng.permutation(50).tolist()
    shards = [perm[r::3] for r in range(3)]
    shards[1] += [shards[0][0]]  # padding: rank 1 repeats a sample of rank 0
    shards[2] += [shards[2][0]]  # a sampler that repeats within a rank
    for rank, shard in enumerate(shards):
        _rank_parts(tmp_path, rank, [shard[i:i + 3] for i in range(0, len(shard), 3)])
    out = tmp_path / "out.parquet"
    result = rowstore.merge_parts(tmp_path, out, row_group_size=7, compression="zstd", fan_in=fan_in, chunk_rows=2)
    table = pq.read_table(out)
    assert table.column("index").to_pylist() == list(range(50))
    owner = {i: r for r, shard in enumerate(shards) for i in reversed(shard)}  # first copy in rank order
    owner[shards[0][0]] = 0
    assert table.column("v").to_pylist() == [i * 10 + owner[i] for i in range(50)]
    assert table.column("s").to_pylist() == [f"r{owner[i]}i{i}" for i in range(50)]
    assert result.rows == 50 and result.rows_in == 52 and sum(result.kept_per_rank.values()) == 50
    assert (result.passes > 1) == (fan_in == 2)
    assert [pq.ParquetFile(out).metadata.row_group(g).num_rows for g in range(8)] == [7] * 7 + [1]
    assert not list(tmp_path.glob(".merge-*")) and not list(tmp_path.glob(".*tmp*"))


def test_done_set_dense_and_sparse(tmp_path: Path) -> None:
    _rank_parts(tmp_path / "dense", 0, [[0, 1, 2], [5, 6]])
    _rank_parts(tmp_path / "sparse", 0, [[2**40, 3], [-7]])
    dense = rowstore.DoneSet(rowstore.list_parts(tmp_path / "dense"))
    assert dense.contains_all([2, 0]) and not dense.contains_all([2, 3]) and not dense.contains_all([99])
    sparse = rowstore.DoneSet(rowstore.list_parts(tmp_path / "sparse"))
    assert sparse.contains_all([2**40, -7]) and not sparse.contains_all([4])


# ---------------------------------------------------------------- one process, in this process


def _trainer(writer: ls.PredictionWriter) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[writer])


def test_one_process_target_checks_and_resume(tmp_path: Path) -> None:
    mod = _script()
    path = tmp_path / "preds.parquet"
    loader = DataLoader(mod.Rows(23), batch_size=4, shuffle=True)
    first = ls.PredictionWriter(path, row_group_size=5)
    _trainer(first).predict(mod.Model(rich=True), loader, return_predictions=False)
    table = pq.read_table(path)
    assert table.column_names == ["index", "emb", "label", "name", "tokens", "square"]
    assert table.column("index").to_pylist() == list(range(23))
    check_columns(table, 23)
    assert first.manifest is not None and first.manifest["world_size"] == 1 and first.manifest["rows"] == 23
    assert json.loads((tmp_path / "preds.manifest.json").read_text())["sha256"] == first.manifest["sha256"]
    assert not (tmp_path / "preds.parts").exists()
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        _trainer(ls.PredictionWriter(path)).predict(mod.Model(), loader, return_predictions=False)
    assert path.read_bytes() == before
    # resume: the parts of a run killed after its first two batches are reused; those batches are not predicted
    kept = ls.PredictionWriter(path, overwrite=True, keep_parts=True, keys=["emb", "label"], row_group_size=4)
    _trainer(kept).predict(mod.Model(), DataLoader(mod.Rows(23), batch_size=4), return_predictions=False)
    parts = rowstore.list_parts(tmp_path / "preds.parts")
    assert len(parts) == 6
    for extra in parts[2:]:
        extra.path.unlink()
    path.unlink()
    resumed = ls.PredictionWriter(path, resume=True, keys=["emb", "label"], row_group_size=4)
    calls: list[int] = []

    class Counting(mod.Model):  # type: ignore[misc, name-defined]
        def predict_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            calls.append(len(batch[0]))
            return super().predict_step(batch, batch_idx)

    _trainer(resumed).predict(Counting(), DataLoader(mod.Rows(23), batch_size=4), return_predictions=False)
    assert resumed.manifest is not None and resumed.manifest["ranks"][0]["batches_skipped"] == 2
    assert sum(calls) == 23 - 8
    assert pq.read_table(path).column("index").to_pylist() == list(range(23))
    assert resumed.manifest["sha256"] == kept.manifest["sha256"]  # type: ignore[index]


# ---------------------------------------------------------------- real multi-process runs


def launch(out: Path, *args: str, timeout: int = 400, check: bool = True) -> subprocess.CompletedProcess[str]:
    return launch_script(SCRIPT, out, *args, timeout=timeout, check=check)


reports = read_reports


def check_columns(table: Any, n: int, rows: slice = slice(None)) -> None:
    """Every column equals a one-process forward pass over the whole data set."""
    mod = _script()
    index = torch.arange(n)[rows]
    assert table.column("index").to_numpy().tolist() == index.tolist()
    with torch.no_grad():
        want = mod.model()(mod.features(index)).numpy()
    got = table.column("emb").combine_chunks().flatten().to_numpy().reshape(-1, mod.DIM)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert table.column("label").to_numpy().tolist() == (index % 10).tolist()
    if "name" in table.column_names:
        assert table.column("name").to_pylist() == [f"s{i}" for i in index.tolist()]
        assert table.column("tokens").to_pylist() == [list(range(i % 4)) for i in index.tolist()]
        square = mod.features(index)[:, :4].reshape(-1, 2, 2).tolist()
        np.testing.assert_allclose(np.array(table.column("square").to_pylist()), square, rtol=1e-6)


def check_main(out: Path, world: int, big: int, padded: bool, memory: bool = True) -> list[dict[str, Any]]:
    reps = reports(out, "main", world)
    for name, n in (("n7", 7), ("shuffled", 1001), ("custom", 1001), ("reference", 1001)):
        table = pq.read_table(out / f"{name}.parquet")
        check_columns(table, n)
        manifest = json.loads((out / f"{name}.manifest.json").read_text())
        assert manifest["rows"] == n and manifest["world_size"] == world and manifest["index"]["contiguous"]
        assert sum(r["rows_kept"] for r in manifest["ranks"]) == n
        assert not (out / f"{name}.parts").exists()
    assert pq.read_table(out / "custom.parquet").column_names == ["index", "label", "emb"]  # keys= order
    n7 = json.loads((out / "n7.manifest.json").read_text())
    if padded:  # the padded DistributedSampler repeated samples; the writer dropped them by index
        total = -(-7 // world) * world
        assert n7["duplicates_dropped"] == total - 7
        assert [r["rows_predicted"] for r in n7["ranks"]] == [total // world] * world
    else:  # ddp_sync's exact evaluation re-cuts even the user's sampler: nothing repeated
        assert n7["duplicates_dropped"] == 0 and sum(r["rows_predicted"] for r in n7["ranks"]) == 7
    assert pq.ParquetFile(out / "shuffled.parquet").metadata.row_group(0).column(1).compression == "ZSTD"
    # the big run, streamed: index exactly 0..N-1, columns checked in slices (the reference fits in memory too)
    table = pq.read_table(out / "big.parquet")
    assert table.num_rows == big
    index = table.column("index").to_numpy()
    assert index[0] == 0 and bool(np.all(np.diff(index) == 1))
    for start in (0, big // 2, big - 70_000):
        check_columns(table.slice(start, 70_000), big, slice(start, start + 70_000))
    size = big * (8 + 16 * 4 + 8)  # index + 16 float32 + int64 label
    rss = reps[0]["big_rss"]
    growth = rss["peak"] - rss["base"]
    print(f"{world} ranks: rank 0 peak RSS growth {growth / 2**20:.1f} MiB for {size / 2**20:.1f} MiB of predictions")
    if memory:  # (not on the gpu tier: CUDA's own host allocations land in the same RSS)
        # measured 0.33x (ddp_sync, 2 ranks, the loader as a user writes it: the strategy's index
        # bookkeeping counts too) and 0.42x (ddp, 3 ranks, a lazy sampler); flat in N (bench_scale.py)
        assert growth < (0.6 if padded else 0.5) * size, (growth, size)
    for rep in reps[1:]:
        print(f"a rank > 0: peak RSS growth {(rep['big_rss']['peak'] - rep['big_rss']['base']) / 2**20:.1f} MiB")
    for rep in reps:  # every rank raised the same clear error, fast, and nothing was written
        if "exists" in rep:
            assert rep["exists"]["type"] == "FileExistsError" and "overwrite=True" in rep["exists"]["message"]
        if "batch_dim" in rep:
            assert rep["batch_dim"]["type"] == "ValueError"
            message = rep["batch_dim"]["message"]
            assert "rank 1, batch 0: key 'emb' has shape (1, 16) but the batch has 2 samples" in message
        if world > 1:  # the extra key is rank 1's
            assert rep["extra_key"]["type"] == "RankMismatchError"
            assert "rank 0 index: int64, emb:" in rep["extra_key"]["message"]
            assert "extra: float" in rep["extra_key"]["message"]
        assert not rep["bad_exists"]
        for case in ("exists", "batch_dim", "extra_key"):
            assert rep.get(case, {"seconds": 0})["seconds"] < 60
    return reps


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_ddp_sync_big_and_resume_after_a_rank_was_killed(tmp_path: Path) -> None:
    start = time.monotonic()
    # one error case only: after a failed call, ddp_sync's next trainer call in the same processes can
    # pair with the previous process group (its teardown skips the barrier); Lightning's ddp runs all
    launch(tmp_path, "--big", str(BIG), "--errors", "extra_key")
    print(f"main launch took {time.monotonic() - start:.1f} s")
    check_main(tmp_path, 2, BIG, padded=False)
    big = json.loads((tmp_path / "big.manifest.json").read_text())
    assert big["root_seed"] == 1234 and big["strategy"] == "SyncDDPStrategy"
    # rank 1 SIGKILLs itself at its 40th batch; Lightning's launcher takes rank 0 down too
    killed = launch(tmp_path, "--phase", "kill", check=False, timeout=300)
    assert killed.returncode != 0 and not (tmp_path / "resumable.parquet").exists()
    parts = rowstore.list_parts(tmp_path / "resumable.parts")
    assert parts and {p.rank for p in parts} == {0, 1}
    launch(tmp_path, "--phase", "resume", timeout=300)
    check_columns(pq.read_table(tmp_path / "resumable.parquet"), 1001)
    resumed = json.loads((tmp_path / "resumable.manifest.json").read_text())
    reference = json.loads((tmp_path / "reference.manifest.json").read_text())
    assert resumed["ranks"][1]["batches_skipped"] >= 30 and resumed["ranks"][1]["rows_predicted"] > 0
    assert resumed["sha256"] == reference["sha256"]  # the same file as the uninterrupted run


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_ranks_lightning_ddp(tmp_path: Path) -> None:
    launch(tmp_path, "--strategy", "ddp", "--devices", "3", "--big", str(BIG))
    check_main(tmp_path, 3, BIG, padded=True)
    assert json.loads((tmp_path / "big.manifest.json").read_text())["root_seed"] is None


def _rank0_stuck(rank: int, world: int) -> str:
    from lightning_sync.callbacks.predict import _from_rank0

    if rank == 0:
        time.sleep(4)  # alive, never publishes (a stuck merge)
        return "rank 0"
    try:
        _from_rank0({"ok": True}, "lightning_sync/test/stuck", world, timeout=1.0, doing="merge the part files")
    except ls.LightningSyncError as err:
        return str(err)
    return "no error"


def test_ranks_waiting_for_a_stuck_rank_0_raise_after_the_merge_timeout() -> None:
    start = time.monotonic()
    _, text = run_ranks(_rank0_stuck, 2, timeout=60)
    assert "rank 1 waited 1 s for rank 0 to merge the part files; rank 0 is alive" in text, text
    assert "merge_timeout" in text and time.monotonic() - start < 30
    with pytest.raises(ValueError, match="merge_timeout"):
        ls.PredictionWriter("x.parquet", merge_timeout=0)
