"""Exact validation under DDP: every sample counted once, by plain `self.log` and on the gathered set.

    python recipes/exact_validation.py                                  # 2 CPU processes (gloo)
    python recipes/exact_validation.py --strategy ddp                   # Lightning's padded way, to compare
    python recipes/exact_validation.py --accelerator gpu --devices 4    # 4 GPUs (NCCL)

Lightning's validation DistributedSampler pads every rank to the same length by repeating samples
(101 samples on 2 ranks: one is evaluated twice), and `self.log(..., sync_dist=True)` averages
per-rank means over that padded set. Under `strategy="ddp_sync"` (exact_eval=True, the default)
every sample goes to exactly one rank and the epoch mean is weighted by each rank's real sample
count, so the same `self.log` lines give the single-process numbers. `ls.ValidationGather` goes
further: it gathers each row with its dataset index once per epoch and computes the metrics on
exactly `range(len(dataset))`, identical on every rank. The recipe prints the count and accuracy
from `self.log`, the gathered accuracy, and the accuracy computed in one process over the whole set.
"""

import argparse

import lightning as L
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync as ls


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 3)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        preds = self.net(x).argmax(dim=1)
        # Ordinary Lightning logging: exact under ddp_sync, padded and a mean of rank means under ddp.
        self.log("val_acc_logged", (preds == y).float().mean(), sync_dist=True, batch_size=len(y))
        self.log("val_count_logged", float(len(y)), reduce_fx="sum", sync_dist=True)
        return {"preds": preds, "target": y}  # one row per sample; the callback adds the dataset index

    def on_validation_gathered(self, outputs: dict, dataloader_idx: int) -> None:
        index = outputs["index"].cpu()  # ascending, each dataset index exactly once, on every rank
        exact = index.equal(torch.arange(len(index)))
        print(f"rank {self.global_rank} gathered {len(index)} rows, index == range(N): {exact}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--size", type=int, default=101, help="data set size (odd: the sampler pads)")
    p.add_argument("--strategy", default="ddp_sync", choices=["ddp_sync", "ddp"])
    args = p.parse_args()

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.size, 8, generator=g), torch.randint(0, 3, (args.size,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    gather = ls.ValidationGather(metrics={"val_acc": torchmetrics.Accuracy(task="multiclass", num_classes=3)})
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=args.strategy, callbacks=[gather],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    torch.manual_seed(0)  # the same weights in every process (and in the single-process check below)
    model = Classifier()
    trainer.validate(model, loader)

    m = trainer.callback_metrics
    print(f"rank {trainer.global_rank} self.log: count {m['val_count_logged'].item():.0f} "
          f"acc {m['val_acc_logged'].item()!r}; gathered: acc {m['val_acc'].item()!r}", flush=True)
    if trainer.global_rank == 0:  # the reference: one process, the whole data set, no DDP
        with torch.no_grad():
            reference = (model.net(x).argmax(dim=1) == y).float().mean().item()
        print(f"single-process accuracy over all {args.size} samples {reference!r}", flush=True)


if __name__ == "__main__":
    main()
