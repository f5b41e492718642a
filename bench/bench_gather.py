"""Epoch-end gather of 1e6 validation rows (16 float32 + int64 label) on 2 gloo ranks, four ways.

    .venv/bin/python bench/bench_gather.py [--rows 1000000] [--repeats 5] [--batch 1024] [--world 2]
        [--sharding exact|padded]

Each rank holds what its evaluation sampler gives it, collected batch by batch: ``exact`` (default)
ddp_sync's contiguous shards (the gathered rows arrive in index order: nothing to drop or re-order);
``padded`` Lightning ddp's interleaved DistributedSampler (odd ``--rows``: one padding duplicate;
the rows must be re-ordered). Timed per method (median of ``--repeats``; the time is the
slowest rank's, i.e. until the collective is complete everywhere), every method starting from the
per-batch outputs, relative to a bare ``all_gather_uneven`` of the same rows (concatenate the
batches, gather features and labels; the gather alone is shown on the next line):

* ``ValidationGather``: ``RowCollector.gather()`` from the per-batch chunks: concatenate, pack index
  + features + label into one byte row, one gather, dedup by index, index order. Exact set.
* ``accelerate-style``: pad to the longest rank, all_gather each tensor, drop the padding by
  position (gather_for_metrics' rule). Wrong set under interleaved sharding, shown for cost only.
* ``torchmetrics CatMetric``: one CatMetric per tensor, updated per batch, ``compute()`` syncs.
  Casts the int64 labels to float32.

Peak memory: a thread samples this process's RSS every millisecond during each call on rank 0;
reported as the growth over the RSS before the call and, for ValidationGather, the peak over the
RSS before any data existed, both relative to the gathered result's bytes (rows x (64 + 8 + 8)).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_sync import collectives as C  # noqa: E402
from lightning_sync.gathering import RowCollector  # noqa: E402
from bench._memory import PeakRSS, rss  # noqa: E402

FEATURES = 16
SHARDING = os.environ.get("BENCH_SHARDING", "exact")


def shard(rank: int, world: int, n: int) -> list[int]:
    if SHARDING == "exact":  # ddp_sync's evaluation shards: contiguous blocks, no padding
        from lightning_sync.sampling import plan_steps

        plan = plan_steps(n, world, 1)
        return list(range(plan.start(rank), plan.start(rank) + plan.counts[rank]))
    total = -(-n // world) * world  # Lightning's DistributedSampler: interleaved, pad by wrapping around
    return [i % n for i in range(rank, total, world)]


def batches(rank: int, world: int, n: int, batch: int) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    idx = shard(rank, world, n)
    g = torch.Generator().manual_seed(rank)
    return [(idx[s:s + batch], torch.randn(len(idx[s:s + batch]), FEATURES, generator=g),
             torch.randint(0, 10, (len(idx[s:s + batch]),), generator=g)) for s in range(0, len(idx), batch)]


def timed(fn: Callable[[], Any], mem: bool) -> tuple[float, int, Any]:
    dist.barrier()
    with PeakRSS(interval=0.001) as peak:
        t0 = time.perf_counter()
        result = fn()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), (peak.peak - peak.base) if mem else 0, result


def worker(rank: int, world: int, init: str, out: str, n: int, batch: int, repeats: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    base_rss = rss()
    data = batches(rank, world, n, batch)
    result_bytes = n * (FEATURES * 4 + 8 + 8)

    def collector() -> RowCollector:
        c = RowCollector()
        for idx, x, y in data:
            c.add(idx, {"x": x, "y": y})
        return c

    # ValidationGather's memory first, in a fresh process, before any other copy of the data exists
    c = collector()
    before = rss()
    with PeakRSS(interval=0.001) as first:
        res = c.gather()
    del res, c
    x_all = torch.cat([x for _, x, _ in data])
    y_all = torch.cat([y for _, _, y in data])

    def bare_gather_only() -> Any:
        return C.all_gather_uneven(x_all)[0], C.all_gather_uneven(y_all)[0]

    def bare() -> Any:
        # like for like: from the per-batch outputs, as ValidationGather starts
        x = torch.cat([x for _, x, _ in data])
        y = torch.cat([y for _, _, y in data])
        return C.all_gather_uneven(x)[0], C.all_gather_uneven(y)[0]

    def accelerate_style() -> Any:
        count = torch.tensor([sum(len(i) for i, _, _ in data)])
        counts = [torch.zeros_like(count) for _ in range(world)]
        dist.all_gather(counts, count)
        most = int(max(counts))
        out = []
        for chunks in ([x for _, x, _ in data], [y for _, _, y in data]):
            padded = chunks[0].new_zeros((most, *chunks[0].shape[1:]))
            torch.cat(chunks, out=padded[: int(count)])
            buf = padded.new_empty((world * most, *padded.shape[1:]))
            dist.all_gather_into_tensor(buf, padded)
            # gather_for_metrics keeps the first len(dataset) rows: drops duplicates by position
            out.append(buf[:n])
        return out

    def catmetric() -> Any:
        from torchmetrics.aggregation import CatMetric

        mx, my = CatMetric(), CatMetric()
        for _, x, y in data:
            mx.update(x)
            my.update(y)
        return mx, my

    def vg() -> Any:
        c = collector()
        return timed(c.gather, mem=rank == 0)

    methods: dict[str, Callable[[], tuple[float, int, Any]]] = {
        "ValidationGather": vg,
        "bare all_gather_uneven": lambda: timed(bare, mem=rank == 0),
        "  (gather only, no cat)": lambda: timed(bare_gather_only, mem=rank == 0),
        "accelerate-style": lambda: timed(accelerate_style, mem=rank == 0),
        "torchmetrics CatMetric": lambda: cat_timed(),
    }

    def cat_timed() -> tuple[float, int, Any]:
        mx, my = catmetric()
        return timed(lambda: (mx.compute(), my.compute()), mem=rank == 0)

    times: dict[str, list[float]] = {}
    mem: dict[str, int] = {}
    # round-robin, so a load spike on the shared machine hits every method alike
    for _ in range(repeats):
        for name, run in methods.items():
            t, grow, res = run()
            times.setdefault(name, []).append(t)
            mem.setdefault(name, grow)
            del res
    collect_t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        collector()
        collect_t.append(time.perf_counter() - t0)
    if rank == 0:
        report = {
            "rows": n, "world": world, "batch": batch, "result_bytes": result_bytes,
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "peak_growth_bytes": mem,
            "vg_peak_over_baseline_bytes": first.peak - base_rss,
            "vg_local_rows_bytes": before - base_rss,
            "collect_s_per_epoch": statistics.median(collect_t),
        }
        Path(out).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--sharding", choices=["exact", "padded"], default="exact",
                   help="exact: ddp_sync's contiguous shards (default); padded: Lightning ddp's interleaved sampler")
    args = p.parse_args()
    os.environ["BENCH_SHARDING"] = args.sharding  # read by the spawned ranks
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        mp.spawn(worker, args=(args.world, os.path.join(tmp, "init"), out, args.rows, args.batch, args.repeats),
                 nprocs=args.world, join=True)
        report = json.loads(Path(out).read_text())
    base = report["median_s"]["bare all_gather_uneven"]
    mb = report["result_bytes"] / 2**20
    print(f"{report['rows']} rows x (16 float32 + int64 label) on {report['world']} gloo ranks, batch {report['batch']}, "
          f"{args.sharding} shards; "
          f"gathered result {mb:.0f} MiB (incl. int64 index)")
    print(f"{'method':<26}{'median s':>10}{'vs bare':>9}{'rank-0 RSS growth / result':>29}")
    for name, t in report["median_s"].items():
        grow = report["peak_growth_bytes"].get(name, 0) / report["result_bytes"]
        print(f"{name:<26}{t:>10.3f}{t / base:>8.2f}x{grow:>28.2f}x")
    print(f"ValidationGather peak RSS over the data-free baseline: {report['vg_peak_over_baseline_bytes'] / 2**20:.0f} MiB "
          f"= {report['vg_peak_over_baseline_bytes'] / report['result_bytes']:.2f}x the result "
          f"(of which this rank's own collected rows: {report['vg_local_rows_bytes'] / 2**20:.0f} MiB)")
    print(f"per-batch collection (RowCollector.add, whole epoch, not in the times above): "
          f"{report['collect_s_per_epoch']:.3f} s")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
