"""Seeds under DDP: what must be equal across ranks, and what must differ.

    python recipes/seeds.py                                  # 2 CPU processes (gloo), ranks seeded 100 and 101
    python recipes/seeds.py --strategy ddp                   # the same with Lightning's ddp: shards overlap
    python recipes/seeds.py --accelerator gpu --devices 4    # 4 GPUs (NCCL)

Equal on every rank: the seed the DistributedSampler shuffles with (else each rank draws its shard
from a different permutation: samples overlap and others are never seen) and model initialisation
(DDP copies rank 0's weights at wrap time, but silently, hiding the bug anywhere else).
Different on every rank: dropout masks, noise, augmentation and data-loader worker streams (equal
streams give every rank the same noise: correlated, wasted randomness).
`seed_everything(42)` on every rank gets the first right and the second wrong; a seed that differs
per rank (time, per-rank config) gets the first wrong. `strategy="ddp_sync"` broadcasts rank 0's root
seed (trainer.strategy.seed), uses it for samplers and init, then gives each rank its own stream.
"""

import argparse
import hashlib
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_sync  # noqa: F401  (registers strategy="ddp_sync")
from lightning_sync.collectives import gather_objects

N = 16


class Indexed(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, torch.full((8,), float(i))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:12]


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net, self.seen, self.init, self.masks = None, [], "", []

    def configure_model(self) -> None:  # built after the seed agreement, before DDP's broadcast
        self.net = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1))
        self.init = digest(torch.cat([p.flatten() for p in self.net.parameters()]))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, x = batch
        self.seen += idx.tolist()
        dropped = self.net[1](self.net[0](x))
        self.masks.append(digest(dropped != 0))
        return self.net[2](dropped).pow(2).mean()

    def on_train_end(self) -> None:
        mine = (getattr(self.trainer.strategy, "seed", None), self.init, self.masks[0], self.seen)
        for what, value in zip(("root seed", "init digest", "first dropout mask", "seen"), mine):
            print(f"rank {self.global_rank} {what} {value}", flush=True)
        every = gather_objects(mine)  # a collective: every rank calls it
        if self.global_rank == 0:
            per_epoch = len(self.seen) // self.trainer.current_epoch
            epochs = [[rank[3][e:e + per_epoch] for rank in every] for e in range(0, len(self.seen), per_epoch)]
            disjoint = all(sorted(sum(shards, [])) == list(range(N)) for shards in epochs)
            seeds = {r[0] for r in every}
            print(f"root seed agreed: {None not in seeds and len(seeds) == 1}\n"
                  f"model init equal: {len({r[1] for r in every}) == 1}\n"
                  f"shards disjoint and complete every epoch: {disjoint}\n"
                  f"dropout masks differ: {len({r[2] for r in every}) == len(every)}", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--strategy", default="ddp_sync")
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()

    # The accident this recipe guards against: every rank seeded differently (rank from the launcher).
    L.seed_everything(100 + int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0))), verbose=False)
    loader = DataLoader(Indexed(), batch_size=4, shuffle=True)  # Lightning adds a DistributedSampler
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=args.strategy,
                        max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(), loader)


if __name__ == "__main__":
    main()
