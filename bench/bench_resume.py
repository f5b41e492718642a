"""Cost of the resumable training data path and of checkpoints that carry it. Ratios, side by side.

    .venv/bin/python bench/bench_resume.py            # both parts (~3-6 min on 2 cores)
    .venv/bin/python bench/bench_resume.py steps      # one part: steps | save

steps: one rank's training loop (data loading + an MLP forward/backward/SGD step), the loader as
       Lightning's ddp builds it (DataLoader + DistributedSampler) vs as ddp_sync builds it
       (torchdata StatefulDataLoader + ResumableDistributedSampler + worker RNG snapshots), for
       num_workers 0 and 2, rounds interleaved. Target: <= 1.01x per step.
save:  trainer.save_checkpoint inside a 2-rank ddp_sync fit, with the resumable loader (every rank's
       loader state gathered into the checkpoint) vs with a plain loader, launches interleaved.
       Target: <= 1.05x.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Augmented(Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int):
        x = torch.randn(64) + 0.1 * torch.rand(64)  # features + random augmentation
        return x, torch.tensor(float(i % 7))


def _loader(kind: str, workers: int) -> DataLoader:
    data = Augmented()
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=1)
    plain = DataLoader(data, batch_size=32, sampler=sampler, num_workers=workers,
                       persistent_workers=workers > 0)
    if kind == "ddp":
        return plain
    from lightning_sync.resume import make_resumable

    out = make_resumable(plain)
    assert type(out).__name__ == "ResumableDataLoader"
    return out  # type: ignore[return-value]


def _cpu_seconds(loader: DataLoader) -> float:
    """CPU time (user + system) of this process and of the loader's live worker processes (Linux)."""
    total = time.process_time()
    iterator = getattr(loader, "_iterator", None)
    for worker in getattr(iterator, "_workers", None) or []:
        try:
            fields = Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _epoch(loader: DataLoader, model: nn.Module, opt: torch.optim.Optimizer, epoch: int) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (main process and workers) and steps of one epoch."""
    loader.sampler.set_epoch(epoch)  # type: ignore[union-attr]
    it = iter(loader)  # (persistent) workers exist from here: their CPU time is counted from here
    cpu, start = _cpu_seconds(loader), time.perf_counter()
    n = 0
    for x, y in it:
        opt.zero_grad()
        nn.functional.mse_loss(model(x).squeeze(-1), y).backward()
        opt.step()
        n += 1
    return time.perf_counter() - start, _cpu_seconds(loader) - cpu, n


def bench_steps(rounds: int = 24) -> None:
    torch.set_num_threads(1)
    for workers in (0, 2):
        loaders = {k: _loader(k, workers) for k in ("ddp", "ddp_sync")}
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        times: dict[str, list[float]] = {k: [] for k in loaders}
        cpu = {k: 0.0 for k in loaders}
        steps = {k: 0 for k in loaders}
        for r in range(rounds + 1):  # round 0 warms up (worker start, allocator)
            for kind in (("ddp", "ddp_sync") if r % 2 else ("ddp_sync", "ddp")):
                wall, used, n = _epoch(loaders[kind], model, opt, r)
                if r:
                    times[kind].append(wall / n)
                    cpu[kind] += used
                    steps[kind] += n
        # each round runs both loaders back to back: the median of the per-round ratios cancels the
        # machine's drift (per-step times here move by 2x over a minute), the medians of times do not.
        # With workers, three processes share 2 cores and wall time also depends on who gets scheduled
        # when: CPU time per step (summed over the run; clock ticks of 10 ms) is the steadier measure.
        ratios = sorted(b / a for a, b in zip(times["ddp"], times["ddp_sync"]))
        q1, ratio, q3 = statistics.quantiles(ratios, n=4)
        a, b = statistics.median(times["ddp"]), statistics.median(times["ddp_sync"])
        ca, cb = cpu["ddp"] / steps["ddp"], cpu["ddp_sync"] / steps["ddp_sync"]
        print(f"steps  num_workers={workers}: ddp {a * 1e3:.3f} ms/step, ddp_sync resumable {b * 1e3:.3f} ms/step, "
              f"ratio {ratio:.3f} (median of {rounds} paired epochs, quartiles {q1:.3f}-{q3:.3f}); CPU time "
              f"{ca * 1e3:.3f} vs {cb * 1e3:.3f} ms/step, ratio {cb / ca:.3f} (target <= 1.01)", flush=True)


# ---------------------------------------------------------------------------- checkpoint save

_SAVE_CHILD = r'''
import json, sys, time
import lightning as L, torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
import lightning_sync as ls
import lightning_sync.strategy as S

kind, out, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
if kind == "plain":
    S.make_resumable = lambda loader, **_: loader  # the data path of ddp_sync before resume support

class D(Dataset):
    def __len__(self): return 2048
    def __getitem__(self, i): return torch.randn(64), torch.tensor(float(i % 7))

class M(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
        self.times = []
    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)
    def on_train_batch_end(self, outputs, batch, i):
        if i in (5, 10, 15, 20, 25, 30):
            t = time.perf_counter()
            self.trainer.save_checkpoint(f"{out}/c{self.global_rank}_{i}.ckpt")
            self.times.append(time.perf_counter() - t)
    def on_train_end(self):
        if self.global_rank == 0:
            open(f"{out}/times.json", "w").write(json.dumps(self.times[1:]))
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

tr = L.Trainer(accelerator="cpu", devices=2, strategy=ls.SyncDDPStrategy(seed=1), max_epochs=1, logger=False,
               enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, limit_train_batches=32)
tr.fit(M(), DataLoader(D(), batch_size=32, shuffle=True, num_workers=workers, persistent_workers=workers > 0))
'''


def bench_save(rounds: int = 2) -> None:
    here = Path(__file__).resolve().parents[1]
    for workers in (0, 2):
        times: dict[str, list[float]] = {"plain": [], "resumable": []}
        for r in range(rounds):
            for kind in (("plain", "resumable") if r % 2 else ("resumable", "plain")):
                with tempfile.TemporaryDirectory() as out:
                    script = Path(out) / "child.py"
                    script.write_text(_SAVE_CHILD)
                    subprocess.run(["timeout", "-k", "5", "300", sys.executable, str(script), kind, out, str(workers)],
                                   check=True, capture_output=True, cwd=here)
                    times[kind] += json.loads((Path(out) / "times.json").read_text())
        a, b = statistics.median(times["plain"]), statistics.median(times["resumable"])
        print(f"save   num_workers={workers}: plain loader {a * 1e3:.1f} ms, resumable loader state {b * 1e3:.1f} ms, "
              f"ratio {b / a:.3f} (target <= 1.05)", flush=True)


if __name__ == "__main__":
    parts = sys.argv[1:] or ["steps", "save"]
    if "steps" in parts:
        bench_steps()
    if "save" in parts:
        bench_save()
