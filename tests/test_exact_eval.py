"""Exact evaluation under ddp_sync: ordinary self.log / torchmetrics code equals one process on the whole set.

Unit tests of the sharding plan (no processes), then two launches of tests/scripts/exact_eval.py (2 ranks:
every configuration; 3 ranks: a few) whose ranks loop over many loaders and stages in one run each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler

from lightning_sync.sampling import ExactEvalBatchSampler, global_order, is_integer_mean, plan_steps
from tests.launch import launch_script, load_script, read_reports

SCRIPT = Path(__file__).parent / "scripts" / "exact_eval.py"


def _script() -> Any:
    return load_script(SCRIPT)


# ---------------------------------------------------------------- the plan, no processes


def test_plan_covers_every_index_once_in_equal_steps_where_possible() -> None:
    for world in (1, 2, 3, 4):
        for batch in (1, 2, 3, 4, 32):
            for n in range(0, 70):
                plan = plan_steps(n, world, batch)
                assert sum(plan.counts) == n and max(plan.counts) - min(plan.counts) <= 1
                assert all(sum(b) == c for b, c in zip(plan.batches, plan.counts))
                assert all(1 <= size <= batch for b in plan.batches for size in b)
                if n >= world and (batch > 1 or n % world == 0):
                    assert plan.even, (n, world, batch, plan)
    plan = plan_steps(9, 2, 4)  # ceil(9 / 8) = 2 steps: 5 = 4 + 1, 4 = 3 + 1
    assert plan.batches == ((4, 1), (3, 1))
    assert not plan_steps(9, 2, 1).even and plan_steps(9, 2, 1).steps == (5, 4)


def test_batch_sampler_shards_the_samplers_order() -> None:
    data = list(range(23))
    for shuffle in (False, True):
        ds = DistributedSampler(data, num_replicas=3, rank=0, shuffle=shuffle, seed=5)
        ds.set_epoch(2)
        order = global_order(ds)
        expected = torch.randperm(23, generator=torch.Generator().manual_seed(7)).tolist() if shuffle else data
        assert order.tolist() == expected
        seen = []
        for rank in range(3):
            bs = ExactEvalBatchSampler(DistributedSampler(data, 3, rank, shuffle=shuffle, seed=5), 4, rank, 3)
            bs.sampler.set_epoch(2)
            batches = list(bs)
            assert len(batches) == len(bs) == 2  # ceil(23 / 12)
            seen += [i for b in batches for i in b]
        assert seen == expected  # contiguous blocks in rank order: already ordered when not shuffled


def test_wrapped_sampler_order_agrees_across_rng_states() -> None:
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    orders = []
    for noise in (1, 2):  # the ranks' own RNG streams differ under ddp_sync
        torch.manual_seed(noise)
        wrapper = DistributedSamplerWrapper(RandomSampler(range(17), num_samples=10), num_replicas=2, rank=0,
                                            shuffle=False, seed=3)
        orders.append(global_order(wrapper).tolist())
    assert orders[0] == orders[1] and len(orders[0]) == 10


def test_integer_mean_detection() -> None:
    assert is_integer_mean(torch.tensor(3), "mean") and is_integer_mean(torch.tensor(3), "avg")
    assert not is_integer_mean(torch.tensor(3.0), "mean") and not is_integer_mean(torch.tensor(3), "sum")


# ---------------------------------------------------------------- real ranks


def launch(out: Path, world: int, *args: str, timeout: int = 420) -> list[dict[str, Any]]:
    launch_script(SCRIPT, out, "--devices", str(world), *args, timeout=timeout)
    return read_reports(out, "report", world)


def one_process(n: int) -> dict[str, float]:
    """The reference: the same model on the whole set in one process, no Lightning."""
    mod = _script()
    torch.manual_seed(0)
    net = torch.nn.Linear(mod.DIM, mod.CLASSES)
    xs, ys = zip(*(mod.sample(i) for i in range(n)))
    with torch.no_grad():
        logits = net(torch.stack(xs))
    y = torch.tensor(ys)
    return {"loss": float(torch.nn.functional.cross_entropy(logits.double(), y)),
            "acc": float((logits.argmax(-1) == y).double().mean()), "count": float(n),
            "max_index": float(n - 1), "min_index": 0.0}


def check_metrics(metrics: dict[str, float], configs: list[list[Any]], suffix: bool = True) -> None:
    for dl, (n, batch, shuffle) in enumerate(configs):
        ref = one_process(n)
        for key, want in ref.items():
            got = metrics[f"{key}/dataloader_idx_{dl}" if suffix else key]
            tol = 1e-5 if key == "loss" else 1e-6
            assert got == pytest.approx(want, abs=tol), (key, n, batch, shuffle, got, want)


def check_once(reports: list[dict[str, Any]], phase: str, sizes: list[int]) -> None:
    """The indices each rank's steps saw: every index exactly once over the ranks."""
    for dl, n in enumerate(sizes):
        seen = sorted(i for rep in reports for i in rep[phase]["seen"].get(str(dl), []))
        assert seen == list(range(n)), (phase, dl, n, len(seen))


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_ordinary_evaluation_code_equals_one_process_on_two_ranks(tmp_path: Path) -> None:
    reports = launch(tmp_path, 2)
    rep = reports[0]
    configs = rep["configs"] + [[1001, 4, True], [82, 4, False]]  # + the user's DistributedSampler, a custom sampler
    for r in reports:
        check_metrics(r["validate"]["metrics"], configs)
        check_metrics(r["test"]["metrics"], rep["test_configs"])
        check_metrics(r["fit"]["metrics"], [[1001, 32, True], [9, 1, False]])
    check_once(reports, "validate", [c[0] for c in configs])
    check_once(reports, "test", [c[0] for c in rep["test_configs"]])
    check_once(reports, "fit", [1001, 9])  # the last validation of fit (val_check_interval, 2 epochs)
    check_once(reports, "predict", [1001, 9])
    check_steps_and_baselines(reports, 2)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_ordinary_evaluation_code_equals_one_process_on_three_ranks(tmp_path: Path) -> None:
    reports = launch(tmp_path, 3, "--quick")
    configs = reports[0]["configs"] + [[1001, 4, True], [82, 4, False]]
    for r in reports:
        check_metrics(r["validate"]["metrics"], configs)
    check_once(reports, "validate", [c[0] for c in configs])
    check_steps_and_baselines(reports, 3)


def check_steps_and_baselines(reports: list[dict[str, Any]], world: int) -> None:
    rep = reports[0]
    # equal step counts (batch > 1, or N % world == 0): per-step sync_dist completes, epoch values exact
    check_metrics(rep["step_sync"]["even"]["metrics"], rep["step_sync"]["even"]["configs"])
    for r in reports:  # batch 1, N % world != 0: the named error on every rank, no hang
        err = r["step_sync"]["uneven"]
        assert err.get("type") == "UnevenEvaluationError", err
        assert "different numbers of evaluation steps" in err["error"] and "exact_eval=False" in err["error"]
    for r in reports:
        assert r["too_small"] is not None and f"{world - 1} samples for {world} ranks" in r["too_small"]
    # the same loaders under Lightning's ddp and under exact_eval=False: padding counts samples twice
    for baseline in [b for b in ("ddp", "padded") if b in rep]:
        metrics = rep[baseline]["metrics"]
        for dl, (n, _, _) in enumerate(rep["test_configs"]):
            padded = -(-n // world) * world
            assert metrics[f"count/dataloader_idx_{dl}"] == padded
            if n == 1001:  # a repeated sample moves the values; ddp_sync's equal one process (checked above)
                ref = one_process(n)
                assert abs(metrics[f"loss/dataloader_idx_{dl}"] - ref["loss"]) > 1e-5
        seen = sorted(i for r in reports for i in r[baseline]["seen"]["0"])
        assert len(seen) == -(-1001 // world) * world > 1001
