"""A replica group dies mid-run; the other keeps training and the restarted one recovers from it (torchft).

    lsync-ft-run --replicas 2 --min-replicas 2 -- python recipes/fault_tolerant_ddp.py --kill-at 8
    lsync-ft-run --replicas 2 --min-replicas 2 --nproc-per-replica 2 -- python recipes/fault_tolerant_ddp.py --kill-at 8
    lsync-ft-run --replicas 2 --min-replicas 2 --nproc-per-replica 2 -- python recipes/fault_tolerant_ddp.py --kill-at 8 --fsdp

Each replica group is one ordinary Lightning run under `strategy="ddp_sync_ft"`: one process (`devices=1`), or the
P processes torchrun starts with `--nproc-per-replica P` (`devices=P`, read from torchrun's LOCAL_WORLD_SIZE); lsync-ft-run
(`pip install "lightning_sync[ft]"`) starts torchft's lighthouse on loopback and the groups, and restarts a group
that dies. `--kill-at S`: group 1 kills itself (SIGKILL) once, in the middle of step S + 1. Group 0's step is not committed,
so it runs it again once group 1 is back; group 1's `fit` (no `ckpt_path`) is restored from group 0's
checkpoint at that step, sent by torchft: no file, no step lost. With `--min-replicas 1` group 0 trains on alone
meanwhile and reports the data shards group 1 missed. Each group prints one line at the end; both name the
same weights. `--fsdp`: FSDP2 inside each group (`fully_shard` in `configure_model`, under
`strategy="model_parallel_sync_ft"`): process r of each group holds shard r, averages its gradient shards with
process r of the other group, and is sent process r's shards when its group recovers.
"""

from __future__ import annotations

import argparse
import os
import signal

import lightning as L
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync  # noqa: F401  (registers "ddp_sync_ft" and "model_parallel_sync_ft")


class Regressor(L.LightningModule):
    def __init__(self, fsdp: bool = False) -> None:
        super().__init__()
        self.fsdp = fsdp
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def configure_model(self) -> None:  # --fsdp: each Linear sharded over the group's processes
        if self.fsdp and not isinstance(self.net[0].weight, DTensor):
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class KillOnce(L.Callback):
    """Group 1, first life only: SIGKILL in the middle of step S + 1 (what a lost node looks like to the others)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        first_life = os.environ.get("LSYNC_FT_RESTART") == "0"
        if os.environ.get("REPLICA_GROUP_ID") == "1" and first_life and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 in each group (model_parallel_sync_ft)")
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)  # every group builds the same model and splits the data by this seed
    g = torch.Generator().manual_seed(1)
    x = torch.randn(960, 16, generator=g)
    data = TensorDataset(x, torch.sin(x.sum(-1)))
    model = Regressor(args.fsdp)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's, under --nproc-per-replica; else 1
    strategy = "model_parallel_sync_ft" if args.fsdp else "ddp_sync_ft"
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=args.max_steps,
                        callbacks=[KillOnce(args.kill_at)], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=16, shuffle=True))
    report = trainer.strategy.ft_report
    # (under FSDP2 each process holds a shard: full_tensor gathers the whole, a collective of the group)
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    weights = torch.cat([p.detach().flatten() for p in full]).double()
    if trainer.global_rank != 0:
        return  # (one line a group: its processes hold the same weights)
    print(f"replica group {os.environ['REPLICA_GROUP_ID']} (life {os.environ['LSYNC_FT_RESTART']}): step "
          f"{trainer.global_step}, weights checksum {weights.abs().sum().item():.10f}, committed "
          f"{report['committed']}, run again {report['redone']}, missing shards {report['missing_shards']}, "
          f"recovered {report['healed']}", flush=True)


if __name__ == "__main__":
    main()
