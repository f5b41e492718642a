"""Trainer calls after ``fit`` in one process: ddp_sync vs ddp, side by side (issue 21, point 2).

    .venv/bin/python bench/bench_calls.py [--rounds 3]

Each round launches the same 2-rank script once per strategy (order alternating): fit (1 epoch),
then validate, test, predict, validate again, each timed on rank 0. The ratio of the medians of the
summed after-fit times is printed; ``ddp_sync`` keeps the process group across the calls, as
Lightning's ``ddp`` does, so the target is <= 1.1x.
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

CHILD = r'''
import json, sys, time
import lightning as L, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning_sync

class M(L.LightningModule):
    def __init__(self):
        super().__init__(); self.net = nn.Linear(16, 1)
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(301, 16, generator=g), torch.randn(301, 1, generator=g))
    def training_step(self, b, i): return nn.functional.mse_loss(self.net(b[0]), b[1])
    def validation_step(self, b, i): self.log("v", nn.functional.mse_loss(self.net(b[0]), b[1]), sync_dist=True)
    def test_step(self, b, i): self.log("t", nn.functional.mse_loss(self.net(b[0]), b[1]), sync_dist=True)
    def predict_step(self, b, i): return self.net(b[0])
    def configure_optimizers(self): return torch.optim.SGD(self.parameters(), lr=0.01)
    def train_dataloader(self): return DataLoader(self.data, batch_size=32)
    def val_dataloader(self): return DataLoader(self.data, batch_size=32)
    def test_dataloader(self): return DataLoader(self.data, batch_size=32)
    def predict_dataloader(self): return DataLoader(self.data, batch_size=32)

out, strategy = sys.argv[1], sys.argv[2]
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
model = M()
t0 = time.perf_counter(); trainer.fit(model); times = {"fit": time.perf_counter() - t0}
for name, call in (("validate", trainer.validate), ("test", trainer.test), ("predict", trainer.predict),
                   ("validate2", trainer.validate)):
    t0 = time.perf_counter(); call(model, verbose=False) if name != "predict" else call(model)
    times[name] = time.perf_counter() - t0
if trainer.global_rank == 0:
    open(out, "w").write(json.dumps(times))
'''


ABORTS: dict[str, int] = {"ddp": 0, "ddp_sync": 0}


def run(strategy: str, script: Path, out: Path) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["timeout", "-k", "5", "300", sys.executable, str(script), str(out), strategy],
                          env=env, capture_output=True, text=True, timeout=320)
    if proc.returncode != 0:
        if not out.exists():
            raise RuntimeError(f"{strategy}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        ABORTS[strategy] += 1  # after the timed calls: gloo's abort at interpreter exit (FINDINGS.md)
    result: dict[str, float] = json.loads(out.read_text())
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "calls.py"
        script.write_text(CHILD)
        after: dict[str, list[float]] = {"ddp": [], "ddp_sync": []}
        per_call: dict[str, list[dict[str, float]]] = {"ddp": [], "ddp_sync": []}
        start = time.perf_counter()
        for r in range(args.rounds):
            for strategy in (("ddp", "ddp_sync") if r % 2 == 0 else ("ddp_sync", "ddp")):
                times = run(strategy, script, Path(tmp) / f"{strategy}{r}.json")
                per_call[strategy].append(times)
                after[strategy].append(sum(v for k, v in times.items() if k != "fit"))
    print(f"bench_calls: {args.rounds} rounds, {time.perf_counter() - start:.0f} s")
    for name in ("validate", "test", "predict", "validate2"):
        d = statistics.median(t[name] for t in per_call["ddp"])
        s = statistics.median(t[name] for t in per_call["ddp_sync"])
        print(f"  {name:9s}  ddp {d:6.3f} s   ddp_sync {s:6.3f} s   ratio {s / d:5.2f}x")
    d, s = statistics.median(after["ddp"]), statistics.median(after["ddp_sync"])
    print(f"  after fit (sum of the four calls): ddp {d:.3f} s, ddp_sync {s:.3f} s: ratio {s / d:.2f}x (target <= 1.1x)")
    print(f"  non-zero exits after the timed calls (gloo's abort at exit): ddp {ABORTS['ddp']}/{args.rounds}, "
          f"ddp_sync {ABORTS['ddp_sync']}/{args.rounds}")


if __name__ == "__main__":
    main()
