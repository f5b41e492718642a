"""A Lightning fit under ``strategy="ddp_sync_ft"`` (a process per replica group, or P under
``lsync-ft-run --nproc-per-replica P``: ``devices=P``), for tests/test_ft.py.

Under lsync-ft-run: python tests/scripts/fit_ft.py --out DIR [--steps 40] [--samples 640] [--kill-at S [S2 ...]] [--stop-at S] [--ft-timeout SEC] [--alone-sleep 0.3] [--dropout P] [--no-seed] [--invariant] [--early-stop] [--timer] [--batchnorm] [--scheduler] [--bucket-cap-mb MB] [--val] [--manual]
Without it (the control): python tests/scripts/fit_ft.py --out DIR --control [--control-devices N] (Lightning's
2-rank (N-rank) ddp_sync run of the same model, seed and data; each rank takes the shard a replica group's
process takes: rank g * P + r that of group g's process r).

``--fsdp``: the MLP's layers are sharded with FSDP2 (``fully_shard`` in ``configure_model``) over the group's
processes, under ``strategy="model_parallel_sync_ft"`` (the control: ``model_parallel_sync``); the weights
recorded are the full ones.

An MLP with dropout (``--dropout``, 0.1), momentum SGD, 640 shuffled samples, 16 a group a step. ``--kill-at S``: group 1 SIGKILLs
itself in its first life in the middle of step S + 1 (before its backward) (lsync-ft-run restarts it; it recovers from group 0;
``--kill-at S S2``: in its second life at S2 + 1 too). ``--stop-at S``: group 1 SIGSTOPs itself there instead (frozen), and
group 0 sleeps ``--alone-sleep`` after each step it trains without every group, and, left alone after a fault,
first waits until the lost group's next life has started (so it is still training when group 1 is back, however
slow the restart on a loaded machine).
Each group appends one JSON line a step to OUT/group<g>.log and one an epoch (its logged epoch means) to
OUT/group<g>.epochs, and writes OUT/group<g>.pt (weights, state_dict, report) at the end of fit; a group's
process r > 0 writes OUT/group<g>r<r>.* instead. ``--kill-rank R``: which process of group 1 dies (0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync as ls
from _ft_pacing import AlonePacer, announce_restart  # (tests/scripts/, the script's own directory)


class Model(L.LightningModule):
    def __init__(self, dropout: float, batchnorm: bool = False, invariant: bool = False,
                 scheduler: bool = False, fsdp: bool = False) -> None:
        super().__init__()
        self.invariant, self.scheduler, self.fsdp = invariant, scheduler, fsdp
        norm = [nn.BatchNorm1d(32)] if batchnorm else []
        self.net = nn.Sequential(nn.Linear(8, 32), *norm, nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 1))

    def configure_model(self) -> None:  # (--fsdp) each Linear a unit of FSDP2 over the group's processes
        if not self.fsdp or isinstance(self.net[0].weight, DTensor):
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("loss", loss)
        if self.invariant:  # per group under ddp_sync_ft: the group's own value, however the global batch is split
            self.log("loss_synced", loss, sync_dist=True)
        self.log("loss_mean", loss, on_step=False, on_epoch=True)  # per group: each step's value counted once
        # per group, never synced: group 1 alone asks EarlyStopping to stop (--early-stop)
        self.log("group_flag", float(os.environ.get("REPLICA_GROUP_ID") == "1"), on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):  # (--val) uses BatchNorm's running statistics
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(-1), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)
        if not self.scheduler:
            return optimizer
        # (--scheduler) the learning rate changes every 3 steps: a restored scheduler one step off shows in the weights
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ManualModel(Model):
    """The same model under manual optimisation (``--manual``), which ``ddp_sync_ft`` refuses before any step."""

    def __init__(self, dropout: float) -> None:
        super().__init__(dropout)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()
        return loss


class Steps(L.Callback):
    def __init__(self, out: Path, group: int, life: int, kill_at: list[int], alone_sleep: float,
                 stop_at: int = -1, rank: int = 0, kill_rank: int = 0) -> None:
        self.out, self.group, self.life = out, group, life
        self.name = f"group{group}" if rank == 0 else f"group{group}r{rank}"
        self.dies = group == 1 and rank == kill_rank
        self.kill_at = kill_at[life] if life < len(kill_at) else -1
        self.stop_at = stop_at if life == 0 else -1
        self.faulty = max(kill_at) >= 0 or stop_at >= 0
        self.first_fault = kill_at[0] if kill_at[0] >= 0 else stop_at  # (group 1's first life)
        self.pacer = AlonePacer(out, alone_sleep)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        # mid-step, once the quorum of step kill_at + 1 is formed: group 0 waits in the gradient all-reduce. A restarted
        # life that healed past its kill_at (a slow restart) dies in its first step instead.
        if self.dies and 0 <= self.kill_at <= trainer.global_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.dies and trainer.global_step == self.stop_at:
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen, until lsync-ft-run's --stopped-timeout ends it

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._epoch_means(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._epoch_means(trainer)

    def _epoch_means(self, trainer) -> None:  # the epoch that ended: its logged means, as this group saw them
        if "loss_mean" in trainer.callback_metrics:
            line = {"epoch_end": trainer.current_epoch, "life": self.life,
                    **{k: float(v) for k, v in trainer.callback_metrics.items() if not k.startswith("ft/")}}
            with open(self.out / f"{self.name}.epochs", "a") as f:
                f.write(json.dumps(line) + "\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        report = dict(getattr(trainer.strategy, "ft_report", {}))
        weights = full_weights(pl_module)
        line = {"life": self.life, "pid": os.getpid(), "step": trainer.global_step, "t": time.time(), "epoch": trainer.current_epoch, "batch_idx": batch_idx,
                "batch": float(batch[1].sum()), "weights": float(weights.double().abs().sum()), **report,
                **{k: float(trainer.callback_metrics[k]) for k in ("loss", "loss_synced") if k in trainer.callback_metrics}}
        with open(self.out / f"{self.name}.log", "a") as f:
            f.write(json.dumps(line) + "\n")
        groups = int(os.environ.get("NUM_REPLICA_GROUPS", "2"))
        alone = self.group == 0 and 0 < report.get("participants", groups) < groups and self.faulty
        self.pacer.after_step(alone, after_fault=trainer.global_step > self.first_fault >= 0)


def full(t: torch.Tensor) -> torch.Tensor:
    """``t``, or the whole of it where it is a DTensor (FSDP2's shard: gathered over the group)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_weights(module: nn.Module) -> torch.Tensor:
    return torch.cat([full(t.detach()).flatten() for t in module.parameters()])


def data(seed: int = 0, n: int = 640) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x @ torch.linspace(-1, 1, 8) + 0.1 * torch.randn(n, generator=g))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, nargs="+", default=[-1], help="group 1's step to die in (or its first step after it), a life each")
    p.add_argument("--stop-at", type=int, default=-1, help="group 1 SIGSTOPs itself in this step (first life)")
    p.add_argument("--ft-timeout", type=float, default=30.0, help="FaultTolerantDDPStrategy(timeout=)")
    p.add_argument("--quorum-timeout", type=float, default=120.0, help="FaultTolerantDDPStrategy(quorum_timeout=)")
    p.add_argument("--restart-delay", type=float, default=0.0, help="group 1 sleeps this long in a restarted life")
    p.add_argument("--alone-sleep", type=float, default=0.0)
    p.add_argument("--control", action="store_true")
    p.add_argument("--control-devices", type=int, default=2, help="the control's ranks (without --invariant)")
    p.add_argument("--kill-rank", type=int, default=0, help="the process of group 1 that --kill-at/--stop-at stop")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d layer (running statistics: buffers)")
    p.add_argument("--scheduler", action="store_true", help="a StepLR scheduler stepped every step (step_size 3)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="DDP's bucket_cap_mb (0.0002: this model's gradients in 4 buckets, in flight at once)")
    p.add_argument("--sync-bn", action="store_true", help="Trainer(sync_batchnorm=True)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 in each group: model_parallel_sync_ft")
    p.add_argument("--val", action="store_true", help="a validation loader, every 10 steps (val_loss, sync_dist)")
    p.add_argument("--no-seed", action="store_true", help="the mistake: no seed every group knows")
    p.add_argument("--early-stop", action="store_true",
                   help="EarlyStopping on a per-group value: only group 1 wants to stop, at the end of epoch 0")
    p.add_argument("--timer", action="store_true",
                   help="Timer in every group: group 0's runs out after 1 s of training, group 1's after an hour")
    p.add_argument("--ckpt-dir", default=None,
                   help="a ModelCheckpoint (every 2 steps, last.ckpt) in this directory; '{group}' becomes the group")
    p.add_argument("--manual", action="store_true", help="manual optimisation (automatic_optimization = False)")
    p.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=)")
    p.add_argument("--samples", type=int, default=640, help="training samples (641: epoch 0's last step has 1 row)")
    p.add_argument("--invariant", action="store_true",
                   help="world_size_invariant=True: the loader's batch is the global one (32); --control runs 1 process")
    args = p.parse_args()
    if args.restart_delay and os.environ.get("REPLICA_GROUP_ID") == "1" and os.environ.get("LSYNC_FT_RESTART", "0") != "0":
        time.sleep(args.restart_delay)  # a slow restart: the others may finish the run meanwhile
    if not args.no_seed:
        L.seed_everything(7, verbose=False)
    model = (ManualModel(args.dropout) if args.manual
             else Model(args.dropout, args.batchnorm, args.invariant, args.scheduler, args.fsdp))
    if args.control:
        group, life, rank = int(os.environ.get("LOCAL_RANK", "0")), 0, 0
        strategy: object = (ls.SyncModelParallelStrategy(world_size_invariant=args.invariant) if args.fsdp else
                            ls.SyncDDPStrategy(world_size_invariant=args.invariant, bucket_cap_mb=args.bucket_cap_mb))
        devices = 1 if args.invariant else args.control_devices
    else:
        group, life = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["LSYNC_FT_RESTART"])
        kind = ls.FaultTolerantModelParallelStrategy if args.fsdp else ls.FaultTolerantDDPStrategy
        strategy = kind(world_size_invariant=args.invariant, timeout=args.ft_timeout,
                        quorum_timeout=args.quorum_timeout, bucket_cap_mb=args.bucket_cap_mb)
        devices, rank = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))  # torchrun's
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=args.steps, logger=False,
                        sync_batchnorm=args.sync_bn, accumulate_grad_batches=args.accumulate,
                        **({"val_check_interval": 10} if args.val else {}),
                        enable_checkpointing=args.ckpt_dir is not None, enable_progress_bar=False,
                        enable_model_summary=False,
                        callbacks=[Steps(args.out, group, life, args.kill_at, args.alone_sleep, args.stop_at, rank,
                                         args.kill_rank)]
                        + ([L.pytorch.callbacks.ModelCheckpoint(args.ckpt_dir.format(group=group), save_last=True,
                                                                every_n_train_steps=2)] if args.ckpt_dir else [])
                        + ([L.pytorch.callbacks.EarlyStopping("group_flag", mode="max", stopping_threshold=0.5,
                                                               check_on_train_epoch_end=True)] if args.early_stop else [])
                        + ([L.pytorch.callbacks.Timer(timedelta(seconds=1 if group == 0 else 3600))] if args.timer
                           else []))
    val = DataLoader(data(seed=1, n=96), batch_size=16) if args.val else None
    if not args.control and life > 0 and rank == 0:
        announce_restart(args.out, group, life)  # (group 0 paces itself by it: wait_for_restarts)
    trainer.fit(model, DataLoader(data(n=args.samples), batch_size=32 if args.invariant else 16, shuffle=True), val)
    weights = full_weights(model)
    torch.save({"weights": weights, "state": {k: full(v) for k, v in model.state_dict().items()}, "life": life, "global_step": trainer.global_step,
                "report": dict(getattr(trainer.strategy, "ft_report", {}))},
               args.out / (f"group{group}.pt" if rank == 0 else f"group{group}r{rank}.pt"))


if __name__ == "__main__":
    main()
