"""SyncBatchNorm on CPU and GPU: batch statistics over the union of every rank's batch.

    python recipes/syncbn.py                                  # 2 CPU processes (gloo): lightning_sync's portable layer
    python recipes/syncbn.py --accelerator gpu --devices 4    # 4 GPUs (NCCL): torch's CUDA kernels
    python recipes/syncbn.py --no-sync-batchnorm              # plain BatchNorm, for comparison

Plain BatchNorm normalises with the statistics of the local batch only (small per-GPU batches give
noisy statistics), and DDP just copies rank 0's running statistics to the others before each step.
SyncBatchNorm all-reduces the per-channel sums, so every rank normalises with the statistics of the
global batch and holds the same running statistics. `torch.nn.SyncBatchNorm` is CUDA-only
(`ValueError: SyncBatchNorm layers only work with GPU modules` on CPU); with `strategy="ddp_sync"`,
`sync_batchnorm=True` uses lightning_sync's portable layer, so the same script runs on gloo.
Here each rank's data has its own offset (rank r: mean 10 r); the recipe recomputes the expected
running statistics from the gathered union of the batches and compares.
"""

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync  # noqa: F401  (registers strategy="ddp_sync")
from lightning_sync.collectives import all_gather_uneven, gather_objects


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 1))  # BN first: it sees the raw inputs
        self.expected: list[torch.Tensor] | None = None

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x + 10.0 * self.global_rank  # every rank's batch comes from a different distribution
        # The reference, computed independently: EMA (momentum 0.1) of the union's mean and unbiased var.
        union, _ = all_gather_uneven(x.detach())
        if self.expected is None:
            self.expected = [torch.zeros(4, device=x.device), torch.ones(4, device=x.device)]
        for running, stat in zip(self.expected, (union.mean(dim=0), union.var(dim=0))):
            running.mul_(0.9).add_(0.1 * stat)
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_end(self) -> None:
        bn = self.net[0]
        stats = torch.stack([bn.running_mean, bn.running_var]).cpu()
        error = (stats - torch.stack(self.expected).cpu()).abs().max().item()
        print(f"rank {self.global_rank} {type(bn).__name__} running_mean {bn.running_mean.tolist()} "
              f"max error vs union statistics {error:.2e}", flush=True)
        every = gather_objects(stats)  # a collective: every rank calls it
        if self.global_rank == 0:
            same = all(torch.equal(every[0], s) for s in every)
            print(f"running statistics identical across {len(every)} ranks: {same}", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--no-sync-batchnorm", action="store_true")
    args = p.parse_args()

    x = torch.randn(640, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16, shuffle=True)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy="ddp_sync",
                        sync_batchnorm=not args.no_sync_batchnorm, max_steps=args.max_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(), loader)


if __name__ == "__main__":
    main()
