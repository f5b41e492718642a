"""Local SGD: average the parameters every k steps, without DDP (DDP's job, done by hand and less often).

    torchrun --standalone --nproc_per_node=2 recipes/local_sgd.py                     # 2 CPU processes (gloo)
    torchrun --standalone --nproc_per_node=4 recipes/local_sgd.py --accelerator gpu   # 4 GPUs (NCCL)
    torchrun --standalone --nproc_per_node=2 recipes/local_sgd.py --k 1               # k=1: every step

DDP averages the gradients at every step, so the replicas never drift. Local SGD lets each rank take
k optimizer steps on its own shard, then averages the parameters: k times fewer collectives, at the
price of replicas that drift apart in between. Averaging parameters by hand is right here only
because there is NO DDP; under DDP it is the classic mistake (the gradients were averaged already).
Ranks start identical (one broadcast seed), drift, and hold identical weights after every average.
"""

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_sync as ls
from lightning_sync.collectives import all_reduce, broadcast_seed, gather_objects


def average_parameters(model: nn.Module) -> float:
    """Average the parameters across ranks (every rank calls it); return how far they had drifted."""
    with torch.no_grad():
        flat = parameters_to_vector(model.parameters())  # one collective for the whole model
        drift = all_reduce(flat.clone(), op="max") - all_reduce(flat.clone(), op="min")
        vector_to_parameters(all_reduce(flat, op="mean"), model.parameters())
    return drift.max().item()


def digest(model: nn.Module) -> str:
    return hashlib.sha256(parameters_to_vector(model.parameters()).detach().cpu().numpy().tobytes()).hexdigest()[:12]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--k", type=int, default=4, help="local steps between two averages")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=None, help="root seed (rank 0's wins; default: fresh)")
    args = p.parse_args()

    if args.accelerator == "gpu":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda" if args.accelerator == "gpu" else "cpu")
    dist.init_process_group("nccl" if args.accelerator == "gpu" else "gloo")  # env:// from torchrun
    rank = dist.get_rank()

    root = broadcast_seed(args.seed)  # identical init on every rank, and one permutation for the sampler
    torch.manual_seed(root)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
    torch.manual_seed(ls.derive_seed(root, "rank", rank))  # from here on, each rank its own stream
    x = torch.randn(1024, 8, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    sampler = DistributedSampler(data, seed=root)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    step, epoch = 0, 0
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb.to(device)), yb.to(device))
            opt.zero_grad()
            loss.backward()  # local gradients only: no communication
            opt.step()
            step += 1
            if step % args.k == 0 or step == args.max_steps:
                drift = average_parameters(model)
                print(f"rank {rank} step {step} drift before average {drift:.3e} digest after {digest(model)}",
                      flush=True)
            if step == args.max_steps:
                break
        epoch += 1

    digests = gather_objects(digest(model))
    if rank == 0:
        print(f"all {len(digests)} ranks hold identical weights: {len(set(digests)) == 1}", flush=True)
    dist.barrier()  # nobody tears the group down while a peer still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
