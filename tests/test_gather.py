"""ValidationGather: index bookkeeping (no processes), RowCollector on 2 and 3 gloo ranks, and real
2-/3-process Lightning runs (fit/validate/test/predict) checked against one-process results."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

import lightning_sync as ls
from lightning_sync import collectives as C
from lightning_sync.callbacks.gather import _BatchLog, _Recorder
from lightning_sync.gathering import RowCollector, dedup_by_index
from tests.distributed import run_ranks
from tests.launch import launch_script, load_script, read_reports

SCRIPT = Path(__file__).parent / "scripts" / "eval_gather.py"
BIG = 2**53 + 1  # any float32/float64 detour of an int64 index shows


def _script_module() -> Any:
    return load_script(SCRIPT)


# ---------------------------------------------------------------- bookkeeping, no processes


def test_dedup_keeps_first_occurrence_in_index_order() -> None:
    # two ranks of DistributedSampler(5 samples): rank 0 [0, 2, 4], rank 1 [1, 3, 0] (0 is padding)
    unique, first = dedup_by_index(torch.tensor([0, 2, 4, 1, 3, 0]))
    assert unique.tolist() == [0, 1, 2, 3, 4] and first.tolist() == [0, 3, 1, 4, 2]
    # sparse and huge indices take the sort path; int64 stays exact
    unique, first = dedup_by_index(torch.tensor([BIG, -5, BIG, 7]))
    assert unique.tolist() == [-5, 7, BIG] and first.tolist() == [1, 3, 0]
    unique, first = dedup_by_index(torch.tensor([2, 0, 1, 0]))  # dense and complete: the fast path
    assert unique.tolist() == [0, 1, 2] and first.tolist() == [1, 2, 0]
    rows, counts = C.gather_uneven(torch.ones(3, 2))  # not distributed: unchanged
    assert rows is not None and rows.shape == (3, 2) and counts == [3]
    unique, first = dedup_by_index(torch.empty(0, dtype=torch.int64))
    assert unique.numel() == 0 and first.numel() == 0


def test_collector_one_process_orders_and_dedups() -> None:
    c = RowCollector()
    c.add([4, 0], {"x": torch.tensor([[4.0, 4.5], [0.0, 0.5]]), "y": torch.tensor([40, 0])}, {"s": ["d", "a"]})
    c.add(torch.tensor([2, 4]), {"x": torch.tensor([[2.0, 2.5], [9.0, 9.0]]), "y": torch.tensor([20, 99])},
          {"s": ["c", "dup"]})
    out = c.gather()
    assert out is not None and len(c) == 0
    assert out["index"].dtype == torch.int64 and out["index"].tolist() == [0, 2, 4]
    assert out["x"].tolist() == [[0.0, 0.5], [2.0, 2.5], [4.0, 4.5]]
    assert out["y"].dtype == torch.int64 and out["y"].tolist() == [0, 20, 40]
    assert out["s"] == ["a", "c", "d"]  # the first occurrence of 4 wins


def test_collector_rejects_bad_batches() -> None:
    c = RowCollector()
    with pytest.raises(ValueError, match=r"'x' has shape \(3,\) but the batch has 2 samples"):
        c.add([0, 1], {"x": torch.zeros(3)})
    with pytest.raises(ValueError, match="list of 1 items but the batch has 2"):
        c.add([0, 1], objects={"s": ["a"]})
    c.add([0, 1], {"x": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match=r"pad ragged rows to a fixed length"):
        c.add([2, 3], {"x": torch.zeros(2, 4)})


def test_callback_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="stages must be"):
        ls.ValidationGather(stages=["fit"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="pass a list of keys"):
        ls.ValidationGather(keys="preds")
    with pytest.raises(TypeError, match="torchmetrics.Metric"):
        ls.ValidationGather(metrics={"acc": 0.5})


class _SlottedBatchSampler:
    """A user's batch sampler with __slots__ (its class could not be swapped for a recording one)."""

    __slots__ = ("n", "size")

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __iter__(self) -> Any:
        return iter([list(range(i, min(i + self.size, self.n)))[::-1] for i in range(0, self.n, self.size)])

    def __len__(self) -> int:
        return -(-self.n // self.size)


class _TaggedLoader(DataLoader):  # type: ignore[type-arg]
    """A user's DataLoader subclass with an argument it does not keep as an attribute (not re-creatable)."""

    def __init__(self, dataset: Any, tag: str, **kwargs: Any) -> None:
        self._tag = tag
        super().__init__(dataset, **kwargs)


@pytest.mark.parametrize("workers", [0, 2])
def test_recorder_queue_matches_batches_with_prefetch(workers: int) -> None:
    """Indices come from the batch sampler in the main process, in order, even with workers prefetching.

    The recorder uses a shallow copy of each loader whose batch sampler records: the user's loader and its
    samplers are left as they were, the copy keeps the class, the attributes and the sampler (nothing is
    re-created, so a loader class that cannot be re-created records too), Lightning's index wrapper stays
    outermost."""
    from lightning.fabric.utilities.data import _replace_dunder_methods

    data = list(range(23))
    with _replace_dunder_methods(DataLoader, "dataset"):  # as Lightning captures a *_dataloader hook's arguments
        positional = DataLoader(data, 3, False, num_workers=workers)
    loaders = [DataLoader(data, batch_size=4, num_workers=workers, sampler=DistributedSampler(data, 2, 1, seed=1)),
               DataLoader(data, batch_sampler=_IndexBatchSamplerWrapper(BatchSampler(SequentialSampler(data), 5, True))),
               DataLoader(data, batch_sampler=_SlottedBatchSampler(23, 6), num_workers=workers),
               DataLoader(data, batch_size=None, num_workers=workers),  # no batch sampler: one index per item
               positional,
               _TaggedLoader(data, "t", batch_size=4, num_workers=workers)]
    recorder = _Recorder()
    recorded = []
    for loader in loaders:
        before, sampler_before = loader.batch_sampler, loader.sampler
        new = recorder.install(loader)
        assert new is not loader and loader.batch_sampler is before and loader.sampler is sampler_before
        assert type(new) is type(loader) and (new.sampler is loader.sampler or loader.batch_sampler is None)
        assert recorder.install(new) is new  # already recording: kept
        assert isinstance(recorder.lookup(loader), str)  # the user's own loader is not the one recorded
        log = recorder.lookup(new)
        assert isinstance(log, _BatchLog)
        if isinstance(before, _IndexBatchSamplerWrapper):
            assert type(new.batch_sampler) is _IndexBatchSamplerWrapper
        assert len(new) == len(loader) and new.num_workers == loader.num_workers
        for _ in range(2):  # a second pass (epoch) starts a fresh queue
            got = [torch.as_tensor(batch).tolist() for batch in new]
            assert got == [torch.as_tensor(batch).tolist() for batch in loader]  # the same batches as the user's loader
            for batch in got:
                assert log.pop() == (batch if isinstance(batch, list) else [batch])  # the dataset returns its index
            assert log.pop() is None
        recorded.append((new, log))
    assert recorded[1][0].batch_sampler.seen_batch_indices  # Lightning's own index recording still works
    assert recorded[4][0].batch_sampler.batch_size == 3  # DataLoader(data, 3, ...): its batch size, given by position
    recorder.uninstall()
    for new, log in recorded:  # stopped: the re-created loaders pass batches through, nothing is queued
        assert list(new) and log.pop() is None


# ---------------------------------------------------------------- RowCollector on real gloo ranks


def _rank_rows(rank: int, world: int, n: int, big: bool, exact: bool) -> tuple[list[int], torch.Tensor]:
    """DistributedSampler-like shard with padding: rank r gets r, r+world, ... wrapped around to world*ceil(n/world).

    ``exact``: ddp_sync's contiguous unpadded shards instead (already in index order: the no-copy path)."""
    total = -(-n // world) * world
    idx = [(i % n) for i in range(rank, total, world)]
    if exact:
        sizes = [n // world + (r < n % world) for r in range(world)]
        idx = list(range(sum(sizes[:rank]), sum(sizes[:rank + 1])))
    if big:
        idx = [BIG + 3 * i for i in idx]
    return idx, torch.tensor(idx, dtype=torch.float64)


def _collect(rank: int, world: int, n: int, dst: int | None, big: bool, exact: bool) -> dict[str, Any] | None:
    idx, value = _rank_rows(rank, world, n, big, exact)
    c = RowCollector()
    for start in range(0, len(idx), 4):  # batches of 4
        sl = slice(start, start + 4)
        b = idx[sl]
        c.add(b, {"v": value[sl].reshape(-1, 1).repeat(1, 3), "flag": torch.tensor([i % 2 == 0 for i in b])},
              {"name": [f"s{i}" for i in b], "ragged": [torch.arange(i % 4) for i in b]})
    out = c.gather(dst=dst)
    return None if out is None else {k: (v.tolist() if isinstance(v, torch.Tensor) else
                                          [x.tolist() if isinstance(x, torch.Tensor) else x for x in v])
                                      for k, v in out.items()}


CONFIGS = ((7, None, False, False), (1001, None, False, False), (2, None, False, False), (11, None, True, False),
           (7, -1, False, False), (11, -1, True, False),
           (7, None, False, True), (1001, None, False, True), (2, None, True, True), (10, -1, False, True))
MISMATCH = {
    "keys": r"RankMismatchError: .*rank 0 \{p: \(\) float32\}, rank 1 \{extra: \(\) float32, p: \(\) float32\}",
    "shape": r"RankMismatchError: .*rank 0 \{p: \(2,\) float32\}, rank 1 \{p: \(3,\) float32\}",
    "bad_batch": r"ValueError: .*rank 1: key 'p' has shape",
    "empty_rank": r"ok \[0(, 2)?\] torch.Size\(\[\d, 2\]\) \['0'(, '2')?\]",
}


def _mismatch(rank: int, world: int, case: str) -> str:
    c = RowCollector()
    if case == "keys":
        c.add([rank], {"p": torch.zeros(1)} if rank == 0 else {"p": torch.zeros(1), "extra": torch.zeros(1)})
    elif case == "shape":
        c.add([rank], {"p": torch.zeros(1, 2 + rank)})
    elif case == "bad_batch":
        if rank == 1:
            c.fail("key 'p' has shape (3,) but the batch has 2 samples")
        else:
            c.add([0], {"p": torch.zeros(1)})
    elif case == "empty_rank":  # not a mismatch: a rank with no batch adopts the others' layout
        if rank != 1:
            c.add([rank], {"p": torch.full((1, 2), float(rank))}, {"s": [str(rank)]})
        out = c.gather()
        assert out is not None
        return f"ok {out['index'].tolist()} {out['p'].shape} {out['s']}"
    start = time.monotonic()
    try:
        c.gather()
    except (ls.RankMismatchError, ValueError) as err:
        assert time.monotonic() - start < 10
        return f"{type(err).__name__}: {err}"
    return "no error"


def _all_collector_cases(rank: int, world: int) -> dict[str, Any]:
    """Everything in one group launch (each costs seconds on a loaded machine): the group stays
    usable after a mismatch because every rank raises after the same collectives."""
    out: dict[str, Any] = {}
    for n, dst, big, exact in CONFIGS:
        out[f"rows {n} {dst} {big} {exact}"] = _collect(rank, world, n, None if dst is None else world + dst, big, exact)
    for case in MISMATCH:
        out[case] = _mismatch(rank, world, case)
    rows, counts = C.gather_uneven(torch.full((rank, 2), BIG + rank, dtype=torch.int64), dst=1)
    out["gather_uneven"] = (None if rows is None else rows.tolist(), counts)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_collector_on_real_ranks(world: int) -> None:
    """Exactly once, in index order, int64 exact, objects aligned; mismatches raise on every rank within seconds."""
    results = run_ranks(_all_collector_cases, world, timeout=240)
    for rank, res in enumerate(results):
        for n, dst, big, exact in CONFIGS:
            out = res[f"rows {n} {dst} {big} {exact}"]
            if dst is not None and rank != world + dst:
                assert out is None
                continue
            want = [BIG + 3 * i for i in range(n)] if big else list(range(n))
            assert out["index"] == want, (n, big, dst)
            assert [row[0] for row in out["v"]] == [float(i) for i in want]
            assert out["flag"] == [i % 2 == 0 for i in want]
            assert out["name"] == [f"s{i}" for i in want]
            assert out["ragged"] == [list(range(i % 4)) for i in want]
        for case, expected in MISMATCH.items():
            assert re.search(expected, res[case]), f"rank {rank} {case}: {res[case]}"
        counts = list(range(world))
        want_rows = [[BIG + r] * 2 for r in range(world) for _ in range(r)]
        assert res["gather_uneven"] == ((want_rows if rank == 1 else None), counts)


# ---------------------------------------------------------------- real Lightning runs


def launch(out: Path, *args: str, timeout: int = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    return launch_script(SCRIPT, out, *args, timeout=timeout, check=check)


reports = read_reports


def reference(weights: list[float], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One process, whole data set: the predictions and targets DDP evaluation must reproduce."""
    mod = _script_module()
    data = mod.Points(n)
    x = torch.stack([data[i][0] for i in range(n)])
    y = torch.stack([data[i][1] for i in range(n)])
    w = torch.tensor(weights)
    return torch.sigmoid(x @ w[:-1] + w[-1]), y


def check_gathered(out: dict[str, Any], indices: list[int], weights: list[float], n: int) -> None:
    mod = _script_module()
    assert out["index"] == indices
    preds, target = reference(weights, n)
    torch.testing.assert_close(torch.tensor(out["preds"]), preds[indices], rtol=1e-5, atol=1e-6)
    assert out["target"] == target[indices].tolist()
    assert out["names"] == [f"s{i}" for i in indices]
    assert out["tokens"] == [mod.tokens(i).tolist() for i in indices]


def _auroc(preds: list[float], target: list[int]) -> float:
    """The area under the ROC curve from its definition: the chance that a positive sample scores above a negative
    one, a tie counting one half (Mann-Whitney U over the pairs), in Python floats; no metric library."""
    pos = [p for p, t in zip(preds, target) if t == 1]
    neg = [p for p, t in zip(preds, target) if t == 0]
    wins = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


def exact_metrics(weights: list[float], n: int, indices: list[int] | None = None) -> tuple[float, float]:
    """Accuracy at 0.5 and AUROC of the one-process predictions (of ``indices`` only, where given)."""
    preds, target = reference(weights, n)
    if indices is not None:
        preds, target = preds[indices], target[indices]
    p, t = preds.double().tolist(), [int(v) for v in target.tolist()]
    accuracy = sum((q > 0.5) == (y == 1) for q, y in zip(p, t)) / len(t)
    return float(accuracy), _auroc(p, t) if 0 < sum(t) < len(t) else float("nan")


@pytest.mark.slow
def test_fit_validate_test_predict_exact_on_two_ranks(tmp_path: Path) -> None:
    start = time.monotonic()
    launch(tmp_path)
    print(f"launch took {time.monotonic() - start:.1f} s")
    r0, r1 = reports(tmp_path, "all", 2)
    for rep in (r0, r1):
        fit, val, test, pred = rep["fit"], rep["validate"], rep["test"], rep["predict"]
        # fit: Lightning's injected DistributedSampler, 1001 and 7 samples, batch 4
        check_gathered(fit["gathered"]["0"], list(range(1001)), fit["weights"], 1001)
        check_gathered(fit["gathered"]["1"], list(range(7)), fit["weights"], 7)
        for dl, n in (("0", 1001), ("1", 7)):
            acc, auroc = exact_metrics(fit["weights"], n)
            logged = fit["callback_metrics"]
            assert logged[f"val_acc/dataloader_idx_{dl}"] == pytest.approx(acc, abs=1e-6)
            assert logged[f"val_auroc/dataloader_idx_{dl}"] == pytest.approx(auroc, abs=1e-5)
            # ordinary code too: under ddp_sync (exact_eval) the sync_dist batch mean is the data set's accuracy
            assert logged[f"val_acc_sync_dist/dataloader_idx_{dl}"] == pytest.approx(acc, abs=1e-6)
            assert logged[f"val_acc_sync_dist/dataloader_idx_{dl}"] == pytest.approx(
                logged[f"val_acc/dataloader_idx_{dl}"], abs=1e-6)  # what the job logs == ValidationGather's
        assert fit["best_score"] == pytest.approx(fit["callback_metrics"]["val_acc/dataloader_idx_0"])
        # validate: the user's DistributedSampler, shuffled, 2 workers; and drop_last=True
        check_gathered(val["gathered"]["0"], list(range(1001)), val["weights"], 1001)
        kept = sorted(i for r in range(2) for i in DistributedSampler(range(7), 2, r, shuffle=False, drop_last=True))
        assert kept == [0, 1, 2, 3, 4, 5]  # what the samplers yield: the set ValidationGather returns
        check_gathered(val["gathered"]["1"], kept, val["weights"], 7)
        acc, auroc = exact_metrics(val["weights"], 7, kept)
        assert val["callback_metrics"]["val_acc/dataloader_idx_1"] == pytest.approx(acc, abs=1e-6)
        # test: 3 samples < world x batch; a rank with zero samples
        check_gathered(test["gathered"]["0"], [0, 1, 2], val["weights"], 3)
        check_gathered(test["gathered"]["1"], list(range(5)), val["weights"], 5)
        assert test["callback_metrics"]["test_acc/dataloader_idx_1"] == pytest.approx(
            exact_metrics(val["weights"], 5)[0], abs=1e-6)
        # predict: custom sampler (DistributedSamplerWrapper) and a custom batch sampler
        check_gathered(pred["gathered"]["0"], list(range(1001)), val["weights"], 1001)
        check_gathered(pred["gathered"]["1"], list(range(11)), val["weights"], 11)
        acc, auroc = exact_metrics(val["weights"], 1001)
        assert pred["metrics"]["predict_acc/dataloader_idx_0"] == pytest.approx(acc, abs=1e-6)
        assert pred["metrics"]["predict_auroc/dataloader_idx_0"] == pytest.approx(auroc, abs=1e-5)
    # rank_zero_only: rank 0 holds the rows, rank 1 nothing
    assert r0["validate"]["rank0"]["0"]["index"] == list(range(1001))
    assert set(r0["validate"]["rank0"]["0"]) == {"index", "preds", "names"}
    assert r1["validate"]["rank0"] == {}
    assert r0["fit"]["callback_metrics"] == r1["fit"]["callback_metrics"]
    assert ("predict", 1, 11) in map(tuple, r1["hook_calls"]) and ("test", 1, 5) in map(tuple, r1["hook_calls"])


@pytest.mark.slow
def test_lightning_ddp_on_three_ranks(tmp_path: Path) -> None:
    launch(tmp_path, "--strategy", "ddp", "--devices", "3", "--phase", "small")
    for rep in reports(tmp_path, "small", 3):
        w = rep["validate"]["weights"]
        check_gathered(rep["validate"]["gathered"]["0"], list(range(1001)), w, 1001)
        kept = sorted(i for r in range(3) for i in DistributedSampler(range(7), 3, r, shuffle=False, drop_last=True))
        check_gathered(rep["validate"]["gathered"]["1"], kept, w, 7)
        check_gathered(rep["test"]["gathered"]["0"], [0, 1, 2], w, 3)
        check_gathered(rep["test"]["gathered"]["1"], list(range(5)), w, 5)
        acc, auroc = exact_metrics(w, 1001)
        assert rep["validate"]["callback_metrics"]["val_auroc/dataloader_idx_0"] == pytest.approx(auroc, abs=1e-5)
        assert rep["validate"]["metric_samples"]["val_auroc/dataloader_idx_0"] == 1001
        assert rep["validate"]["metric_samples"]["val_acc/dataloader_idx_1"] == len(kept)


@pytest.mark.slow
def test_mismatched_outputs_raise_on_every_rank(tmp_path: Path) -> None:
    start = time.monotonic()
    launch(tmp_path, "--phase", "mismatch", timeout=120)
    assert time.monotonic() - start < 100
    for rep in reports(tmp_path, "mismatch", 2):
        assert rep["error"] is not None and "rank 0 {preds: () float32" in rep["error"] and "extra: () float32" in rep["error"]
        assert rep["seconds"] < 60  # the whole validate run, start-up included: 30.3 s seen at load 15 on 2 cores


@pytest.mark.slow
def test_bad_step_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    """A bad first batch on rank 1 was dropped with its rows (rank 0's half logged as the metric);
    a step returning a float gathered nothing. Now: the same error on every rank, no metric."""
    start = time.monotonic()
    launch(tmp_path, "--phase", "badrank", timeout=240)
    print(f"launch took {time.monotonic() - start:.1f} s")
    expected = {
        "rows_first_batch": "rank 1: dataloader 0, batch 0: key 'preds' has shape (4,) but the batch has 5 samples",
        "rows_second_batch": "rank 1: dataloader 0, batch 1: key 'preds' has shape (4,) but the batch has 5 samples",
        "float_first_batch": "rank 1: dataloader 0, batch 0: the step returned the scalar float 0.5, not one row per "
                             "sample",
        "float_every_rank": "bad outputs on 2 of 2 ranks: rank 0: dataloader 0, batch 0: the step returned the scalar "
                            "float",
        "scalar_tensor": "rank 1: dataloader 0, batch 0: the step returned the scalar Tensor",
    }
    for rank, rep in enumerate(reports(tmp_path, "badrank", 2)):
        for case, words in expected.items():
            error = rep[case]["error"]
            if error is None or not error.startswith("ValueError: ValidationGather (validate, dataloader 0): "):
                pytest.fail(f"rank {rank}, {case}: {rep[case]}")  # the whole error (an assert's is cut short)
            assert words in error, (rank, case, error)
            assert rep[case]["seconds"] < 60, (rank, case, rep[case])


def _metric_fails_on_rank_1(rank: int, world: int) -> str:
    import torch.distributed as dist

    def metric(out: dict[str, Any]) -> float:
        if dist.get_rank() == 1:
            raise ZeroDivisionError("no positive sample on this rank's device")
        return 0.5

    gather = ls.ValidationGather(metrics={"auc": metric})
    out = {"index": torch.arange(4), "preds": torch.zeros(4)}
    try:
        gather._compute_metrics(out, "validate", 0, 1)
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_a_metric_failing_on_one_rank_other_than_0_fails_every_rank() -> None:
    """Every rank computes the metric on the gathered rows; rank 1's failure used to be dropped."""
    for text in run_ranks(_metric_fails_on_rank_1, 2, timeout=60):
        assert text == ("ValidationGather: a metric failed (validate, dataloader 0) on rank 1: "
                        "ZeroDivisionError: no positive sample on this rank's device"), text
