"""Memory flat in the data set size: rank 0's peak RSS growth of an evaluation / predict epoch at N samples.

    .venv/bin/python bench/bench_scale.py [--sizes 1e6 1e7] [--modes validate predict writer]
        [--strategies ddp_sync ddp] [--shuffle] [--batch 8192] [--devices 2]

Every (mode, strategy, N) runs in fresh rank processes (a peak is only meaningful in a process that
has not been there before); the strategies alternate within each size. The data set is
``bench_predict.py``'s virtual one: sample ``i`` is computed from ``i`` in a batched ``__getitems__``
(16 float32 features, label ``i % 10``), so the data itself costs nothing and what grows is
bookkeeping. Rank 0 samples
``/proc/self/statm`` every 2 ms from just before the trainer call to just after it.

* ``validate``: ``trainer.validate`` with ``self.log("val_loss", ..., sync_dist=True)`` and a
  logged torchmetrics ``Accuracy`` (the values are printed: ``ddp`` counts padded samples twice);
* ``predict``: ``trainer.predict(return_predictions=False)``, no callback (the loop itself);
* ``writer``: the same with ``ls.PredictionWriter`` (Parquet) writing every row to one file;
* ``fit``: one training epoch (SGD, an epoch-level ``sync_dist`` loss; not among the defaults:
  ``--modes fit``), the resumable training sampler under ``ddp_sync``.

Prints per row: peak RSS growth in MiB, the growth of its anonymous part (without the code pages of libraries
run for the first time: pyarrow's are ~28 MiB), bytes per sample, microseconds per sample (the slowest
rank's wall time of the call, process-group set-up included), and ``ddp_sync``'s figures over
``ddp``'s in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_predict import DIM, PeakRSS, Rows  # noqa: E402


def make_model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Linear(DIM, 10)


def _one(args: argparse.Namespace) -> None:  # one trainer call, in the launched rank processes
    import lightning as L
    import torch
    import torchmetrics
    from torch import nn
    from torch.utils.data import DataLoader

    import lightning_sync as ls  # on the path: bench_predict put the repository there

    torch.set_num_threads(1)

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()
            self.acc = torchmetrics.Accuracy("multiclass", num_classes=10)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            logits = self.net(x)
            self.acc(logits, y)
            self.log("val_acc", self.acc)
            self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)

        def predict_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return {"logits": self.net(x), "label": y}

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    loader = DataLoader(Rows(args.n), batch_size=args.batch, shuffle=args.shuffle, collate_fn=lambda b: b)
    callbacks: list[Any] = []
    out = Path(args.out)
    if args.mode == "writer":
        callbacks.append(ls.PredictionWriter(out / "preds.parquet", overwrite=True))
    strategy: Any = ls.SyncDDPStrategy() if args.strategy == "ddp_sync" else "ddp"
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, logger=False, callbacks=callbacks,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        max_epochs=1, limit_val_batches=0 if args.mode == "fit" else None)
    model = Model()
    with PeakRSS() as peak:
        start = time.perf_counter()
        if args.mode == "validate":
            trainer.validate(model, loader, verbose=False)
        elif args.mode == "fit":
            trainer.fit(model, loader)
        else:
            trainer.predict(model, loader, return_predictions=False)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    elapsed = trainer.strategy.reduce(elapsed, reduce_op="max")
    if trainer.global_rank == 0:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        print("RESULT " + json.dumps({"growth": peak.peak - peak.base, "anon": peak.anon_peak - peak.anon_base,
                                      "seconds": float(elapsed), "metrics": metrics}),
              flush=True)


def _launch(args: argparse.Namespace, mode: str, strategy: str, n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as out:
        cmd = [sys.executable, __file__, "--one", "--mode", mode, "--strategy", strategy, "--n", str(n),
               "--batch", str(args.batch), "--devices", str(args.devices), "--out", out]
        if args.shuffle:
            cmd.append("--shuffle")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])  # type: ignore[no-any-return]
    raise RuntimeError(f"{mode}/{strategy}/{n} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e7])
    p.add_argument("--modes", nargs="+", default=["validate", "predict", "writer"],
                   choices=["validate", "predict", "writer", "fit"])
    p.add_argument("--strategies", nargs="+", default=["ddp_sync", "ddp"], choices=["ddp_sync", "ddp"])
    p.add_argument("--shuffle", action="store_true", help="shuffle=True in the loader (a permutation per epoch)")
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None, help="also write every figure to this file")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="validate", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="ddp_sync", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        _one(args)
        return
    print(f"rank-0 peak RSS growth, {args.devices} gloo ranks, batch {args.batch}, shuffle={args.shuffle}")
    print(f"{'mode':<9} {'N':>11} {'strategy':<9} {'growth MiB':>11} {'anon MiB':>9} {'B/sample':>9} "
          f"{'us/sample':>10}  values")
    rows = []
    for mode in args.modes:
        for size in args.sizes:
            n = int(size)
            figures = {}
            for strategy in args.strategies:
                r = _launch(args, mode, strategy, n)
                figures[strategy] = r
                vals = "  ".join(f"{k} {v:.6f}" for k, v in sorted(r["metrics"].items()))
                print(f"{mode:<9} {n:>11} {strategy:<9} {r['growth'] / 2**20:>11.1f} {r['anon'] / 2**20:>9.1f} "
                      f"{r['growth'] / n:>9.2f} {r['seconds'] / n * 1e6:>10.3f}  {vals}", flush=True)
                rows.append({"mode": mode, "n": n, "strategy": strategy, **r})
            if len(figures) == 2:
                a, b = figures["ddp_sync"], figures["ddp"]
                print(f"{'':<9} {'':>11} {'ratio':<9} {a['growth'] / max(b['growth'], 1):>10.2f}x "
                      f"{a['anon'] / max(b['anon'], 1):>8.2f}x {'':>9} "
                      f"{a['seconds'] / b['seconds']:>9.2f}x  (ddp_sync / ddp)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
