"""Start-up cost of a big model: each rank's peak RSS at ``on_train_start`` and the time to get there, beside ddp.

    .venv/bin/python bench/bench_startup.py [--sizes 0.1 0.5] [--dim 4096] [--repeats 1]
        [--strategies ddp ddp_sync] [--mem-limit GIB] [--step]

The model is a ``LightningModule`` whose only parameter is an ``nn.Embedding(rows, dim)`` of
``size`` billion float32 parameters (rows = size * 1e9 / dim), built in ``__init__`` (as most users
do: every rank builds its own, before the process group exists). Each (size, strategy) is a fresh
2-rank CPU fit (Lightning's subprocess launcher re-runs this file for rank 1; ``OMP_NUM_THREADS=1``)::

    Trainer(accelerator="cpu", devices=2, strategy=..., max_steps=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False)

and the strategies alternate within each size (their order flips on every repeat). In
``on_train_start`` each rank writes its own result file: its peak RSS so far (the kernel's
high-water mark, ``getrusage(RUSAGE_SELF).ru_maxrss``: it sees every peak, however short), the same
just before ``trainer.fit`` (imports plus the model), and the seconds from the ``trainer.fit`` call
(rank 0's includes launching rank 1, which imports and builds its own model). Training then stops
there (``trainer.should_stop``) unless ``--step`` runs the one step: the step's gradients and DDP
buckets (2 x the parameters a rank) are not what is measured, and at 1B they would not fit 24 GiB.

Memory: ``ddp`` needs about 2 x the parameters' bytes a rank at start-up (the parameters plus the
wrap's broadcast), so 2 ranks at 1B (4 GB of float32 each) need about 16 GB. A watchdog sums the RSS
of the run's processes every 20 ms and kills the run above ``--mem-limit`` GiB (default: 85 % of
``MemAvailable`` when the benchmark starts), so one over-sized run is reported as ``killed`` instead of
calling the OOM killer on the machine.

Prints per (size, strategy) each rank's peak RSS at ``on_train_start`` in MB (1e6 bytes), its growth
during ``trainer.fit``, the start-up seconds (medians over ``--repeats``), then ``ddp_sync``'s figures
over ``ddp``'s: peak and time ratios, and the growth difference in MB (ddp's growth is ~10 MB: the
parameters are already in the peak before ``trainer.fit``, so a ratio of growths says little).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6


def _one(args: argparse.Namespace) -> None:  # one fit, in the launched rank processes
    sys.path.insert(0, str(ROOT))
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    import lightning_sync  # noqa: F401  registers "ddp_sync"

    torch.set_num_threads(1)
    out = Path(args.out)

    class Indices(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.tensor(i % args.rows)

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(int(os.environ.get("LOCAL_RANK", 0)))  # per-rank values: the wrap makes them equal
            self.emb = nn.Embedding(args.rows, args.dim)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.emb(batch).pow(2).mean()
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.0)

        def train_dataloader(self) -> Any:
            return DataLoader(Indices(), batch_size=4)

    start = [0.0]

    class Probe(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            seconds = time.perf_counter() - start[0]
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
            report = {"rank": trainer.global_rank, "peak": peak, "before_fit": before_fit, "seconds": seconds,
                      "params": sum(p.numel() for p in pl_module.parameters())}
            path = out / f"rank{trainer.global_rank}.json"
            path.with_suffix(".tmp").write_text(json.dumps(report))
            path.with_suffix(".tmp").replace(path)
            if not args.step:
                trainer.should_stop = True  # measured: no step (its gradients would double the memory)

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=args.strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Probe()])
    model = Model()
    before_fit = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start[0] = time.perf_counter()
    trainer.fit(model)


def _session_rss(sid: int) -> int:
    """The summed RSS of every process in session ``sid`` (the run: rank 0 and the rank it launched)."""
    total = 0
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) != sid:  # after "(comm)": state ppid pgrp session ...
                continue
            with open(f"/proc/{entry}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return total


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _launch(args: argparse.Namespace, size: float, strategy: str) -> dict[str, Any]:
    rows = max(1, round(size * 1e9 / args.dim))
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as out:
        cmd = [sys.executable, __file__, "--one", "--strategy", strategy, "--rows", str(rows), "--dim", str(args.dim),
               "--out", out, *(["--step"] if args.step else [])]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        env.pop("LOCAL_RANK", None)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)  # its own session: the watchdog's sum and kill cover rank 1
        killed: list[int] = []
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.02):
                rss = _session_rss(proc.pid)
                if rss > args.mem_limit * 2**30:
                    killed.append(rss)
                    os.killpg(proc.pid, 9)
                    return

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        try:
            stdout, stderr = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            stdout, stderr = proc.communicate()
            raise RuntimeError(f"{size}B/{strategy}: no result in {args.timeout} s:\n{stderr[-3000:]}") from None
        finally:
            done.set()
            thread.join()
            try:
                os.killpg(proc.pid, 9)  # a rank left behind
            except ProcessLookupError:
                pass
        if killed:
            return {"killed": killed[0], "rows": rows}
        reports = [Path(out) / f"rank{r}.json" for r in range(2)]
        if proc.returncode != 0 or not all(p.exists() for p in reports):
            raise RuntimeError(f"{size}B/{strategy} failed (rc {proc.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}")
        return {"rows": rows, "ranks": [json.loads(p.read_text()) for p in reports]}


def _median(runs: list[dict[str, Any]], rank: int, key: str) -> float:
    return statistics.median(float(r["ranks"][rank][key]) for r in runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", type=float, default=[0.1, 0.5], help="billions of parameters (1 for 1B)")
    p.add_argument("--dim", type=int, default=4096, help="embedding width")
    p.add_argument("--strategies", nargs="+", default=["ddp", "ddp_sync"], choices=["ddp", "ddp_sync"])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--mem-limit", type=float, default=0.85 * mem_available() / 2**30,
                   help="GiB: kill a run whose processes together hold more (default 85%% of MemAvailable)")
    p.add_argument("--step", action="store_true", help="run the one training step after the measurement")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", default=None, help="also write every figure to this file")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="ddp_sync", help=argparse.SUPPRESS)
    p.add_argument("--rows", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        _one(args)
        return
    print(f"2 gloo CPU ranks, nn.Embedding(rows, {args.dim}) built in __init__, {args.repeats} repeat(s), "
          f"runs killed above {args.mem_limit:.1f} GiB; MB = 1e6 bytes; peak = ru_maxrss at on_train_start, "
          "growth = peak - peak before trainer.fit, start-up = trainer.fit call -> on_train_start")
    print(f"{'params':>7} {'strategy':<9} {'r0 peak MB':>11} {'r1 peak MB':>11} {'r0 growth':>10} {'r1 growth':>10} "
          f"{'r0 start s':>11} {'r1 start s':>11}")
    rows_out = []
    for size in args.sizes:
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.strategies}
        killed: dict[str, int] = {}
        for repeat in range(args.repeats):
            order = args.strategies if repeat % 2 == 0 else args.strategies[::-1]
            for strategy in order:
                if strategy in killed:
                    continue
                r = _launch(args, size, strategy)
                rows_out.append({"size": size, "strategy": strategy, "repeat": repeat, **r})
                if "killed" in r:
                    killed[strategy] = r["killed"]
                else:
                    runs[strategy].append(r)
        label = f"{size:g}B"
        med: dict[str, dict[str, float]] = {}
        for strategy in args.strategies:
            if strategy in killed:
                print(f"{label:>7} {strategy:<9} killed: its 2 ranks held {killed[strategy] / MB:.0f} MB "
                      f"> --mem-limit {args.mem_limit:.1f} GiB", flush=True)
                continue
            m = {f"{k}{r}": _median(runs[strategy], r, k) for r in (0, 1) for k in ("peak", "before_fit", "seconds")}
            med[strategy] = m
            print(f"{label:>7} {strategy:<9} {m['peak0'] / MB:>11.0f} {m['peak1'] / MB:>11.0f} "
                  f"{(m['peak0'] - m['before_fit0']) / MB:>10.0f} {(m['peak1'] - m['before_fit1']) / MB:>10.0f} "
                  f"{m['seconds0']:>11.2f} {m['seconds1']:>11.2f}", flush=True)
        if "ddp" in med and "ddp_sync" in med:
            a, b = med["ddp_sync"], med["ddp"]
            extra = [(a[f"peak{r}"] - a[f"before_fit{r}"] - b[f"peak{r}"] + b[f"before_fit{r}"]) / MB for r in (0, 1)]
            print(f"{'':>7} {'ratio':<9} {a['peak0'] / b['peak0']:>10.2f}x {a['peak1'] / b['peak1']:>10.2f}x "
                  f"{extra[0]:>+10.0f} {extra[1]:>+10.0f} {a['seconds0'] / b['seconds0']:>10.2f}x "
                  f"{a['seconds1'] / b['seconds1']:>10.2f}x  (ddp_sync / ddp; growth: ddp_sync's - ddp's, MB)",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows_out, indent=1))


if __name__ == "__main__":
    main()
