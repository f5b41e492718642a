"""FSDP2 (``fully_shard`` in ``configure_model``) on 2 CPU ranks under Lightning's ModelParallelStrategy
or lightning_sync's SyncModelParallelStrategy; each run writes OUT/<tag>/rank{r}.json (and rank 0 the
full weights, OUT/<tag>/full.pt).

python tests/scripts/fit_fsdp2.py --out DIR --strategy model_parallel|model_parallel_sync --phase PHASE

``eval``: validate over 1001 samples (an ordinary ``self.log(..., sync_dist=True)`` of the batch MSE
and a torchmetrics MeanSquaredError). ``full`` / ``stop`` / ``resume``: 3 epochs of 50 samples (batch
4, 7 steps a rank), uninterrupted; stopped after step 10 with a sharded checkpoint every 5 steps;
resumed from that checkpoint (OUT/stop/last.ckpt). Every step records its batch's indices and the
augmentation drawn in ``__getitem__``. ``guard``: rank 0 alone calls ``dist.all_reduce`` at step 2;
``guardlog``: rank 0 alone logs a metric with ``sync_dist=True`` there.
``autostop`` / ``autoresume``: as ``stop`` / ``resume`` with ``resume="auto"`` (checkpoints in
OUT/autockpt; the resumed run gets no ``ckpt_path``). ``callbacks``: fit with ``ValidationGather`` (1001 validation samples) and ``ParameterConsistencyCheck``,
then ``trainer.predict`` with a ``PredictionWriter`` (OUT/callbacks/preds.parquet). ``drift``: as
``callbacks``, with a buffer that rank 0 alone updates. ``preempt`` (ranks started as ``srun`` starts
them, under a SLURM environment the test sets): rank r sends itself SLURM's requeue signal inside
step 6 + r, stopped 3 steps later; Lightning's requeue checkpoint is OUT/preempt/hpc_ckpt_1.ckpt.
``requeued``: resumed from it. ``tornstop``: as ``autostop`` (checkpoints in OUT/tornckpt), rank 1 dying
inside step 10's overwrite of last.ckpt; ``tornresume``: ``resume="auto"`` over OUT/tornckpt.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torchmetrics
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

import lightning_sync as ls

PREEMPT_STEP = 6  # preempt: SIGUSR1 inside global step 6 on rank 0, 7 on rank 1


class Points(Dataset):
    """Fixed features and targets; with ``augment`` a noise draw from the global generator (the rank's)."""

    def __init__(self, n: int, augment: bool = False) -> None:
        self.n, self.augment = n, augment

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, float, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        noise = float(torch.rand(1)) if self.augment else 0.0
        return i, x + 0.1 * noise, noise, (x[:2].sum() + 0.5 * (i % 3)).reshape(1)


def build() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))


class Model(L.LightningModule):
    def __init__(self, bad_step: int = -1, lr: float = 0.05, drift: bool = False, bad_log: bool = False) -> None:
        super().__init__()
        self.bad_log = bad_log
        self.drift = drift
        self.register_buffer("seen", torch.zeros(1))
        self.lr = lr
        self.steps: list[list[Any]] = []
        self.mse = torchmetrics.MeanSquaredError()
        self.bad_step = bad_step
        self.usr1_at = -1  # rank r sends itself SLURM's requeue signal (SIGUSR1) inside global step usr1_at + r

    def configure_model(self) -> None:
        if hasattr(self, "net"):  # called again by a later trainer call
            return
        self.net = build()  # under SyncModelParallelStrategy: the root seed, identical on every rank
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.usr1_at >= 0 and self.global_step == self.usr1_at + self.global_rank:
            os.kill(os.getpid(), signal.SIGUSR1)  # the ranks see SLURM's signal at different steps
        if self.global_step == self.bad_step and self.global_rank == 0:
            if self.bad_log:  # a metric synced on rank 0 only
                self.log("rank0_only", torch.ones(()), sync_dist=True)
            else:
                dist.all_reduce(torch.ones(1))  # the classic mistake: a collective on one rank only
        idx, x, aug, y = batch
        if not self.drift or self.global_rank == 0:
            self.seen += len(idx)  # a buffer every rank updates alike (drift: rank 0 alone)
        self.steps.append([self.current_epoch, idx.tolist(), [round(float(a), 7) for a in aug]])
        return nn.functional.mse_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.usr1_at >= 0 and self.global_step == self.usr1_at + 1 and self.global_rank == 1:
            # rank 1 lags behind after the step's last collective, so rank 0 starts the agreed requeue save
            # first (its path is where rank 1 must write too, whatever rank 1 then finds on disk)
            time.sleep(1.0)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, _, y = batch
        pred = self.net(x)
        self.log("val_mse", nn.functional.mse_loss(pred, y), sync_dist=True, batch_size=len(y))
        self.mse(pred, y)
        self.log("val_mse_metric", self.mse)
        return {"pred": pred, "target": y}

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        _, x, _, y = batch
        return {"pred": self.net(x).squeeze(1), "target": y.squeeze(1)}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def die_while_overwriting_last(strategy: Any) -> None:
    """Rank 1 dies inside step 10's overwrite of last.ckpt: the shards and meta.pt are written, its own
    state file is not (the fault is injected around the checkpoint part's hook; nothing else is replaced)."""
    part = strategy.part(ls.parts.CheckpointStatePart)
    after = part.after_save_checkpoint

    def dying(owner: Any, directory: Path | None) -> None:
        if (directory is not None and directory.name == "last.ckpt" and owner.global_rank == 1
                and owner.lightning_module.global_step == 10):
            os._exit(3)
        after(owner, directory)

    part.after_save_checkpoint = dying


def report(out: Path, trainer: L.Trainer, model: Model, **extra: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    r = trainer.global_rank
    if r == 0:
        torch.save({k: v.detach().clone() for k, v in full.items()}, out / "full.pt")
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    (out / f"rank{r}.json").write_text(json.dumps({"rank": r, "steps": model.steps, "metrics": metrics,
                                                   "seed": getattr(trainer.strategy, "seed", None), **extra}))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--strategy", default="model_parallel_sync")
    p.add_argument("--phase", required=True, choices=["eval", "autosizes", "full", "stop", "resume", "guard", "callbacks", "drift", "autostop", "autoresume", "guardlog",
                                                    "preempt", "requeued", "tornstop", "tornresume"])
    p.add_argument("--accelerator", default="cpu", help="gpu: the tests' gpu tier (one process per GPU)")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05, help="SGD's (one rank's batches alone need a smaller one)")
    return p.parse_args()


def main(args: argparse.Namespace) -> None:
    out = args.out / args.phase
    sync = args.strategy == "model_parallel_sync"
    torch.manual_seed(int(os.environ.get("LOCAL_RANK", 0)) + 11)  # ranks start apart
    # FSDP2 over both ranks: Lightning's "auto" sizes are data_parallel=num_nodes (1), tensor_parallel=2
    kwargs: dict[str, Any] = {"data_parallel_size": args.devices, "tensor_parallel_size": 1}
    if args.phase == "autosizes":  # "eval" with the strategy's default sizes, as strategy="model_parallel_sync" gets
        kwargs = {}
    if sync:
        kwargs.update(seed=1234, guard_timeout=10)
    if args.phase in ("resume", "autoresume", "requeued", "tornresume") and sync:
        kwargs.pop("seed")  # the checkpoint's root seed is adopted
    if (args.phase.startswith("auto") or args.phase == "tornresume") and sync:
        kwargs["resume"] = "auto"
    strategy = (ls.SyncModelParallelStrategy(**kwargs) if sync
                else L.pytorch.strategies.ModelParallelStrategy(**kwargs))
    callbacks: list[L.Callback] = []
    max_steps, ckpt = -1, None
    if args.phase in ("stop", "autostop", "tornstop"):
        max_steps = 10
    if args.phase in ("stop", "autostop", "autoresume", "tornstop", "tornresume"):
        where = (args.out / "autockpt" if args.phase.startswith("auto") else
                 args.out / "tornckpt" if args.phase.startswith("torn") else out)
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=where, every_n_train_steps=5, save_top_k=-1,
                                                             save_last=True))
    if args.phase == "resume":
        ckpt = str(args.out / "stop" / "last.ckpt")
    if args.phase == "preempt":  # under a SLURM environment (the test sets one): Lightning's requeue handler
        max_steps = PREEMPT_STEP + 3
    if args.phase == "requeued":
        ckpt = str(args.out / "preempt" / "hpc_ckpt_1.ckpt")
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy, max_epochs=3,
                        max_steps=max_steps,
                        logger=False, enable_checkpointing=bool(callbacks), callbacks=callbacks,
                        num_sanity_val_steps=0, limit_val_batches=None if args.phase in ("eval", "autosizes") else 0,
                        default_root_dir=out)
    model = Model(bad_step=2 if args.phase.startswith("guard") else -1, lr=args.lr, drift=args.phase == "drift",
                  bad_log=args.phase == "guardlog")
    model.usr1_at = PREEMPT_STEP if args.phase == "preempt" else -1
    if args.phase == "tornstop":
        die_while_overwriting_last(strategy)
    if args.phase in ("callbacks", "drift"):
        callbacks_phase(args, out, model, kwargs, sync)
        return
    if args.phase == "eval":
        trainer.validate(model, DataLoader(Points(1001), batch_size=16))
        report(out, trainer, model)
        return
    loader = DataLoader(Points(50, augment=True), batch_size=4, shuffle=True)
    if args.phase.startswith("guard"):
        try:
            trainer.fit(model, loader)
        except Exception as err:  # noqa: BLE001 - every rank records what it raised
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"error": f"{type(err).__name__}: {err}", "chain": __import__("traceback").format_exception(err)}))
            raise
        return
    trainer.fit(model, loader, ckpt_path=ckpt)
    if args.phase == "autosizes":  # and the evaluation, as "eval" makes it
        trainer.validate(model, DataLoader(Points(1001), batch_size=16))
    part = trainer.strategy.part(ls.parts.RequeuePart) if sync else None
    requeue = part.requeue if part is not None else None
    report(out, trainer, model, global_step=trainer.global_step, requeue_checkpoints=getattr(requeue, "handled", 0))
    if args.phase in ("preempt", "requeued"):  # ranks started as srun does: all written before any exits
        trainer.strategy.barrier("reports-written")


def callbacks_phase(args: argparse.Namespace, out: Path, model: Model, kwargs: dict[str, Any], sync: bool) -> None:
    gather = ls.ValidationGather(metrics={
        "{stage}_gathered_mse": lambda o: float(((o["pred"] - o["target"]) ** 2).mean())})
    check = ls.ParameterConsistencyCheck(every_n_steps=3, optimizer_state=True)
    strategy = (ls.SyncModelParallelStrategy(**kwargs) if sync
                else L.pytorch.strategies.ModelParallelStrategy(**kwargs))
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy, max_epochs=2,
                        logger=False, enable_checkpointing=False, callbacks=[gather, check], num_sanity_val_steps=0,
                        default_root_dir=out)
    val = DataLoader(Points(1001), batch_size=16)
    try:
        trainer.fit(model, DataLoader(Points(50, augment=True), batch_size=4, shuffle=True), val)
    except Exception as err:  # noqa: BLE001 - every rank records what it raised
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"error": f"{type(err).__name__}: {err}"}))
        raise
    index = gather.gathered[0]["index"].tolist() if gather.gathered else None
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    writer = ls.PredictionWriter(out / "preds.parquet")
    strategy = (ls.SyncModelParallelStrategy(**kwargs) if sync
                else L.pytorch.strategies.ModelParallelStrategy(**kwargs))
    predictor = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy, logger=False,
                          callbacks=[writer], default_root_dir=out)
    predictor.predict(model, DataLoader(Points(1001), batch_size=16), return_predictions=False)
    report(out, trainer, model, index=index, fit_metrics=metrics, checks=check.checks,
           manifest_rows=writer.manifest["rows"] if writer.manifest else None)


if __name__ == "__main__":
    from _baseline_exit import end_baseline  # (tests/scripts/: on the path of a script run)

    arguments = parse()
    main(arguments)
    if arguments.strategy == "model_parallel":
        end_baseline()
