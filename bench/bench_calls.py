"""Trainer calls after ``fit`` in one process: ddp_sync vs ddp, side by side (issue 21, point 2).

    .venv/bin/python bench/bench_calls.py [--rounds 3] [--repeats 4] [--guard-off]

Each round launches the same 2-rank script once per strategy (order alternating): fit (1 epoch),
then validate, test, predict, validate again, each timed on rank 0, and that sequence ``--repeats``
times in all. The ratio of the medians of the first sequence's summed times is printed (the target,
<= 1.1x: ``ddp_sync`` keeps the process group across the calls, as Lightning's ``ddp`` does), and the
ratio of the median call of the later sequences (one call is ~20 ms: the first sequence's single
calls are noisy; the later ones show what a call costs once a process has made a few).
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
from typing import Any

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

out, label, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
strategy = lightning_sync.SyncDDPStrategy(guard=False) if label == "guard_off" else label
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
model = M()
t0 = time.perf_counter(); trainer.fit(model); times = {"fit": time.perf_counter() - t0}
later = []
for r in range(repeats):
    for name, call in (("validate", trainer.validate), ("test", trainer.test), ("predict", trainer.predict),
                       ("validate2", trainer.validate)):
        t0 = time.perf_counter(); call(model, verbose=False) if name != "predict" else call(model)
        if r == 0:
            times[name] = time.perf_counter() - t0
        else:
            later.append(time.perf_counter() - t0)
times["later"] = later  # the calls of the sequences after the first, each timed
if trainer.global_rank == 0:
    open(out, "w").write(json.dumps(times))
'''


ABORTS: dict[str, int] = {"ddp": 0, "ddp_sync": 0, "guard_off": 0}


def run(strategy: str, script: Path, out: Path, repeats: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["timeout", "-k", "5", "300", sys.executable, str(script), str(out), strategy, str(repeats)],
                          env=env, capture_output=True, text=True, timeout=320)
    if proc.returncode != 0:
        if not out.exists():
            raise RuntimeError(f"{strategy}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        ABORTS[strategy] += 1  # after the timed calls: gloo's abort at interpreter exit (FINDINGS.md)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=4,
                   help="sequences of the four calls per process; the first is reported as such, the later ones "
                        "call by call (the cost of a call in a process that has made some)")
    p.add_argument("--guard-off", action="store_true",
                   help="also SyncDDPStrategy(guard=False): how much of the difference is the guard's")
    args = p.parse_args()
    labels = ["ddp", "ddp_sync"] + (["guard_off"] if args.guard_off else [])
    calls = ("validate", "test", "predict", "validate2")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "calls.py"
        script.write_text(CHILD)
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in labels}
        start = time.perf_counter()
        for r in range(args.rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:  # each label first in turn
                runs[label].append(run(label, script, Path(tmp) / f"{label}{r}.json", args.repeats))
    print(f"bench_calls: {args.rounds} rounds, {time.perf_counter() - start:.0f} s")

    def median(label: str, of: Any) -> float:
        return statistics.median(of(t) for t in runs[label])

    for name in calls:
        per_label = {k: median(k, lambda t: t[name]) for k in labels}
        d = per_label["ddp"]
        print(f"  {name:9s}  ddp {d:6.3f} s" + "".join(
            f"   {k} {per_label[k]:6.3f} s ({per_label[k] / d:4.2f}x)" for k in labels[1:]))
    first = {k: median(k, lambda t: sum(t[c] for c in calls)) for k in labels}
    whole = {k: median(k, lambda t: t["fit"] + sum(t[c] for c in calls)) for k in labels}
    later = {k: statistics.median(x for t in runs[k] for x in t["later"]) for k in labels} if args.repeats > 1 else {}
    for k in labels[1:]:
        print(f"  {k}: after fit (sum of the four calls) {first[k]:.3f} s vs ddp {first['ddp']:.3f} s: "
              f"ratio {first[k] / first['ddp']:.2f}x (target <= 1.1x)")
        print(f"  {k}: whole sequence (fit + the four calls, as issue 21 timed it) {whole[k]:.2f} s vs ddp "
              f"{whole['ddp']:.2f} s: ratio {whole[k] / whole['ddp']:.2f}x")
        if later:
            print(f"  {k}: later calls (sequences 2-{args.repeats}, median call) {later[k] * 1e3:.1f} ms vs ddp "
                  f"{later['ddp'] * 1e3:.1f} ms: ratio {later[k] / later['ddp']:.2f}x")
    print("  non-zero exits after the timed calls (gloo's abort at exit): "
          + ", ".join(f"{k} {ABORTS[k]}/{args.rounds}" for k in labels))


if __name__ == "__main__":
    main()
