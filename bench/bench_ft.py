"""Per-step cost of ``ddp_sync_ft`` against ``ddp_sync``, measured side by side in one run.

    python bench/bench_ft.py                      # --rounds 3 --steps 200 --width 128 (a tiny step)
    python bench/bench_ft.py --width 1024          # a step of ~20 ms on 2 cores: the fixed cost amortised
    python bench/bench_ft.py --width 1024 --depth 6 --bucket-cap-mb 4   # 6 gradient buckets: comm overlaps backward
    python bench/bench_ft.py --replicas 3          # 3 replica groups vs 3 ddp_sync ranks (issue 43's comparison)
    python bench/bench_ft.py --fsdp --nproc-per-replica 2 --width 1024 --depth 4   # FSDP2 in groups of 2 processes
    python bench/bench_ft.py --recovery            # 3 groups, group 1 SIGKILLed: the survivors' stall, the return

The same MLP (32 -> width, ``--depth`` width -> width layers (1), -> 1; batch 64 a rank, a BatchNorm layer, one
``self.log`` a step, SGD; DDP's ``bucket_cap_mb`` from ``--bucket-cap-mb``, 25 by default: one bucket at the default
width)
trained for ``--steps`` steps two ways, alternated ABBA after a dropped warm-up run of each, every run a fresh set of processes:

* ``ddp_sync``: Lightning's launcher, ``--replicas`` N CPU ranks (``devices=N``; N = 2 by default);
* ``ddp_sync_ft``: ``lsync-ft-run --replicas N``, N replica groups of one process each (a quorum at every step
  through torchft's lighthouse on loopback, the gradient buckets and BatchNorm buffers averaged / broadcast over
  torchft's process group, ``find_unused_parameters=True``, the step boundary kept for a recovering group).

``--nproc-per-replica P``: each group is P processes under torchrun (``devices=P``), against ``N * P`` ranks.
``--fsdp``: FSDP2 (each Linear a unit, ``fully_shard`` in ``configure_model``) under ``model_parallel_sync_ft`` in
each group, against ``model_parallel_sync`` on ``N * P`` ranks; the gradient shards cross the groups after the
backward, in buckets of ``--bucket-cap-mb``.

Each rank / group trains 64 rows a step of its own shard (``N * 64`` rows a step in all, the data set sized so
that ``--steps`` steps are one epoch at every N). N processes on fewer cores than N (3 on a 2-core host) share
them: both sides are slowed, the ratio is noisier than the absolute times suggest.

Both read one loop iteration (batch start to the next batch start), median over the run's steps after the first
20, on rank 0 / group 0. Also, inside the ft runs: the median time of the step-boundary bookkeeping
(``mark_step_boundary``) and of the quorum (``start_quorum``) per step. No fault is injected: this is what fault
tolerance costs a run in which nothing fails. 2 processes on 2 cores: ratios hold, absolute times are noisy.

``--recovery``: what a fault costs. ``lsync-ft-run --replicas 3`` (``--min-replicas 1``, each
``--heartbeat-timeout-ms`` given), group 1 SIGKILLed in the middle of step ``--kill-at`` (before its backward:
the others wait for it in the gradient all-reduce). Read from every group's per-step log (wall clock, one
machine): the time from the kill to the survivors' next committed step (they run the interrupted step again in
a quorum without group 1), and to the first step the restarted group commits after healing from a live group
(its process started again, torch and Lightning imported, the quorum joined, the checkpoint received).
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


def worker(mode: str, steps: int, out: Path, width: int, kill_at: int = -1, replicas: int = 2, depth: int = 1,
           bucket_cap_mb: float = 25.0, nproc: int = 1, fsdp: bool = False) -> None:
    """One fit (a rank of ``ddp_sync``, or a replica group of ``ddp_sync_ft``); rank 0 / group 0 writes ``out``
    (``kill_at`` >= 0: every group appends a line a step to ``out``.group<g>, and group 1 dies in that step;
    ``replicas``: the ``ddp_sync`` ranks, and the replica groups the data set is sized for)."""
    import signal

    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_sync as ls

    times: list[float] = []
    group, life = os.environ.get("REPLICA_GROUP_ID", "0"), os.environ.get("LSYNC_FT_RESTART", "0")
    inner: dict[str, list[float]] = {"mark_step_boundary": [], "start_quorum": []}

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            hidden = [layer for _ in range(depth) for layer in (nn.Linear(width, width), nn.ReLU())]
            self.net = nn.Sequential(nn.Linear(32, width), nn.BatchNorm1d(width), nn.ReLU(), *hidden,
                                     nn.Linear(width, 1))
            self._t = 0.0

        def configure_model(self) -> None:  # (--fsdp) each Linear a unit of FSDP2 over the group's processes
            if fsdp and not hasattr(self.net[0].weight, "full_tensor"):
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for layer in self.net:
                    if isinstance(layer, nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def on_train_batch_start(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            now = time.perf_counter()
            if self._t:
                times.append(now - self._t)
            self._t = now

        def on_before_backward(self, loss):  # type: ignore[no-untyped-def]
            if group == "1" and life == "0" and self.trainer.global_step == kill_at:
                with open(f"{out}.kill", "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            if kill_at >= 0:
                report = self.trainer.strategy.ft_report
                with open(f"{out}.group{group}", "a") as f:
                    f.write(json.dumps({"t": time.time(), "life": int(life), "step": self.trainer.global_step,
                                        "participants": report["participants"]}) + "\n")

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * replicas * nproc * steps, 32, generator=g)
    data = TensorDataset(x, x[:, 0] + 0.1 * torch.randn(len(x), generator=g))
    if mode == "ft":
        strategy: object = (ls.FaultTolerantModelParallelStrategy(bucket_cap_mb=bucket_cap_mb) if fsdp
                            else ls.FaultTolerantDDPStrategy(bucket_cap_mb=bucket_cap_mb))
        devices = nproc
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
        strategy = ls.SyncModelParallelStrategy() if fsdp else ls.SyncDDPStrategy(bucket_cap_mb=bucket_cap_mb)
        devices = replicas * nproc
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(MLP(), DataLoader(data, batch_size=64, shuffle=True))
    if trainer.global_rank == 0 and group == "0" and kill_at < 0:
        result = {"step_ms": statistics.median(times[20:]) * 1e3}
        result.update({f"{k}_ms": statistics.median(v[20:]) * 1e3 for k, v in inner.items() if len(v) > 20})
        out.write_text(json.dumps(result))


def run_once(mode: str, steps: int, out: Path, width: int, replicas: int, depth: int,
             bucket_cap_mb: float, nproc: int = 1, fsdp: bool = False) -> dict[str, float]:
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--steps", str(steps), "--out", str(out),
          "--width", str(width), "--replicas", str(replicas), "--depth", str(depth), "--bucket-cap-mb",
          str(bucket_cap_mb), "--nproc-per-replica", str(nproc), *(["--fsdp"] if fsdp else [])]
    cmd = me if mode == "ddp" else [sys.executable, "-m", "lightning_sync.ft.launch", "--replicas", str(replicas),
                                    "--nproc-per-replica", str(nproc), "--", *me]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"bench_ft: the {mode} run failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(out.read_text()))


def recovery(rounds: int, steps: int, kill_at: int, heartbeat_ms: int) -> list[dict[str, float]]:
    """``rounds`` runs of 3 groups with group 1 killed in step ``kill_at + 1``: seconds from the kill to the
    survivors' next committed step, and to the restarted group's first committed step."""
    runs = []
    for i in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run"
            me = [sys.executable, str(Path(__file__).resolve()), "--worker", "ft", "--steps", str(steps), "--out",
                  str(out), "--kill-at", str(kill_at), "--replicas", "3"]
            cmd = [sys.executable, "-m", "lightning_sync.ft.launch", "--replicas", "3", "--min-replicas", "1",
                   "--heartbeat-timeout-ms", str(heartbeat_ms), "--", *me]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
            if proc.returncode != 0:
                raise SystemExit(f"bench_ft: the recovery run failed:\n{proc.stderr[-3000:]}")
            killed = float(Path(f"{out}.kill").read_text())
            logs = {g: [json.loads(line) for line in Path(f"{out}.group{g}").read_text().splitlines()] for g in range(3)}
            survivor = next(r["t"] for r in logs[0] if r["t"] > killed)
            back = next((r["t"] for r in logs[1] if r["life"] == 1), float("nan"))
            whole = next((r["t"] for r in logs[0] if r["t"] > killed and r["participants"] == 3), float("nan"))
            if back != back:
                raise SystemExit("bench_ft: the restarted group never committed a step: raise --steps")
            runs.append({"stall_s": survivor - killed, "back_s": back - killed, "whole_s": whole - killed})
    return runs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--worker", choices=("ddp", "ft"), default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--width", type=int, default=128, help="the MLP's hidden width (the step's size)")
    p.add_argument("--depth", type=int, default=1, help="the MLP's width x width layers (1)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="DDP's gradient bucket size on both sides (25, DDP's default)")
    p.add_argument("--replicas", type=int, default=2,
                   help="replica groups of ddp_sync_ft, and ranks of ddp_sync, compared (default 2; not --recovery, "
                   "which runs 3)")
    p.add_argument("--nproc-per-replica", type=int, default=1,
                   help="processes a replica group (torchrun), against --replicas x this many ranks")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2: model_parallel_sync_ft in each group against model_parallel_sync")
    p.add_argument("--recovery", action="store_true", help="time a group's loss and return instead")
    p.add_argument("--kill-at", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--heartbeats", type=int, nargs="+", default=[5000, 1000],
                   help="--recovery: lsync-ft-run --heartbeat-timeout-ms values to time (default 5000 1000)")
    args = p.parse_args()
    if args.replicas < 1:
        p.error(f"--replicas {args.replicas}: give 1 or more (the replica groups, and ddp_sync's ranks, compared)")
    if args.worker:
        worker(args.worker, args.steps, args.out, args.width, args.kill_at, args.replicas, args.depth,
               args.bucket_cap_mb, args.nproc_per_replica, args.fsdp)
        return
    if args.recovery:
        steps = max(args.steps, 1500)  # the survivors still train when the restarted group is back
        print(f"bench_ft --recovery: lsync-ft-run --replicas 3 --min-replicas 1, group 1 SIGKILLed in step 101 of "
              f"{steps} (mid-step), MLP width {args.width}, {args.rounds} runs each; seconds from the kill")
        for heartbeat in args.heartbeats:
            runs = recovery(args.rounds, steps, 100, heartbeat)
            cols = {k: statistics.median(r[k] for r in runs) for k in ("stall_s", "back_s", "whole_s")}
            print(f"  --heartbeat-timeout-ms {heartbeat:5d}: survivors' next committed step {cols['stall_s']:.2f} s, "
                  f"the restarted group's first committed step {cols['back_s']:.2f} s (runs: "
                  + ", ".join(f"{r['stall_s']:.2f}/{r['back_s']:.2f}" for r in runs) + ")")
        return
    results: dict[str, list[dict[str, float]]] = {"ddp": [], "ft": []}
    with tempfile.TemporaryDirectory() as tmp:
        order = ["ddp", "ft"] + [m for _ in range(args.rounds) for m in ("ddp", "ft", "ft", "ddp")]
        for i, mode in enumerate(order):
            result = run_once(mode, args.steps, Path(tmp) / f"{i}.json", args.width, args.replicas, args.depth,
                              args.bucket_cap_mb, args.nproc_per_replica, args.fsdp)
            if i >= 2:  # the first run of each: warm-up (file caches, the lighthouse binary)
                results[mode].append(result)
    ddp = statistics.median(r["step_ms"] for r in results["ddp"])
    ft = statistics.median(r["step_ms"] for r in results["ft"])
    boundary = statistics.median(r.get("mark_step_boundary_ms", float("nan")) for r in results["ft"])
    quorum = statistics.median(r.get("start_quorum_ms", float("nan")) for r in results["ft"])
    n, per, cores = args.replicas, args.nproc_per_replica, os.cpu_count() or 0
    base, ours = ("model_parallel_sync", "model_parallel_sync_ft") if args.fsdp else ("ddp_sync", "ddp_sync_ft")
    print(f"bench_ft: {n * per} CPU processes on {cores} cores, {args.steps} steps of batch 64 a rank, MLP width "
          f"{args.width}, depth {args.depth}, bucket_cap_mb {args.bucket_cap_mb:g}, {args.rounds} ABBA rounds "
          "(median loop iteration of each run, median over runs)")
    print(f"  {base} ({n * per} ranks)".ljust(44) + f"{ddp:7.3f} ms a step   runs: "
          + " ".join(f"{r['step_ms']:.2f}" for r in results["ddp"]))
    print(f"  {ours} ({n} groups of {per})".ljust(44) + f"{ft:7.3f} ms a step   runs: "
          + " ".join(f"{r['step_ms']:.2f}" for r in results["ft"]))
    print(f"  steps/s ratio {ours} / {base}: {ddp / ft:.3f}; inside an ft step: quorum {quorum:.3f} ms, step boundary "
          f"bookkeeping {boundary:.3f} ms")


if __name__ == "__main__":
    main()
