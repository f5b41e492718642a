"""DistributedSampler: disjoint shards, set_epoch, and no shuffle=True beside a sampler.

    torchrun --standalone --nproc_per_node=2 recipes/distributed_sampler.py                     # CPU (gloo)
    torchrun --standalone --nproc_per_node=4 recipes/distributed_sampler.py --accelerator gpu   # GPUs (NCCL)

The sampler gives rank r every world-size-th index of one permutation; every rank must build that
permutation from the same seed, or the shards overlap. Three mistakes:
1. forgetting `sampler.set_epoch(epoch)`: the permutation depends on (seed, epoch), so every epoch
   replays the same order;
2. `DataLoader(..., sampler=sampler, shuffle=True)`: the sampler does the shuffling; torch raises;
3. a data set size the world size does not divide: the sampler pads with repeated indices
   (drop_last=False) so every rank gets as many; fine for training, wrong for validation metrics
   (see recipes/exact_validation.py).
Lightning injects this sampler for you (Trainer(use_distributed_sampler=True), the default).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from lightning_sync.collectives import broadcast_seed, gather_objects


def shards(size: int, epochs: int, seed: int, set_epoch: bool) -> list[list[int]]:
    """This rank's indices for each epoch."""
    sampler = DistributedSampler(range(size), shuffle=True, seed=seed)
    loader = DataLoader(range(size), batch_size=2, sampler=sampler)
    out = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)  # call it before iterating, every epoch, on every rank
        out.append([i for batch in loader for i in batch.tolist()])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--size", type=int, default=12)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=None, help="sampler seed (rank 0's wins; default: fresh)")
    args = p.parse_args()

    if args.accelerator == "gpu":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.accelerator == "gpu" else "gloo")  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    seed = broadcast_seed(args.seed)  # the sampler's seed must be equal on every rank: rank 0's

    for set_epoch in (True, False):
        mine = shards(args.size, args.epochs, seed, set_epoch)
        for epoch, indices in enumerate(mine):
            print(f"rank {rank} set_epoch {set_epoch} epoch {epoch} indices {indices}", flush=True)
        every = gather_objects(mine)  # a collective: every rank calls it
        if rank == 0:
            union = [sorted(sum((r[e] for r in every), [])) for e in range(args.epochs)]
            complete = all(u == list(range(args.size)) for u in union) if args.size % world == 0 else "padded"
            orders = {tuple(epoch_order) for epoch_order in mine}
            print(f"set_epoch {set_epoch}: shards disjoint and complete: {complete}; "
                  f"distinct epoch orders on rank 0: {len(orders)} of {args.epochs}", flush=True)

    if rank == 0:
        try:
            DataLoader(range(args.size), sampler=DistributedSampler(range(args.size), seed=seed), shuffle=True)
        except ValueError as err:
            print(f"shuffle=True beside a sampler: ValueError: {err}", flush=True)
        padded = DistributedSampler(range(args.size + 1), num_replicas=world, rank=0, shuffle=False)
        print(f"size {args.size + 1} on {world} ranks: rank 0 gets {len(padded)} indices, "
              f"{len(padded) * world - args.size - 1} of them repeats", flush=True)
    dist.barrier()  # nobody tears the group down while a peer still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
