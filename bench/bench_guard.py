"""Cost of the collective guard: step time with guard on vs off, and microseconds per guarded collective.

    python bench/bench_guard.py [--steps 300] [--repeats 5]

1. micro: 2 gloo ranks, `dist.all_reduce(float32[1])` in a loop, guarded vs not: the difference is
   the guard's cost per collective (store round trip + call-site walk).
2. fit: a small MLP (batch 64/rank) on 2 ranks through Lightning's launcher, one
   `self.log(..., sync_dist=True)` per step; `ddp_sync` with guard on and off, alternated in one
   process so machine noise hits both; median step time after warm-up.
Ratios are what hold on a shared machine; absolute times are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _micro(rank: int, world: int, n: int, port: int) -> dict:
    import torch
    import torch.distributed as dist

    # TCP rendezvous, as under Lightning/torchrun: the guard then talks to the TCPStore server
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    from lightning_sync.guard import CollectiveGuard

    x = torch.ones(1)
    out = {}
    for label in ("off", "on", "sampled", "off2", "on2", "sampled2"):
        guard = (CollectiveGuard(timeout=30) if label.startswith("on") else
                 CollectiveGuard(timeout=30, check_every=16) if label.startswith("sampled") else None)
        if guard:
            guard.install()
        for _ in range(50):
            dist.all_reduce(x)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        out[label] = (time.perf_counter() - start) / n * 1e6
        if guard:
            guard.uninstall()
    dist.destroy_process_group()
    return out


def _fit(steps: int, repeats: int, out: Path) -> None:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_sync as ls

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
            self.times: list[float] = []
            self._t = 0.0

        def on_train_batch_start(self, batch, batch_idx):
            self._t = time.perf_counter()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self._t)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.set_num_threads(1)
    data = TensorDataset(torch.randn(64 * 2 * steps, 32), torch.randn(64 * 2 * steps))
    results: dict[str, list[float]] = {"on": [], "off": [], "sampled": []}
    for _ in range(repeats):
        for label in ("off", "on", "sampled"):
            model = MLP()
            guard = {"off": False, "on": True, "sampled": ls.CollectiveGuard(check_every=16)}[label]
            trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ls.SyncDDPStrategy(seed=0, guard=guard),
                                max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False)
            trainer.fit(model, DataLoader(data, batch_size=64))
            results[label].append(statistics.median(model.times[20:]) * 1e3)
            if trainer.global_rank == 0:
                (out / "fit.json").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--micro-n", type=int, default=2000)
    parser.add_argument("--fit-out", type=Path)
    args = parser.parse_args()
    if args.fit_out is not None:
        _fit(args.steps, args.repeats, args.fit_out)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tests.distributed import run_ranks

    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    micro = run_ranks(_micro, 2, args=(args.micro_n, port), timeout=600, init=False)[0]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["timeout", "-k", "5", "900", sys.executable, __file__, "--fit-out", tmp,
                        "--steps", str(args.steps), "--repeats", str(args.repeats)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        fit = json.loads((Path(tmp) / "fit.json").read_text())
    off = statistics.median([micro["off"], micro["off2"]])
    on = statistics.median([micro["on"], micro["on2"]])
    sampled = statistics.median([micro["sampled"], micro["sampled2"]])
    print(f"{'measure':<42}{'off':>9}{'on':>9}{'ratio':>7}{'sampled/16':>12}{'ratio':>7}")
    print(f"{'dist.all_reduce(float32[1]), us':<42}{off:>9.1f}{on:>9.1f}{on / off:>7.2f}{sampled:>12.1f}"
          f"{sampled / off:>7.2f}")
    print(f"{'cost per guarded collective, us':<42}{'':>9}{on - off:>9.1f}{'':>7}{sampled - off:>12.1f}")
    for name, pick in (("median", statistics.median), ("best", min)):
        s_off, s_on, s_sm = (pick(fit[k]) for k in ("off", "on", "sampled"))
        print(f"{'MLP step + 1 sync_dist log (' + name + ' fit), ms':<42}{s_off:>9.3f}{s_on:>9.3f}{s_on / s_off:>7.3f}"
              f"{s_sm:>12.3f}{s_sm / s_off:>7.3f}")
    print(f"(per-fit medians, ms: " + "; ".join(f"{k} {['%.2f' % t for t in v]}" for k, v in fit.items())
          + f"; {args.steps} steps per fit, 2 ranks, gloo; sampled = CollectiveGuard(check_every=16))")


if __name__ == "__main__":
    main()
