"""Uneven training data: ``uneven_batches="join"`` trains on every sample once, and nobody hangs.

Fast tier: the per-batch agreement of ``lightning_sync.joining`` and the stand-in SyncBatchNorm on real
gloo ranks (no Trainer). Slow tier: launches of tests/scripts/fit_uneven.py (Lightning's launcher,
2 and 3 ranks) whose final weights and epoch metrics are compared with the same run computed in one
process, the error and stop modes, a collective of the user's own, and Lightning's ``ddp`` on the same
data (it hangs: the test's timeout kills it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sync.joining import StepShare
from tests.distributed import run_ranks
from tests.launch import launch_script, load_script

SCRIPT = Path(__file__).parent / "scripts" / "fit_uneven.py"


# ---------------------------------------------------------------- the agreement, no Trainer


def test_step_share_scales_each_rank_to_the_mean_over_the_steps_samples() -> None:
    even = StepShare(rank=0, step=3, sizes=(32, 32), done_after=(None, None))
    assert (even.loss_scale, even.joined, even.shadow, even.live) == (1.0, False, False, 2)
    partial = StepShare(rank=1, step=15, sizes=(21, 20), done_after=(None, None))
    assert partial.loss_scale == pytest.approx(2 * 20 / 41)
    joined = StepShare(rank=0, step=13, sizes=(32, 0, 8), done_after=(None, 13, None))
    assert joined.loss_scale == pytest.approx(3 * 32 / 40) and joined.joined and not joined.shadow
    stand_in = StepShare(rank=1, step=13, sizes=(32, 0, 8), done_after=(None, 13, None))
    assert stand_in.shadow and stand_in.loss_scale == 0.0 and stand_in.live == 2
    assert stand_in.describe() == "rank 1 ran out after 13 batches"
    assert (even.applies, partial.applies, joined.applies, stand_in.applies) == (False, True, True, True)


def _agree(record: list[int]) -> list[list[int]]:
    import torch.distributed as dist

    mine = torch.tensor(record, dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    _agree.calls = getattr(_agree, "calls", 0) + 1  # type: ignore[attr-defined]
    return [t.tolist() for t in every]


def _walk(rank: int, world: int, mode: str, lengths: list[int], sampler: bool) -> dict[str, Any]:
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_sync.joining import AgreeingLoader, wrap_training_loader

    _agree.calls = 0  # type: ignore[attr-defined]
    if sampler:
        data = list(range(40))
        loader: Any = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, world, rank, shuffle=False))
    else:
        loader = DataLoader([rank * 100 + i for i in range(lengths[rank])], batch_size=4)
    wrapped = wrap_training_loader(loader, mode, _agree, rank, len)
    out: dict[str, Any] = {"wrapped": isinstance(wrapped, AgreeingLoader), "len": len(wrapped)}
    before = _agree.calls  # type: ignore[attr-defined]
    try:
        out["batches"] = [b.tolist() for b in wrapped]
    except Exception as err:  # noqa: BLE001 - the test compares what every rank raised
        out["error"] = f"{type(err).__name__}: {err}"
    out["exchanges"] = _agree.calls - before  # type: ignore[attr-defined]
    out["shares"] = [None if s is None else (s.shadow, s.sizes, s.done_after) for s in wrapped.shares] \
        if isinstance(wrapped, AgreeingLoader) else None
    return out


def test_join_repeats_the_last_batch_of_a_rank_that_ran_out_with_a_zero_share() -> None:
    r0, r1 = run_ranks(_walk, 2, args=("join", [10, 5], False), timeout=60)
    assert r0["len"] == r1["len"] == 3  # the longest rank's batch count, on every rank
    assert r0["batches"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert r1["batches"] == [[100, 101, 102, 103], [104], [104]]  # the stand-in: its last batch again
    assert r1["shares"] == [None, (False, (4, 1), (None, None)), (True, (2, 0), (None, 2))]
    assert r0["shares"][2] == (False, (2, 0), (None, 2))


def test_outside_join_a_loader_with_a_length_is_left_to_the_epoch_start_check() -> None:
    for r in run_ranks(_walk, 2, args=("error", [10, 5], False), timeout=60):
        assert not r["wrapped"] and r["len"] in (3, 2)


def _walk_stream(rank: int, world: int, mode: str) -> dict[str, Any]:
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_sync.joining import wrap_training_loader

    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(range(rank * 100, rank * 100 + (10 if rank == 0 else 5)))

    wrapped = wrap_training_loader(DataLoader(Stream(), batch_size=4), mode, _agree, rank, len)
    try:
        return {"batches": [b.tolist() for b in wrapped]}
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {err}"}


def test_a_stream_that_runs_out_first_is_an_error_or_a_common_stop() -> None:
    errors = run_ranks(_walk_stream, 2, args=("error",), timeout=60)
    assert all("UnevenTrainingError" in r["error"] and "rank 1 ran out after 2 batches" in r["error"]
               for r in errors)
    r0, r1 = run_ranks(_walk_stream, 2, args=("stop_together",), timeout=60)
    assert r0["batches"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and r1["batches"] == [[100, 101, 102, 103], [104]]


def test_an_even_distributed_sampler_needs_no_exchange_per_batch() -> None:
    for r in run_ranks(_walk, 2, args=("join", [0, 0], True), timeout=60):
        assert r["wrapped"] and len(r["batches"]) == 5 and r["exchanges"] == 1  # one at the epoch's start
        assert r["shares"] == [None] * 5


def _stand_in_batchnorm(rank: int, world: int) -> dict[str, Any]:
    from lightning_sync.batchnorm import SyncBatchNorm, joined_step

    torch.manual_seed(0)
    data = torch.randn(7, 3) * 3 + 2
    bn = SyncBatchNorm(3)
    x = (data.clone() if rank == 0 else torch.randn(5, 3)).requires_grad_()
    with joined_step(stand_in=rank == 1):
        y = bn(x)
    (y * torch.arange(3.0)).sum().mul(0.0 if rank == 1 else 1.0).backward()
    assert x.grad is not None
    return {"y": y.detach(), "grad": x.grad, "mean": bn.running_mean.clone(), "var": bn.running_var.clone(),
            "data": data}


def test_a_stand_in_contributes_nothing_to_syncbatchnorm() -> None:
    r0, r1 = run_ranks(_stand_in_batchnorm, 2, timeout=60)
    ref = torch.nn.BatchNorm1d(3)
    x = r0["data"].clone().requires_grad_()
    y = ref(x)
    (y * torch.arange(3.0)).sum().backward()
    torch.testing.assert_close(r0["y"], y.detach())
    torch.testing.assert_close(r0["grad"], x.grad)
    for r in (r0, r1):  # the running statistics of rank 0's samples alone, on both ranks
        torch.testing.assert_close(r["mean"], ref.running_mean)
        torch.testing.assert_close(r["var"], ref.running_var)
    assert torch.equal(r1["grad"], torch.zeros_like(r1["grad"])) and torch.isfinite(r1["y"]).all()


# ---------------------------------------------------------------- Trainer runs (Lightning's launcher)


def fit(out: Path, *args: str, timeout: int = 240, check: bool = True) -> tuple[int, list[dict[str, Any]]]:
    world = int(args[args.index("--devices") + 1]) if "--devices" in args else 2
    env_keep = dict(os.environ)
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    try:
        proc = launch_script(SCRIPT, out, *args, timeout=timeout, check=check)
    finally:
        os.environ.clear()
        os.environ.update(env_keep)
    reports = [json.loads((out / f"fit.rank{r}.json").read_text()) for r in range(world)
               if (out / f"fit.rank{r}.json").exists()]
    return proc.returncode, reports


def check_against_one_process(reports: list[dict[str, Any]], split: str, workers: int = 0, syncbn: bool = False,
                              accumulate: int = 1, epochs: int = 1) -> None:
    script = load_script(SCRIPT)
    world = len(reports)
    weights, metrics = script.reference_run(split, world, workers, syncbn, accumulate, epochs)
    steps = max(len(script.expected_batches(split, world, r, workers)) for r in range(world))
    for rank, rep in enumerate(reports):
        assert "error" not in rep, rep["error"]
        # every batch of the rank's shard trained on once an epoch, in order; the stand-in steps record nothing
        assert [s for s in rep["steps"][:steps] if s] == script.expected_batches(split, world, rank, workers)
        assert [s for s in rep["steps"][-steps:] if s] == script.expected_batches(split, world, rank, workers)
        assert len(rep["steps"]) == steps * epochs and rep["global_step"] == -(-steps // accumulate) * epochs
        assert rep["metrics"]["samples"] == script.N  # self.log(len(batch), reduce_fx="sum") over the epoch
        assert rep["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
        assert rep["metrics"]["acc"] == pytest.approx(metrics["acc"], abs=1e-6)
        for name, value in weights.items():  # the replicas are identical and equal the one-process run
            got = torch.tensor(rep["weights"][name], dtype=value.dtype)
            assert torch.equal(got, torch.tensor(reports[0]["weights"][name], dtype=value.dtype)), name
            torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_join_trains_every_sample_of_a_60_40_stream_once(tmp_path: Path) -> None:
    # ModelCheckpoint's top-k decision (a reduction every rank makes at batch end) during stand-in steps too
    _, reports = fit(tmp_path, "--checkpoint")
    check_against_one_process(reports, "60/40")
    assert sum(1 for s in reports[1]["steps"] if not s) == 6  # rank 1's 13 batches, then 6 stand-ins
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_join_with_syncbatchnorm_and_workers(tmp_path: Path) -> None:
    _, reports = fit(tmp_path, "--syncbn", "--workers", "2")
    check_against_one_process(reports, "60/40", workers=2, syncbn=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_join_with_a_users_uneven_sampler_round_robin_and_accumulation(tmp_path: Path) -> None:
    # 501 / 500 samples: the last batches differ in size (21 / 20), the step's gradient is over all 41
    _, reports = fit(tmp_path, "--source", "sampler", "--split", "rr", "--accumulate", "2")
    check_against_one_process(reports, "rr", accumulate=2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_join_on_three_ranks_with_syncbatchnorm_and_workers(tmp_path: Path) -> None:
    _, reports = fit(tmp_path, "--devices", "3", "--split", "50/30/20", "--syncbn", "--workers", "2")
    check_against_one_process(reports, "50/30/20", workers=2, syncbn=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_join_with_an_empty_shard_syncbatchnorm_and_two_epochs(tmp_path: Path) -> None:
    # rank 1 has no sample at all: it borrows rank 0's first batch as its stand-in, every epoch
    _, reports = fit(tmp_path, "--split", "100/0", "--syncbn", "--epochs", "2")
    check_against_one_process(reports, "100/0", syncbn=True, epochs=2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_join_on_a_hugging_face_stream_split_by_node(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    _, reports = fit(tmp_path, "--source", "hf")
    check_against_one_process(reports, "60/40")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_users_own_collective_during_a_stand_in_step_is_named_on_every_rank(tmp_path: Path) -> None:
    code, reports = fit(tmp_path, "--own-collective", check=False)
    assert code != 0 and len(reports) == 2
    for rep in reports:
        assert rep["error"].startswith("UnevenTrainingError: torch.distributed.all_reduce at fit_uneven.py:")
        assert "at training batch 13 of this epoch, while rank 1 ran out after 13 batches" in rep["error"]
        assert "on_train_epoch_end" in rep["error"]  # the fix


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_error_mode_names_the_rank_that_ran_out_and_stop_together_drops_the_rest(tmp_path: Path) -> None:
    code, reports = fit(tmp_path / "error", "--mode", "error", check=False)
    assert code != 0 and len(reports) == 2
    assert all("rank 1 ran out after 13 batches" in rep["error"] and "uneven_batches='join'" in rep["error"]
               for rep in reports)
    _, reports = fit(tmp_path / "stop", "--mode", "stop_together")
    assert [rep["global_step"] for rep in reports] == [13, 13]
    assert reports[0]["metrics"]["samples"] == 13 * 32 + 400  # rank 0's first 13 batches, rank 1's 400 samples


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_lightning_ddp_hangs_on_the_same_stream(tmp_path: Path) -> None:
    # The control: the rank with more data waits in DDP's gradient all-reduce for the one that finished.
    code, reports = fit(tmp_path, "--strategy", "ddp", timeout=35, check=False)
    assert code in (124, 137, -9) and reports == []  # killed by the timeout, no rank finished


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_checkpoint_taken_after_a_rank_ran_out_resumes_at_the_exact_batch(tmp_path: Path) -> None:
    # A StatefulDataLoader over the user's per-rank sampler: rank 1 runs out after 13 batches; the checkpoint
    # at step 15 holds both ranks' loader positions, rank 1's as "ran out" (a plain StatefulDataLoader would
    # start a new pass over its data on load).
    code, crashed = fit(tmp_path, "--source", "stateful", "--syncbn", "--save-at", "15", check=False)
    assert code != 0 and all("stopped at step 15" in rep["error"] for rep in crashed)
    _, resumed = fit(tmp_path, "--source", "stateful", "--syncbn", "--resume", str(tmp_path / "mid.ckpt"))
    script = load_script(SCRIPT)
    weights, _ = script.reference_run("60/40", 2, 0, True)
    for rank, rep in enumerate(resumed):
        assert "error" not in rep, rep["error"]
        assert [s for s in rep["steps"] if s] == script.expected_batches("60/40", 2, rank, 0)[15:]
        assert len(rep["steps"]) == 4 and rep["global_step"] == 19
        for name, value in weights.items():  # equal to the uninterrupted run
            torch.testing.assert_close(torch.tensor(rep["weights"][name], dtype=value.dtype), value,
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_validation_within_the_epoch_runs_on_every_rank_together(tmp_path: Path) -> None:
    _, reports = fit(tmp_path, "--val-every", "5")
    assert [rep["validated"] for rep in reports] == [[5, 10, 15]] * 2  # rank 1 in stand-in steps from step 13
    assert reports[0]["metrics"]["samples"] == 1001 and "val_loss" in reports[0]["metrics"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_per_step_sync_dist_on_uneven_evaluation_streams_is_joined_and_epoch_values_stay_exact(tmp_path: Path) -> None:
    # trainer.validate over a 60/40 stream (2 workers) with a per-step self.log(sync_dist=True): rank 1 meets
    # rank 0's last 6 per-step reductions with stand-ins; the epoch values are one process's over all samples.
    _, reports = fit(tmp_path, "--validate-stream", "--workers", "2")
    script = load_script(SCRIPT)
    net = script.build_net(False).eval()
    xs, ys = zip(*(script.sample(i) for i in range(script.N)))
    with torch.no_grad():
        logits = net(torch.stack(xs))
    target = torch.tensor(ys)
    for rep in reports:
        assert "error" not in rep, rep["error"]
        assert rep["metrics"]["val_n"] == script.N
        assert rep["metrics"]["val_loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, target)),
                                                           rel=1e-5)
        assert rep["metrics"]["val_acc"] == pytest.approx(float((logits.argmax(1) == target).float().mean()),
                                                          abs=1e-6)
