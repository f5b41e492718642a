"""GPU figures for scripts/gpu_check.sh's report, on one CUDA device, side by side in one run.

    python bench/bench_gpu.py [--rounds 7] [--json FILE]

1. SyncBatchNorm per training step (forward + backward of one layer, batch 64 x 64 x 32 x 32, a
   NCCL group of one): torch's fused CUDA kernels (what lightning_sync.SyncBatchNorm runs on NCCL)
   and the portable implementation (what it runs on gloo), both with their collectives, against
   local BatchNorm; rounds interleave the variants, medians and ratios are printed.
2. Gathering 64k float32 rows a call on NCCL: lightning_sync's transport (one fixed-size metadata
   exchange, then one all-gather of the raw bytes, as ``all_gather_uneven`` does on more ranks) vs
   ``dist.all_gather_object`` of the same tensor (pickle, size exchange, bytes, unpickle).

NCCL refuses two ranks on one GPU, so both parts run with a world of one: the kernels and the
transports are real, the network is not. Exit 2 with "no CUDA device" where there is none.
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
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lightning_sync import collectives  # noqa: E402
from lightning_sync._compat.torch_api import TorchSyncBatchNormFunction  # noqa: E402
from lightning_sync.batchnorm import _PortableSyncBatchNorm  # noqa: E402


def _time(fn: Callable[[], Any], repeat: int) -> float:
    """Seconds per call: CUDA-synchronised around ``repeat`` calls after one warm-up."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def syncbn(rounds: int, repeat: int) -> dict[str, float]:
    cuda = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(64, 64, 32, 32, device=cuda).requires_grad_(True)
    dy = torch.randn_like(x)
    weight = torch.ones(64, device=cuda, requires_grad=True)
    bias = torch.zeros(64, device=cuda, requires_grad=True)
    stats = (torch.zeros(64, device=cuda), torch.ones(64, device=cuda))
    group = dist.group.WORLD

    def local() -> None:
        nn.functional.batch_norm(x, *stats, weight, bias, True, 0.1, 1e-5).backward(dy)

    def native() -> None:
        TorchSyncBatchNormFunction.apply(x, weight, bias, *stats, 1e-5, 0.1, group, 1).backward(dy)

    def portable() -> None:
        _PortableSyncBatchNorm.apply(x, weight, bias, *stats, 1e-5, 0.1, group, 1).backward(dy)

    variants = {"local BatchNorm": local, "native SyncBN (CUDA kernels)": native, "portable SyncBN": portable}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(_time(variants[name], repeat))
    return {name: statistics.median(t) for name, t in times.items()}


def gathers(rounds: int, repeat: int) -> dict[str, float]:
    cuda = torch.device("cuda", torch.cuda.current_device())
    rows = torch.randn(65536, device=cuda)

    def transport() -> None:
        record = [0] * collectives._META_LEN
        record[collectives._I_PAYLOAD] = rows.numel()
        counts = [rec[collectives._I_PAYLOAD] for rec in collectives._exchange(record, None, cuda)]
        raw = rows.view(torch.uint8)
        blocks = collectives._padded_exchange([raw], [c * 4 for c in counts], None, cuda)
        assert blocks is not None
        blocks.view(torch.float32)

    def objects() -> None:
        out: list[Any] = [None]
        dist.all_gather_object(out, rows)

    variants = {"lightning_sync transport": transport, "dist.all_gather_object": objects}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds):
        for name in (variants if r % 2 == 0 else list(reversed(variants))):
            times[name].append(_time(variants[name], repeat))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(f"bench_gpu: no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
              "run it on a machine with a GPU and a CUDA build of torch", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        try:
            bn = syncbn(args.rounds, args.repeat)
            gather = gathers(args.rounds, args.repeat)
        finally:
            dist.destroy_process_group()
    name = torch.cuda.get_device_name(0)
    print(f"bench_gpu on {name}, torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"world of one; medians of {args.rounds} rounds x {args.repeat} calls")
    base = bn["local BatchNorm"]
    for key, value in bn.items():
        print(f"  {key:32s} {value * 1e3:8.3f} ms/step   {value / base:5.2f}x local")
    ref = gather["dist.all_gather_object"]
    for key, value in gather.items():
        print(f"  {key:32s} {value * 1e6:8.1f} us/call   {value / ref:5.2f}x all_gather_object")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "syncbn_s_per_step": bn,
                       "gather_s_per_call": gather}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
