"""Process-group set-up without Lightning: backend per device, env:// vs file://, clean teardown.

    torchrun --standalone --nproc_per_node=2 recipes/init_process_group.py                     # CPU, env://
    torchrun --standalone --nproc_per_node=4 recipes/init_process_group.py --accelerator gpu   # GPUs, NCCL
    python recipes/init_process_group.py --spawn 2                                             # file://, no torchrun

Backend: "nccl" for CUDA tensors (set the device BEFORE init, one GPU per process), "gloo" for CPU.
Rendezvous: torchrun exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, and
init_method="env://" (the default) reads them. Without a launcher, give rank and world size yourself
and a meeting point every process can reach: a file on a shared file system (file://, its path must
not exist beforehand) or tcp://host:port. Teardown: every rank waits at a barrier, drops what still
holds the group (DDP's reducer), then destroy_process_group(); gloo processes that skip this can
abort at exit ("terminate called without an active exception"), after a run that succeeded.
"""

import argparse
import gc
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, world_size: int, accelerator: str, init_method: str) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if accelerator == "gpu":
        torch.cuda.set_device(local_rank)  # before init: NCCL binds each process to its current device
    device = torch.device("cuda", local_rank) if accelerator == "gpu" else torch.device("cpu")
    dist.init_process_group(
        backend="nccl" if accelerator == "gpu" else "gloo",
        init_method=init_method,  # env:// reads RANK/WORLD_SIZE too; file:// needs them passed
        rank=rank if init_method.startswith("file://") else -1,
        world_size=world_size if init_method.startswith("file://") else -1,
        timeout=timedelta(minutes=5),  # how long a collective waits for a missing rank before raising
    )
    rank, world_size = dist.get_rank(), dist.get_world_size()

    model = torch.nn.Linear(4, 1).to(device)
    total = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(total)  # every rank must call it; blocks until all have
    expected = world_size * (world_size + 1) / 2
    print(f"rank {rank}/{world_size} backend {dist.get_backend()} init {init_method.split(':')[0]}:// "
          f"all_reduce sum {total.item()} expected {expected}", flush=True)

    del model  # in a real script: the DDP-wrapped model, whose reducer holds the group
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} clean teardown", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--spawn", type=int, default=0, help="start N processes here (file:// rendezvous)")
    args = p.parse_args()

    if args.spawn:  # no launcher: this process starts the ranks and picks the meeting point
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(run, args=(args.spawn, args.accelerator, f"file://{tmp}/rendezvous"), nprocs=args.spawn)
    else:  # under torchrun (or srun with the variables exported): one process per rank, env://
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.accelerator, "env://")


if __name__ == "__main__":
    main()
