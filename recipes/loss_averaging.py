"""Averaging a loss or metric across ranks for logging: all_reduce(mean), sum / world size, weighted.

    python recipes/loss_averaging.py                                  # 2 CPU processes (gloo)
    python recipes/loss_averaging.py --accelerator gpu --devices 4    # 4 GPUs (NCCL)

DDP averages gradients, not the numbers you log: each rank's `loss` is its own batch's loss. To
log one value for the run, reduce it. Every rank must call the reduction (it is a collective), and
it works in place, so reduce a detached *copy*, never the tensor autograd still needs.
When ranks average over different numbers of items (here: ignored labels, as with padding tokens),
the mean of per-rank means is not the mean over all items: reduce (sum, count) and divide.
Each rank prints its own loss; rank 0 prints the reductions and checks them against those values.
"""

import argparse
import math

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync  # noqa: F401  (registers strategy="ddp_sync")
from lightning_sync.collectives import all_reduce, gather_objects


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 4)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y, ignore_index=-100)  # mean over valid labels
        n = (y != -100).sum().to(loss.dtype)
        print(f"rank {self.global_rank} step {self.global_step} loss {loss.item()!r} n {int(n)}", flush=True)

        mean = all_reduce(loss.detach().clone(), op="mean")  # clone: all_reduce works in place
        by_hand = all_reduce(loss.detach().clone(), op="sum") / self.trainer.world_size  # the same, spelled out
        total = all_reduce(torch.stack([loss.detach() * n, n]), op="sum")  # [sum of losses, item count]
        weighted = total[0] / total[1]
        # Lightning's own way to log the same mean (it all-reduces at every logged step):
        self.log("train_loss", loss, on_step=True, sync_dist=True, reduce_fx="mean")

        # The check: the reduced values against each rank's own loss, gathered as plain floats.
        per_rank = gather_objects((loss.item(), int(n)))
        if self.global_rank == 0:
            expect_mean = sum(v for v, _ in per_rank) / len(per_rank)
            expect_weighted = sum(v * k for v, k in per_rank) / sum(k for _, k in per_rank)
            assert math.isclose(mean.item(), expect_mean, rel_tol=1e-6), (mean, expect_mean)
            assert math.isclose(by_hand.item(), mean.item(), rel_tol=1e-6)
            assert math.isclose(weighted.item(), expect_weighted, rel_tol=1e-6)
            print(f"step {self.global_step} mean {mean.item()!r} sum/world {by_hand.item()!r} "
                  f"weighted {weighted.item()!r} (checked against {len(per_rank)} per-rank values)", flush=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=10)
    args = p.parse_args()

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 8, generator=g), torch.randint(0, 4, (256,), generator=g)
    y[torch.rand(256, generator=g) < 0.3] = -100  # ~30% ignored labels: per-rank item counts differ
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy="ddp_sync",
                        max_steps=args.max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Classifier(), loader)


if __name__ == "__main__":
    main()
