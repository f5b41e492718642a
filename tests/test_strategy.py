"""SyncDDPStrategy and SeedBroadcast on real 2-process Lightning fits (CPU, gloo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

import lightning_sync as ls
from lightning_sync.seeding import derive_seed, derive_seeds

SCRIPT = Path(__file__).parent / "scripts" / "fit_seed.py"
N = 24  # fit_seed.py's data set size


def fit(out: Path, *args: str, timeout: int = 180) -> list[dict]:
    """Run tests/scripts/fit_seed.py (2 ranks via Lightning's launcher); return each rank's report."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["timeout", "-k", "5", str(timeout), sys.executable, str(SCRIPT), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout + 20)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_strategy_names_registered_by_import() -> None:
    for name, start in (("ddp_sync", "popen"), ("ddp_sync_spawn", "spawn")):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
        assert isinstance(trainer.strategy, ls.SyncDDPStrategy)
        assert trainer.strategy._start_method == start
    assert isinstance(L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False).strategy,
                      L.pytorch.strategies.DDPStrategy)


def test_strategy_rejects_bad_seed_early() -> None:
    with pytest.raises(ValueError, match=r"\[0, 4294967295\]"):
        ls.SyncDDPStrategy(seed=-1)
    with pytest.raises(TypeError, match="int or None"):
        ls.SyncDDPStrategy(seed="42")  # type: ignore[arg-type]


def test_derive_seed_is_stable_and_spread() -> None:
    assert derive_seed(42, "rank", 0) == derive_seed(42, "rank", 0)
    seeds = {derive_seed(42, "rank", r) for r in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**32 for s in seeds)
    assert derive_seed(41, "rank", 1) != derive_seed(42, "rank", 0)
    seeds_of = derive_seeds(42, "sample", 3)  # the prefix hashed once: the same seeds
    assert [seeds_of(i) for i in range(300)] == [derive_seed(42, "sample", 3, i) for i in range(300)]


def test_rank_seeds_are_the_seeds_the_rank_streams_get() -> None:
    import random

    from lightning_sync import SeedLineage

    def first_draw(lineage: SeedLineage, rank: int) -> float:
        lineage.seed_rank_streams(rank)
        return random.random()

    state = random.getstate()
    try:
        lineage = SeedLineage(root=7, world_size=3, origin="argument", local_seeds=[7, 7, 7])
        for seeds in (lineage.rank_seeds, [lineage.stream_seed(r) for r in range(3)]):
            assert [first_draw(lineage, r) for r in range(3)] == [random.Random(s).random() for s in seeds]
        lineage._resumed_at = 30  # resumed on another world size: new streams, and the seeds say so
        assert lineage.rank_seeds == [derive_seed(7, "rank", r, "resumed", 30) for r in range(3)]
        assert [first_draw(lineage, r) for r in range(3)] == [random.Random(s).random() for s in lineage.rank_seeds]
        assert f"rank 4 {lineage.stream_seed(4)}" in lineage.describe(first_stream_rank=3)  # a replica group's
    finally:
        random.setstate(state)


def _epochs(report: dict, per_epoch: int) -> list[list[int]]:
    seen = report["seen"]
    return [seen[i:i + per_epoch] for i in range(0, len(seen), per_epoch)]


@pytest.mark.slow
def test_ranks_with_different_local_seeds_agree(tmp_path: Path) -> None:
    r0, r1 = fit(tmp_path, "--local-seed-per-rank", "--epochs", "2")
    assert r0["seed"] == r1["seed"] == 100  # rank 0 was seeded with 100, rank 1 with 101
    for e0, e1 in zip(_epochs(r0, N // 2), _epochs(r1, N // 2)):
        assert not set(e0) & set(e1), "training shards overlap"
        assert sorted(e0 + e1) == list(range(N)), "training shards do not cover the data set"
    assert r0["init_digest"] == r1["init_digest"], "model initialisation differs across ranks"
    assert r0["noise"] != r1["noise"], "ranks draw identical random numbers (correlated dropout)"
    assert r0["final_digest"] == r1["final_digest"]


@pytest.mark.slow
def test_plain_ddp_with_different_local_seeds_overlaps(tmp_path: Path) -> None:
    """The failure ddp_sync exists to prevent (docs/strategy.md): shards overlap under Lightning's ddp."""
    r0, r1 = fit(tmp_path, "--local-seed-per-rank", "--strategy", "ddp", "--epochs", "1")
    assert set(r0["seen"]) & set(r1["seen"])


@pytest.mark.slow
@pytest.mark.timeout(2 * (300 + 20) + 180 + 20 + 60)  # four fits two at a time, then one
def test_same_seed_is_bit_identical_and_resume_continues(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    runs = {"a": ("--seed", "1234", "--epochs", "4"), "b": ("--seed", "1234", "--epochs", "4", "--local-seed-per-rank"),
            "c": ("--seed", "4321", "--epochs", "4"), "d": ("--seed", "1234", "--epochs", "2", "--save-ckpt")}
    with ThreadPoolExecutor(max_workers=2) as pool:  # independent fits, two at a time (start-up dominates)
        done = {k: pool.submit(fit, tmp_path / k, *args, timeout=300) for k, args in runs.items()}
        a, b, c = (done[k].result() for k in "abc")
        done["d"].result()
    assert [r["final_digest"] for r in a] == [r["final_digest"] for r in b]
    assert [r["noise"] for r in a] == [r["noise"] for r in b]
    assert c[0]["final_digest"] != a[0]["final_digest"]
    # stop after 2 epochs (run d), then resume to 4 with no seed given: the checkpoint's seed and RNG states win
    ckpt = tmp_path / "d" / "last.ckpt"
    resumed = fit(tmp_path / "e", "--epochs", "4", "--resume", str(ckpt))
    assert resumed[0]["seed"] == 1234
    assert [r["final_digest"] for r in resumed] == [r["final_digest"] for r in a]
    for whole, tail in zip(a, resumed):
        assert whole["noise"][-len(tail["noise"]):] == tail["noise"]
        assert whole["seen"][-len(tail["seen"]):] == tail["seen"]


@pytest.mark.slow
def test_dataloader_workers_get_distinct_seeds(tmp_path: Path) -> None:
    r0, r1 = fit(tmp_path / "a", "--seed", "7", "--workers", "2", "--epochs", "2")
    draws = r0["ys"] + r1["ys"]  # numpy draws made inside the workers
    assert len(set(draws)) == len(draws), "two workers (or two ranks, or two epochs) replayed one stream"
    again = fit(tmp_path / "b", "--seed", "7", "--workers", "2", "--epochs", "2")
    assert [r["ys"] for r in again] == [r0["ys"], r1["ys"]]


@pytest.mark.slow
def test_fit_then_validate_in_one_process(tmp_path: Path) -> None:
    """Teardown destroys the process group; the next trainer call must build a fresh one."""
    fit(tmp_path, "--epochs", "1", "--then-validate")
    assert (tmp_path / "validated0").exists() and (tmp_path / "validated1").exists()


@pytest.mark.slow
def test_seed_broadcast_callback_on_lightning_ddp(tmp_path: Path) -> None:
    r0, r1 = fit(tmp_path, "--local-seed-per-rank", "--strategy", "ddp", "--seed-callback", "--epochs", "2")
    for e0, e1 in zip(_epochs(r0, N // 2), _epochs(r1, N // 2)):
        assert sorted(e0 + e1) == list(range(N))
    assert r0["init_digest"] == r1["init_digest"]
    assert r0["noise"] != r1["noise"]
    assert r0["seed"] == r1["seed"] == 100


@pytest.mark.slow
def test_spawn_variant_fits(tmp_path: Path) -> None:
    r0, r1 = fit(tmp_path, "--strategy", "ddp_sync_spawn", "--seed", "5", "--epochs", "1")
    assert r0["seed"] == r1["seed"] == 5
    assert sorted(r0["seen"] + r1["seen"]) == list(range(N))


def _barrierless_reduce_equals_lightnings(rank: int, world: int) -> list[str]:
    """The sync_dist reduction a confirmed call runs without Lightning's barrier, against Lightning's own."""
    import torch
    from lightning.fabric.utilities.distributed import _sync_ddp
    from torch.distributed import ReduceOp

    from lightning_sync.parts.mixin import _all_reduce

    differ = []
    for dtype in (torch.float32, torch.float64, torch.int64, torch.int32):
        for op in ("mean", "avg", "sum", "max", "min", ReduceOp.SUM, ReduceOp.MAX):
            value = (torch.arange(5) * (rank + 2) + rank).to(dtype)  # integer means truncate, as Lightning's do
            ours, theirs = _all_reduce(value.clone(), None, op), _sync_ddp(value.clone(), None, op)
            if ours.dtype != theirs.dtype or not torch.equal(ours, theirs):
                differ.append(f"{dtype} {op}: {ours.tolist()} vs {theirs.tolist()}")
    return differ


def test_barrierless_sync_dist_reduce_matches_lightnings_on_every_op_and_dtype() -> None:
    from tests.distributed import run_ranks

    assert run_ranks(_barrierless_reduce_equals_lightnings, 2, timeout=60) == [[], []]


CALLS = Path(__file__).parent / "scripts" / "calls_after_fit.py"


def _calls_after_fit(out: Path, *args: str) -> list[dict]:
    proc = subprocess.run(["timeout", "-k", "5", "240", sys.executable, str(CALLS), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=260)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_trainer_calls_after_fit_make_ddps_collectives(tmp_path: Path) -> None:
    """validate/test/predict after fit: Lightning's barriers, its sync_dist reductions and its object broadcasts
    are Lightning's own under ddp_sync (torch's transport, no channel of ours): each call makes ddp's
    collectives, at most one token confirmation on the guard's own group before each, and the guard's start-up
    agreement; the values are those of ddp where the exact evaluation changes nothing (a max), and the same on
    every rank and in every repeated call."""
    ours, theirs = _calls_after_fit(tmp_path / "ours"), _calls_after_fit(tmp_path / "ddp", "--strategy", "ddp")
    for r in ours + theirs:
        assert "error" not in r, r["error"]
    for call in ("validate", "test", "predict", "validate_again"):
        counts = [(a[call]["collectives"], b[call]["collectives"]) for a, b in zip(ours, theirs)]
        assert all(b < a <= 2 * b + 1 for a, b in counts), counts
    assert ours[0]["validate"]["value"] == ours[1]["validate"]["value"] == ours[0]["validate_again"]["value"]
    assert ours[0]["validate"]["value"][0]["val_max"] == theirs[0]["validate"]["value"][0]["val_max"]
    assert ours[0]["test"]["value"] == ours[1]["test"]["value"]
    # the same weights after fit; every sample predicted once (ddp's sampler repeats one to even the ranks out)
    predicted = ours[0]["predict"]["value"] + ours[1]["predict"]["value"]
    assert len(predicted) == 101
    expected = sorted(set(theirs[0]["predict"]["value"] + theirs[1]["predict"]["value"]))
    assert sorted(predicted) == pytest.approx(expected, rel=1e-6, abs=1e-6)  # other batches: another last bit


@pytest.mark.slow
def test_strategy_collectives_at_different_calls_fail_every_rank_at_once(tmp_path: Path) -> None:
    """Rank 0 in trainer.strategy.barrier(), rank 1 in trainer.strategy.broadcast(): the guard sees both calls
    (Lightning's barrier and broadcast_object_list) and every rank raises its error naming both call sites."""
    for r in _calls_after_fit(tmp_path, "--mismatch"):
        assert r["error"]["type"] == "CollectiveMismatchError", r["error"]
        assert r["error"]["seconds"] < 60, r["error"]  # the whole fit: at once, not after the guard timeout (120 s)
        assert "rank 0 at calls_after_fit.py" in r["error"]["message"] and ": barrier;" in r["error"]["message"]
        # (its first broadcast on the wire: the objects' sizes, from rank 0)
        assert ": broadcast_object_list int64[1] src=0" in r["error"]["message"]


ONOFF = Path(__file__).parent / "scripts" / "fit_guard_onoff.py"


def _fit_onoff(out: Path, guard: str) -> list[dict]:
    out.mkdir()
    proc = subprocess.run(["timeout", "-k", "5", "240", sys.executable, str(ONOFF), str(out), guard],
                          capture_output=True, text=True, timeout=260)
    assert proc.returncode == 0, f"guard {guard}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [torch.load(out / f"rank{r}.pt") for r in range(3)]


@pytest.mark.slow
def test_guard_on_and_off_train_and_log_bit_for_bit_alike(tmp_path: Path) -> None:
    """Issue 40: the guard only watches. With it on and off, 3 ranks (where a sum's order shows in its last bits)
    with SyncBatchNorm and per-step and per-epoch sync_dist logs end with the same weights, BatchNorm statistics
    and logged values, bit for bit: the same transport (torch's process group) carries the same collectives."""
    on, off = _fit_onoff(tmp_path / "on", "on"), _fit_onoff(tmp_path / "off", "off")
    for rank, (a, b) in enumerate(zip(on, off)):
        assert a["state"].keys() == b["state"].keys()
        differ = [k for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])]
        assert differ == [], f"rank {rank}: {differ}"
        assert a["logged"] == b["logged"], f"rank {rank}"
        assert a["epoch_end"] == b["epoch_end"] and "val_loss" in a["epoch_end"], (a["epoch_end"], b["epoch_end"])
    assert on[0]["logged"] == on[1]["logged"] == on[2]["logged"]  # sync_dist: every rank logs the same values
    assert len(on[0]["logged"]) > 10
