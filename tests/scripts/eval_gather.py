"""Runs ValidationGather through fit, validate, test and predict on N ranks; each rank writes OUT/<phase>.rank{r}.json.

python tests/scripts/eval_gather.py --out DIR [--strategy ddp_sync] [--devices 2] [--phase all|small|mismatch]

``all``: fit (two validation loaders: injected sampler on 1001 and 7 samples, batch 4) -> validate
(user DistributedSampler shuffled with 2 workers; user DistributedSampler drop_last) -> test (3
samples < world x batch; a rank with zero samples) -> predict (custom sampler -> Lightning's
DistributedSamplerWrapper; a custom BatchSampler). ``small``: validate + test only. ``mismatch``:
rank 1 returns an extra key; every rank records the error it raised.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Sampler
from torchmetrics.classification import BinaryAUROC
from torchmetrics.functional.classification import binary_accuracy

import lightning_sync as ls

DIM = 8


def features(i: int) -> torch.Tensor:
    return torch.randn(DIM, generator=torch.Generator().manual_seed(10_000 + i))


class Points(Dataset):
    """Deterministic binary classification: x from the index, y a noisy rule, a name per sample."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, str]:
        x = features(i)
        noise = torch.randn((), generator=torch.Generator().manual_seed(i))
        return x, (x[0] + x[1] + 0.8 * noise > 0).long(), f"s{i}"


def tokens(i: int) -> torch.Tensor:
    """A ragged per-sample output: i % 5 tokens."""
    return torch.arange(i % 5, dtype=torch.int64) + 1000 * i


class Model(L.LightningModule):
    def __init__(self, mismatch: bool = False, bad: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)  # identical on every rank without any broadcast (validate/test skip the DDP wrap)
        self.net = nn.Linear(DIM, 1)
        self.mismatch = mismatch
        self.bad = bad  # a BAD_STEPS scenario
        self.allow_zero_length_dataloader_with_multiple_devices = True
        self.hook_calls: list[tuple[str, int, int]] = []
        self.weights_at_validation: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return nn.functional.binary_cross_entropy_with_logits(self(x), y.float())

    def _eval_step(self, batch: Any, stage: str) -> dict[str, Any]:
        x, y, names = batch
        prob = torch.sigmoid(self(x))
        # the logging trap: a per-batch accuracy averaged by Lightning over the padded set (validation
        # only: with a rank that has no batches, as in the test phase, this per-dataloader sync would hang)
        if stage == "val":
            self.log(f"{stage}_acc_sync_dist", binary_accuracy(prob, y), sync_dist=True, batch_size=len(y))
        out: dict[str, Any] = {"preds": prob, "target": y, "names": list(names),
                               "tokens": [tokens(int(n[1:])) for n in names],
                               "loss": torch.tensor(0.0)}  # a scalar: skipped with a warning
        if self.mismatch and self.global_rank == 1:
            out["extra"] = prob
        return out

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        if self.bad:
            return bad_step(self, self._eval_step(batch, "val"), batch_idx)
        return self._eval_step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
        return self._eval_step(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
        return self._eval_step(batch, "predict")

    def on_validation_gathered(self, outputs: dict[str, Any], dataloader_idx: int) -> None:
        self.hook_calls.append(("validate", dataloader_idx, len(outputs["index"])))
        self.weights_at_validation = torch.cat([self.net.weight.flatten(), self.net.bias]).tolist()

    def on_test_gathered(self, outputs: dict[str, Any], dataloader_idx: int) -> None:
        self.hook_calls.append(("test", dataloader_idx, len(outputs["index"])))

    def on_predict_gathered(self, outputs: dict[str, Any], dataloader_idx: int) -> None:
        self.hook_calls.append(("predict", dataloader_idx, len(outputs["index"])))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Reversed(Sampler[int]):
    """A custom (non-distributed) sampler: Lightning wraps it in DistributedSamplerWrapper."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


class PairsFirst(BatchSampler):
    """A custom batch sampler: emits the batches in reverse order."""

    def __iter__(self) -> Iterator[list[int]]:
        return iter(list(super().__iter__())[::-1])


class RankZeroOnly(DistributedSampler):
    """Rank 0 gets every sample, the other ranks none: a rank with zero real samples."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.dataset)) if self.rank == 0 else [])  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self.dataset) if self.rank == 0 else 0  # type: ignore[arg-type]


def encode(out: dict[str, Any]) -> dict[str, Any]:
    enc: dict[str, Any] = {}
    for key, value in out.items():
        if isinstance(value, torch.Tensor):
            enc[key] = value.tolist()
        elif key == "tokens":
            enc[key] = [t.tolist() for t in value]
        else:
            enc[key] = list(value)
    return enc


#: One rank (or every rank) returns something ValidationGather cannot gather exactly.
BAD_STEPS = ("rows_first_batch", "rows_second_batch", "float_first_batch", "float_every_rank", "scalar_tensor")


def bad_step(model: Model, out: dict[str, Any], batch_idx: int) -> Any:
    rank, bad = model.global_rank, model.bad
    if bad == "rows_first_batch" and rank == 1 and batch_idx == 0:
        out["preds"] = out["preds"][:-1]  # one row short: a wrong row count on rank 1's first batch
    elif bad == "rows_second_batch" and rank == 1 and batch_idx == 1:
        out["preds"] = out["preds"][:-1]
    elif bad == "float_first_batch" and rank == 1:
        return 0.5  # a Python float from every step of rank 1
    elif bad == "float_every_rank":
        return float(out["preds"].mean())
    elif bad == "scalar_tensor" and rank == 1:
        return out["preds"].mean()  # a 0-d tensor
    return out


def trainer(args: argparse.Namespace, callbacks: list[L.Callback], **kwargs: Any) -> L.Trainer:
    return L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=args.strategy, logger=False,
                     callbacks=callbacks, **kwargs)


def metrics() -> dict[str, Any]:
    return {"{stage}_acc": lambda o: binary_accuracy(o["preds"], o["target"]), "{stage}_auroc": BinaryAUROC()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", default="ddp_sync")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="cpu", help="gpu: the tests' gpu tier (one process per GPU)")
    p.add_argument("--phase", default="all")
    args = p.parse_args()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    out = Path(args.out)
    report: dict[str, Any] = {}

    def save(name: str) -> None:
        (out / f"{name}.rank{rank}.json").write_text(json.dumps(report))

    if args.phase == "mismatch":
        gather = ls.ValidationGather()
        t0 = time.monotonic()
        try:
            trainer(args, [gather]).validate(Model(mismatch=True), DataLoader(Points(7), batch_size=4), verbose=False)
            report["error"] = None
        except ls.RankMismatchError as err:
            report["error"] = str(err)
        report["seconds"] = time.monotonic() - t0
        save("mismatch")
        return

    if args.phase == "badrank":  # every scenario in one launch: each must raise on every rank
        for bad in BAD_STEPS:
            gather = ls.ValidationGather(metrics={"val_acc": lambda o: binary_accuracy(o["preds"], o["target"])})
            t0 = time.monotonic()
            try:
                trainer(args, [gather]).validate(Model(bad=bad), DataLoader(Points(40), batch_size=5), verbose=False)
                report[bad] = {"error": None, "metrics": {k: float(v) for k, v in gather.metrics.items()},
                               "rows": {i: len(o["index"]) for i, o in gather.gathered.items()}}
            except Exception as err:  # noqa: BLE001 - the test checks the type and the words
                report[bad] = {"error": f"{type(err).__name__}: {err}"}
            report[bad]["seconds"] = time.monotonic() - t0
            # Every Trainer sets up its own process group; a rank that finished tearing down the failed one
            # first must not rendezvous with a peer still inside it: meet on the file system in between.
            (out / f"{bad}.done{rank}").touch()
            deadline = time.monotonic() + 60
            while not all((out / f"{bad}.done{r}").exists() for r in range(args.devices)):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank}: a peer never finished scenario {bad}")
                time.sleep(0.1)
        save("badrank")
        return

    model = Model()
    if args.phase == "all":
        # ---- fit: two validation loaders, Lightning injects its padded DistributedSampler
        gather = ls.ValidationGather(metrics=metrics())
        ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "ckpt", monitor="val_acc/dataloader_idx_0", mode="max")
        fit = trainer(args, [gather, ckpt], max_epochs=1, num_sanity_val_steps=2)
        fit.fit(model, DataLoader(Points(64), batch_size=8, shuffle=True),
                [DataLoader(Points(1001), batch_size=4), DataLoader(Points(7), batch_size=4)])
        report["fit"] = {
            "gathered": {i: encode(o) for i, o in gather.results["validate"].items()},
            "callback_metrics": {k: float(v) for k, v in fit.callback_metrics.items()},
            "best_score": float(ckpt.best_model_score) if ckpt.best_model_score is not None else None,
            "weights": model.weights_at_validation,
        }

    # ---- validate: the user's own DistributedSampler, shuffled, with workers; and drop_last
    world = args.devices
    weights = torch.cat([model.net.weight.flatten(), model.net.bias]).tolist()
    everyone = ls.ValidationGather(metrics=metrics())
    rank0 = ls.ValidationGather(rank_zero_only=True, offload_to_cpu=True, keys=["preds", "names"])
    val = trainer(args, [everyone, rank0])
    big = Points(1001)
    val.validate(model, [
        DataLoader(big, batch_size=4, num_workers=2, sampler=DistributedSampler(big, world, rank, shuffle=True, seed=3)),
        DataLoader(Points(7), batch_size=4, sampler=DistributedSampler(Points(7), world, rank, shuffle=False,
                                                                        drop_last=True)),
    ], verbose=False)
    report["validate"] = {
        "gathered": {i: encode(o) for i, o in everyone.gathered.items()},
        "rank0": {i: encode(o) for i, o in rank0.gathered.items()},
        "callback_metrics": {k: float(v) for k, v in val.callback_metrics.items()},
        "metric_samples": everyone.metric_samples,
        "weights": weights,
    }

    # ---- test: fewer samples than world x batch; a rank with zero samples
    gather = ls.ValidationGather(metrics={"{stage}_acc": lambda o: binary_accuracy(o["preds"], o["target"])})
    test = trainer(args, [gather])
    test.test(model, [DataLoader(Points(3), batch_size=4),
                      DataLoader(Points(5), batch_size=4, sampler=RankZeroOnly(Points(5), world, rank))], verbose=False)
    report["test"] = {"gathered": {i: encode(o) for i, o in gather.gathered.items()},
                      "callback_metrics": {k: float(v) for k, v in test.callback_metrics.items()}}

    if args.phase == "all":
        # ---- predict: a custom sampler (DistributedSamplerWrapper) and a custom batch sampler
        gather = ls.ValidationGather(stages=["predict"], metrics=metrics())
        pred = trainer(args, [gather])
        preds = pred.predict(model, [DataLoader(big, batch_size=4, sampler=Reversed(1001)),
                                     DataLoader(Points(11), batch_sampler=PairsFirst(range(11), 3, False))])
        report["predict"] = {"gathered": {i: encode(o) for i, o in gather.gathered.items()},
                             "metrics": {k: float(v) for k, v in gather.metrics.items()},
                             "lightning_rows": [sum(len(b["preds"]) for b in dl) for dl in preds]}  # type: ignore[union-attr]
    report["hook_calls"] = model.hook_calls
    save(args.phase)


if __name__ == "__main__":
    main()
