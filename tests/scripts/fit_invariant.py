"""One fit of the world-size invariance module; rank r writes OUT/rank{r}.pt (final weights, per-step losses, the
validation metric, global_step) and rank 0 OUT/done.json.

python tests/scripts/fit_invariant.py --out DIR --devices N [--workers W] [--strategy sync|ddp] [--epochs E]
    [--samples N] [--dropout P] [--stop-after S] [--resume CKPT] [--no-sync-bn] [--sum-loss]

The model is issue 41's: BatchNorm (sync_batchnorm=True), augmentation drawn in __getitem__, momentum SGD, 1001
shuffled samples, global batch 24 (under "sync" the loader's batch_size is the global batch; under Lightning's
"ddp", the control, each rank's loader has 24 // N), seed_everything(5). --stop-after S saves OUT/last.ckpt after S
training steps and stops; --resume continues a checkpoint to --epochs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_sync as ls

N_TRAIN, N_VAL, GLOBAL_BATCH = 1001, 101, 24


class Points(Dataset):
    def __init__(self, n: int, offset: int = 0, augment: bool = True) -> None:
        self.n, self.offset, self.augment = n, offset, augment

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.offset + i)
        x = torch.randn(6, generator=g)
        y = torch.tensor(float(x[:3].sum() > 0))
        if self.augment:
            x = x + 0.2 * torch.randn(6)  # the augmentation: the global generator (a worker's, or the main one)
        return x, y


class Model(L.LightningModule):
    def __init__(self, dropout: float, sum_loss: bool, fsdp: bool = False) -> None:
        super().__init__()
        norm = nn.LayerNorm(16) if fsdp else nn.BatchNorm1d(16)  # (FSDP2: no SyncBatchNorm)
        self.net = nn.Sequential(nn.Linear(6, 16), norm, nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 1))
        self.fsdp = fsdp
        self.sum_loss = sum_loss
        self.losses: list[float] = []
        self.val_acc = torchmetrics.classification.BinaryAccuracy()

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(out, y, reduction="sum" if self.sum_loss else "mean")
        self.losses.append(float(loss.detach()))
        return loss

    def configure_model(self) -> None:
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[4]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_acc.update(self.net(x).squeeze(-1), y)
        self.log("val_acc", self.val_acc, on_epoch=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--strategy", choices=("sync", "ddp", "fsdp"), default="sync")
    parser.add_argument("--per-rank", action="store_true",
                        help="under sync: world_size_invariant=False (per-rank batches of 24 // N)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=N_TRAIN)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--stop-after", type=int, default=-1)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--no-sync-bn", action="store_true")
    parser.add_argument("--sum-loss", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    L.seed_everything(5, verbose=False)
    model = Model(args.dropout, args.sum_loss, fsdp=args.strategy == "fsdp")
    if args.strategy == "fsdp":
        strategy = ls.SyncModelParallelStrategy(world_size_invariant=True, guard_timeout=60)
        batch = GLOBAL_BATCH
    elif args.strategy == "sync":
        strategy = ls.SyncDDPStrategy(world_size_invariant=not args.per_rank, guard_timeout=60)
        batch = GLOBAL_BATCH // args.devices if args.per_rank else GLOBAL_BATCH
    else:
        strategy, batch = "ddp", GLOBAL_BATCH // args.devices
        if not args.no_sync_bn:  # torch's SyncBatchNorm needs CUDA; the portable one runs on gloo
            model = ls.convert_sync_batchnorm(model)
    train = DataLoader(Points(args.samples), batch_size=batch, shuffle=True, num_workers=args.workers,
                       persistent_workers=args.workers > 0)
    val = DataLoader(Points(N_VAL, offset=10_000, augment=False), batch_size=16)
    callbacks = []
    if args.stop_after > 0:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=args.out, save_last=True, save_top_k=0,
                                                             every_n_train_steps=args.stop_after))
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=args.epochs,
                        max_steps=args.stop_after, sync_batchnorm=args.strategy == "sync" and not args.no_sync_bn, callbacks=callbacks,
                        logger=False, enable_checkpointing=bool(callbacks), enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, train, val, ckpt_path=args.resume)
    rank = trainer.global_rank
    if args.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"weights": weights, "losses": model.losses,
                "val_acc": float(trainer.callback_metrics.get("val_acc", -1.0)), "global_step": trainer.global_step},
               args.out / f"rank{rank}.pt")
    if rank == 0:
        (args.out / "done.json").write_text(json.dumps({"global_step": trainer.global_step}))


if __name__ == "__main__":
    main()
