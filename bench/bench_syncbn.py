"""Step time of a 2-BatchNorm MLP under torch DDP on 2 CPU ranks (gloo): portable SyncBatchNorm vs
local BatchNorm vs a naive hand-written all_reduce SyncBatchNorm, each with and without a process
group of its own for the BatchNorm collectives. All variants run side by side in one run, interleaved round by round, so machine noise hits them alike;
ratios are what to read.

    .venv/bin/python bench/bench_syncbn.py                     # defaults: batch 64/rank, hidden 512
    .venv/bin/python bench/bench_syncbn.py --hidden 1024 --rounds 9

Also prints: the latency of the two candidate forward collectives (one all_gather of per-rank
(count, mean, M2) vs one float64 all_reduce of sums) and the accuracy of each statistics scheme at
|mean| / std = 300.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx
from torch.nn.modules.batchnorm import _BatchNorm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lightning_sync.batchnorm import convert_sync_batchnorm, dedicated_group, share_running_stats  # noqa: E402

# torch 2.13 renamed all_gather_into_tensor (and deprecated the old name); same semantics.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# --------------------------------------------------------------------------------------------------
# the naive baseline: float32 sum / sum of squares, 2 blocking all_reduces per layer and step


class _NaiveFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, weight: Tensor, bias: Tensor, running_mean: Tensor,  # type: ignore[override]
                running_var: Tensor, eps: float, momentum: float, group: Any) -> Tensor:
        stats = torch.cat([x.sum(0), (x * x).sum(0), x.new_full((1,), x.shape[0])])
        dist.all_reduce(stats, group=group)
        c = x.shape[1]
        n = stats[-1]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
            running_var.mul_(1 - momentum).add_(var * n / (n - 1), alpha=momentum)
        invstd = (var + eps).rsqrt()
        xhat = (x - mean) * invstd
        ctx.save_for_backward(xhat, weight, invstd, n)
        ctx.group = group  # type: ignore[attr-defined]
        return xhat * weight + bias

    @staticmethod
    def backward(ctx: FunctionCtx, dy: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        xhat, weight, invstd, n = ctx.saved_tensors  # type: ignore[attr-defined]
        local = torch.cat([dy.sum(0), (dy * xhat).sum(0)])
        dw, db = local[dy.shape[1]:].clone(), local[:dy.shape[1]].clone()
        dist.all_reduce(local, group=ctx.group)  # type: ignore[attr-defined]
        s_dy, s_dyx = local.split(dy.shape[1])
        dx = weight * invstd * (dy - s_dy / n - xhat * s_dyx / n)
        return dx, dw, db, None, None, None, None, None


class NaiveSyncBN(_BatchNorm):
    """Synchronised BatchNorm1d as one would write it in an afternoon (float32 sums, running stats)."""

    def __init__(self, num_features: int, group: Any = None) -> None:
        super().__init__(num_features)
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return super().forward(x)
        return _NaiveFn.apply(x, self.weight, self.bias, self.running_mean, self.running_var,  # type: ignore[no-any-return]
                              self.eps, self.momentum, self.group)


# --------------------------------------------------------------------------------------------------


def _mlp(features: int, hidden: int, norm: Any) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, hidden), norm(hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         norm(hidden), nn.ReLU(), nn.Linear(hidden, 10))


def _variants(args: argparse.Namespace) -> dict[str, nn.Module]:
    own = dedicated_group()  # every rank creates it here, at the same point
    f, h = args.features, args.hidden

    def portable(group: Any, share: bool) -> nn.Module:
        model = convert_sync_batchnorm(_mlp(f, h, nn.BatchNorm1d), process_group=group)
        if share:  # running stats out of DDP's per-step buffer broadcast (what PortableSyncBatchNorm does)
            share_running_stats(model)
        return model

    return {
        "local BatchNorm1d": _mlp(f, h, nn.BatchNorm1d),
        "naive all_reduce SyncBN, default group": _mlp(f, h, NaiveSyncBN),
        "naive all_reduce SyncBN, own group": _mlp(f, h, lambda c: NaiveSyncBN(c, own)),
        "portable SyncBN, default group": portable(None, False),
        "portable SyncBN, own group": portable(own, False),
        "portable SyncBN, default group, no bcast": portable(None, True),
        "portable SyncBN, own group, no bcast": portable(own, True),
    }


def _time_steps(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    dist.barrier()
    return (time.perf_counter() - start) / steps


def _collective_latency(args: argparse.Namespace, rank: int, world: int) -> dict[str, list[float]]:
    """Forward-statistics collective alone: gloo's all_gather of (n, mean, M2) vs all_reduce of float64
    sums, interleaved block by block."""
    c = args.hidden
    record = torch.randn(2 * c + 1, dtype=torch.float64)
    gathered = torch.empty(world * record.numel(), dtype=torch.float64)
    out: dict[str, list[float]] = {"all_gather (n, mean, M2)": [], "all_reduce float64 sums": []}
    for _ in range(args.rounds):
        for name, times in out.items():
            dist.barrier()
            t = time.perf_counter()
            for _ in range(50):
                if name.startswith("all_gather"):
                    _all_gather_single(gathered, record)
                else:
                    dist.all_reduce(record)
            times.append((time.perf_counter() - t) / 50)
    return out


def _accuracy(rank: int, world: int) -> dict[str, float]:
    """Relative error of the global variance at |mean| / std = 300, against a float64 reference."""
    g = torch.Generator().manual_seed(rank)
    x = (torch.randn(64, 8, generator=g, dtype=torch.float64) + 300.0).float()
    full = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(full, x)
    ref = torch.cat(full).double().var(0, correction=0)
    n = torch.tensor([float(len(x))], dtype=torch.float64)
    # naive: float32 sum and sum of squares
    s = torch.cat([x.sum(0), (x * x).sum(0)])
    dist.all_reduce(s)
    nn_ = len(x) * world
    naive = (s[8:] / nn_ - (s[:8] / nn_) ** 2).double()
    # float64 sums of float32 data
    s64 = torch.cat([x.double().sum(0), x.double().square().sum(0)])
    dist.all_reduce(s64)
    sums64 = s64[8:] / nn_ - (s64[:8] / nn_) ** 2
    # Chan: per-rank (n, mean, M2) from var_mean in float32, combined in float64
    var, mean = torch.var_mean(x, 0, correction=0)
    rec = torch.cat([n, mean.double(), var.double() * len(x)])
    allrec = torch.empty(world * rec.numel(), dtype=torch.float64)
    _all_gather_single(allrec, rec)
    allrec = allrec.view(world, -1)
    cnt, means, m2 = allrec[:, :1], allrec[:, 1:9], allrec[:, 9:]
    gm = (cnt * means).sum(0) / cnt.sum()
    chan = (m2.sum(0) + (cnt * (means - gm) ** 2).sum(0)) / cnt.sum()
    rel = lambda v: float(((v - ref).abs() / ref).max())  # noqa: E731
    return {"naive float32 sum/sumsq": rel(naive), "float64 sum/sumsq": rel(sums64), "Chan (n, mean, M2)": rel(chan)}


def _rank(rank: int, world: int, init_file: str, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(args.batch, args.features, generator=g) * 3 + 1
        y = torch.randint(0, 10, (args.batch,), generator=g)
        runs = {}
        for name, model in _variants(args).items():
            ddp = nn.parallel.DistributedDataParallel(model)
            runs[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3))
        for ddp, opt in runs.values():  # warm-up
            _time_steps(ddp, opt, x, y, 5)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):  # interleaved, so noise hits every variant alike
            for name, (ddp, opt) in runs.items():
                times[name].append(_time_steps(ddp, opt, x, y, args.steps))
        result = {"step": times,
                  "collective": _collective_latency(args, rank, world), "accuracy": _accuracy(rank, world)}
        if rank == 0:
            queue.put(result)
        del runs
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved blocks per variant; the median counts")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    world = 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank, args=(r, world, init_file, args, queue), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        result = queue.get(timeout=args.timeout)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {world} ranks gloo CPU, 1 thread/rank, torch DDP; MLP {args.features}-{args.hidden}-"
          f"{args.hidden}-10 with 2 BatchNorm layers, batch {args.batch}/rank; {args.rounds} interleaved blocks of "
          f"{args.steps} steps per variant; {os.cpu_count()} cores, load average {load:.1f} at the end")
    print(f"  {'step time':<44} {'median':>8} {'min':>8}   ratio to local BN (median, min)")
    med = {k: statistics.median(v) for k, v in result["step"].items()}
    low = {k: min(v) for k, v in result["step"].items()}
    base = "local BatchNorm1d"
    for name in result["step"]:
        print(f"  {name:<44} {med[name] * 1e3:6.2f}ms {low[name] * 1e3:6.2f}ms   "
              f"{med[name] / med[base]:5.2f}x {low[name] / low[base]:5.2f}x")
    print("forward-statistics collective alone (C = hidden, float64), median / min:")
    for name, t in result["collective"].items():
        print(f"  {name:<44} {statistics.median(t) * 1e6:6.0f}us {min(t) * 1e6:6.0f}us")
    print("global variance at |mean|/std = 300, max relative error vs float64:")
    for name, e in result["accuracy"].items():
        print(f"  {name:<44} {e:.1e}")


if __name__ == "__main__":
    main()
