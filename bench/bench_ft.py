"""Per-step cost of ``ddp_sync_ft`` against ``ddp_sync``, measured side by side in one run.

    python bench/bench_ft.py                      # --rounds 3 --steps 200 --width 128 (a tiny step)
    python bench/bench_ft.py --width 1024          # a step of ~20 ms on 2 cores: the fixed cost amortised

The same MLP (32 -> width -> width -> 1, batch 64 a rank, a BatchNorm layer, one ``self.log`` a step, SGD)
trained for ``--steps`` steps two ways, alternated ABBA after a dropped warm-up run of each, every run a fresh set of processes:

* ``ddp_sync``: Lightning's launcher, 2 CPU ranks (``devices=2``);
* ``ddp_sync_ft``: ``lsync-ft-run --replicas 2``, two replica groups of one process each (a quorum at every step
  through torchft's lighthouse on loopback, the gradient buckets and BatchNorm buffers averaged / broadcast over
  torchft's process group, ``find_unused_parameters=True``, the step boundary kept for a recovering group).

Both read one loop iteration (batch start to the next batch start), median over the run's steps after the first
20, on rank 0 / group 0. Also, inside the ft runs: the median time of the step-boundary bookkeeping
(``mark_step_boundary``) and of the quorum (``start_quorum``) per step. No fault is injected: this is what fault
tolerance costs a run in which nothing fails. 2 processes on 2 cores: ratios hold, absolute times are noisy.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(mode: str, steps: int, out: Path, width: int) -> None:
    """One fit (a rank of ``ddp_sync``, or a replica group of ``ddp_sync_ft``); rank 0 / group 0 writes ``out``."""
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_sync as ls

    times: list[float] = []
    inner: dict[str, list[float]] = {"mark_step_boundary": [], "start_quorum": []}

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, width),
                                     nn.ReLU(), nn.Linear(width, 1))
            self._t = 0.0

        def on_train_batch_start(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            now = time.perf_counter()
            if self._t:
                times.append(now - self._t)
            self._t = now

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 2 * steps, 32, generator=g)
    data = TensorDataset(x, x[:, 0] + 0.1 * torch.randn(len(x), generator=g))
    if mode == "ft":
        strategy: object = ls.FaultTolerantDDPStrategy()
        devices = 1
        for name in inner:  # timed on this instance: what the step boundary and the quorum take a step
            method = getattr(strategy, name)

            def timed(*args, _method=method, _name=name, **kwargs):  # type: ignore[no-untyped-def]
                start = time.perf_counter()
                try:
                    return _method(*args, **kwargs)
                finally:
                    inner[_name].append(time.perf_counter() - start)

            setattr(strategy, name, timed)
    else:
        strategy, devices = ls.SyncDDPStrategy(), 2
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(MLP(), DataLoader(data, batch_size=64, shuffle=True))
    if trainer.global_rank == 0 and os.environ.get("REPLICA_GROUP_ID", "0") == "0":
        result = {"step_ms": statistics.median(times[20:]) * 1e3}
        result.update({f"{k}_ms": statistics.median(v[20:]) * 1e3 for k, v in inner.items() if len(v) > 20})
        out.write_text(json.dumps(result))


def run_once(mode: str, steps: int, out: Path, width: int) -> dict[str, float]:
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--steps", str(steps), "--out", str(out),
          "--width", str(width)]
    cmd = me if mode == "ddp" else [sys.executable, "-m", "lightning_sync.ft.launch", "--replicas", "2", "--", *me]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"bench_ft: the {mode} run failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(out.read_text()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--worker", choices=("ddp", "ft"), default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--width", type=int, default=128, help="the MLP's hidden width (the step's size)")
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out, args.width)
        return
    results: dict[str, list[dict[str, float]]] = {"ddp": [], "ft": []}
    with tempfile.TemporaryDirectory() as tmp:
        order = ["ddp", "ft"] + [m for _ in range(args.rounds) for m in ("ddp", "ft", "ft", "ddp")]
        for i, mode in enumerate(order):
            result = run_once(mode, args.steps, Path(tmp) / f"{i}.json", args.width)
            if i >= 2:  # the first run of each: warm-up (file caches, the lighthouse binary)
                results[mode].append(result)
    ddp = statistics.median(r["step_ms"] for r in results["ddp"])
    ft = statistics.median(r["step_ms"] for r in results["ft"])
    boundary = statistics.median(r.get("mark_step_boundary_ms", float("nan")) for r in results["ft"])
    quorum = statistics.median(r.get("start_quorum_ms", float("nan")) for r in results["ft"])
    print(f"bench_ft: 2 CPU processes, {args.steps} steps of batch 64 a rank, MLP width {args.width}, "
          f"{args.rounds} ABBA rounds (median loop iteration of each run, median over runs)")
    print(f"  ddp_sync (2 ranks)          {ddp:7.3f} ms a step   runs: "
          + " ".join(f"{r['step_ms']:.2f}" for r in results["ddp"]))
    print(f"  ddp_sync_ft (2 groups of 1) {ft:7.3f} ms a step   runs: "
          + " ".join(f"{r['step_ms']:.2f}" for r in results["ft"]))
    print(f"  steps/s ratio ft / ddp_sync: {ddp / ft:.3f}; inside an ft step: quorum {quorum:.3f} ms, step boundary "
          f"bookkeeping {boundary:.3f} ms")


if __name__ == "__main__":
    main()
