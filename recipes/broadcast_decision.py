"""Broadcasting from rank 0: a hyperparameter, an early-stop decision, a checkpoint decision.

    python recipes/broadcast_decision.py                                  # 2 CPU processes (gloo)
    python recipes/broadcast_decision.py --accelerator gpu --devices 4    # 4 GPUs (NCCL)
    python recipes/broadcast_decision.py --show-mistake                   # also run the classic mistake

Rank 0 decides, `broadcast_object` hands the decision to everyone, then EVERY rank acts on it.
The mistake: `if rank == 0: <collective>`. A collective completes only when every rank has entered
it: plain torch.distributed hangs until the process-group timeout (30 min by default) or pairs the
call with whatever the others reach next. Under ddp_sync the same bug raises
CollectiveMismatchError on every rank within seconds, naming both lines, and ends that fit
(--show-mistake runs it after the real training). The same holds for `trainer.should_stop` set on
rank 0 only and for `trainer.save_checkpoint`, which every rank must call.
"""

import argparse
import secrets
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync as ls
from lightning_sync.collectives import broadcast_object, gather_objects


class Model(L.LightningModule):
    def __init__(self, stop_after: int, ckpt_dir: str) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.stop_after, self.ckpt_dir = stop_after, Path(ckpt_dir)
        self.best, self.epochs_run, self.last_loss = float("inf"), 0, 0.0

    def setup(self, stage: str) -> None:
        lr = secrets.choice([0.01, 0.02, 0.05]) if self.global_rank == 0 else None  # only rank 0 has it (OS entropy)
        self.lr = broadcast_object(lr)
        print(f"rank {self.global_rank} lr {self.lr}", flush=True)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.last_loss = loss.item()
        return loss

    def on_train_epoch_end(self) -> None:
        self.epochs_run += 1
        decision = None
        if self.global_rank == 0:  # rank 0 decides from what it alone sees: fine, no collective inside
            decision = {"stop": self.epochs_run >= self.stop_after, "save": self.last_loss < self.best}
            self.best = min(self.best, self.last_loss)
        decision = broadcast_object(decision)  # every rank calls it
        if decision["save"]:
            self.trainer.save_checkpoint(self.ckpt_dir / "best.ckpt")  # every rank calls it
        self.trainer.should_stop = decision["stop"]  # every rank stops at the same epoch

    def on_train_end(self) -> None:
        print(f"rank {self.global_rank} stopped after {self.epochs_run} epochs", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class RankZeroOnlyCollective(Model):  # the classic mistake: a collective inside `if rank == 0:`
    def setup(self, stage: str) -> None:  # (no lr broadcast this time)
        self.lr = 0.01

    def on_train_start(self) -> None:
        if self.global_rank == 0:  # WRONG: only rank 0 enters this collective
            broadcast_object("stop")
        gather_objects(self.global_rank)  # the next collective every rank reaches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-epochs", type=int, default=10)
    p.add_argument("--stop-after", type=int, default=3, help="rank 0 stops the run after this many epochs")
    p.add_argument("--ckpt-dir", default="outputs/recipes/broadcast_decision")
    p.add_argument("--show-mistake", action="store_true")
    args = p.parse_args()

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16)
    options = dict(accelerator=args.accelerator, devices=args.devices, strategy="ddp_sync", logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    L.Trainer(max_epochs=args.max_epochs, **options).fit(Model(args.stop_after, args.ckpt_dir), loader)

    if args.show_mistake:
        trainer = L.Trainer(max_epochs=1, **options)
        try:  # rank 0 broadcasts, the others gather: CollectiveMismatchError on every rank
            trainer.fit(RankZeroOnlyCollective(args.stop_after, args.ckpt_dir), loader)
        except ls.CollectiveMismatchError as err:
            print(f"rank {trainer.global_rank} caught CollectiveMismatchError: {err}", flush=True)


if __name__ == "__main__":
    main()
