"""DDP with Lightning: each rank sees different data, DDP all-reduces the gradients, replicas stay equal.

    python recipes/ddp_basics.py                                  # 2 CPU processes (gloo)
    python recipes/ddp_basics.py --accelerator gpu --devices 4    # 4 GPUs (NCCL)
    torchrun --standalone --nproc_per_node=2 recipes/ddp_basics.py

What syncs what: at wrap time DDP broadcasts rank 0's parameters and buffers; during backward it
all-reduces (averages) every gradient, so each optimizer step applies the same update on every rank.
Nothing else is synced for you: a loss you log, a metric, a decision, the data order.
The mistake to avoid: `dist.all_reduce(model.weight)` by hand. DDP already did the work; doing it
again multiplies the weights by the world size (sum) or just burns a collective (mean).
"""

import argparse
import hashlib
from collections.abc import Iterable

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync as ls


def digest(tensors: Iterable[torch.Tensor]) -> str:
    flat = torch.cat([t.detach().flatten().cpu() for t in tensors])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:12]


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if batch_idx == 0:  # different data on every rank: the local losses differ
            print(f"rank {self.global_rank} step 0 local loss {loss.item():.6f}", flush=True)
        return loss

    def on_after_backward(self) -> None:
        if self.global_step == 0:  # each rank had its own batch, yet the averaged gradients agree
            local = digest(p.grad for p in self.parameters())
            print(f"rank {self.global_rank} step 0 gradient digest {local}", flush=True)

    def on_train_end(self) -> None:
        # gather_objects is a collective: every rank calls it, rank 0 reports.
        digests = ls.collectives.gather_objects(digest(self.parameters()))
        print(f"rank {self.global_rank} final parameter digest {digests[self.global_rank]}", flush=True)
        if self.global_rank == 0:
            print(f"parameters identical across {len(digests)} ranks: {len(set(digests)) == 1}", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=50)
    args = p.parse_args()

    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    # No sampler here: Lightning injects a DistributedSampler, so each rank gets its own shard.
    loader = DataLoader(data, batch_size=16, shuffle=True)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
                        strategy="ddp_sync", max_steps=args.max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regressor(), loader)


if __name__ == "__main__":
    main()
