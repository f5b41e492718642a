"""Uneven streams: ranks with different amounts of training data, every sample trained on once.

    python recipes/uneven_streams.py                    # 2 CPU ranks, a 60/40 stream, uneven_batches="join"
    python recipes/uneven_streams.py --show-mistake     # then the same data under Lightning's ddp (it hangs)

Each rank streams its own shard (an IterableDataset sharded by rank, as webdataset or Hugging Face's
split_dataset_by_node give): rank 0 has 601 samples, rank 1 has 400. Under Lightning's `ddp` rank 0
waits in DDP's gradient all-reduce of batch 14 for rank 1, which ran out after 13, until the process
group's timeout (30 min). With `uneven_batches="join"` rank 1 runs stand-in steps (its last batch
again, a zero contribution) while rank 0 trains its last 6 batches: the summed batch sizes are 1001
and the replicas end identical. `--show-mistake` runs `ddp` in a subprocess for `--hang-timeout` s.
"""

import argparse
import hashlib
import os
import signal
import subprocess
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import lightning_sync as ls

SIZES = (601, 400)  # samples per rank: 60/40


class Shard(IterableDataset):
    """Rank r's own stream of (x, y) pairs: samples sum(SIZES[:r]) .. sum(SIZES[:r + 1]) - 1."""
    def __init__(self, rank: int) -> None:
        self.start, self.stop = sum(SIZES[:rank]), sum(SIZES[:rank + 1])

    def __iter__(self):
        for i in range(self.start, self.stop):
            x = torch.randn(4, generator=torch.Generator().manual_seed(i))
            yield x, (x.sum() > 0).long()


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
        self.real = self.stand_ins = 0

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Shard(self.global_rank), batch_size=32)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if getattr(self.trainer.strategy, "stand_in_step", False):  # ddp_sync: this rank has run out
            self.stand_ins += 1
        else:
            self.real += 1
        self.log("samples", float(len(x)), reduce_fx="sum", on_step=False, on_epoch=True, sync_dist=True)
        self.log("loss", loss, on_epoch=True, sync_dist=True)  # per step too: joined, not blocked
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="join", choices=("join", "ddp"))
    p.add_argument("--show-mistake", action="store_true")
    p.add_argument("--hang-timeout", type=float, default=30.0)
    args = p.parse_args()
    strategy = ls.SyncDDPStrategy(uneven_batches="join") if args.strategy == "join" else "ddp"
    L.seed_everything(0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                        sync_batchnorm=args.strategy == "join",  # torch's SyncBatchNorm (ddp's) is CUDA-only
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Model()
    trainer.fit(model)
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values()))
    print(f"rank {trainer.global_rank} trained {model.real} real batches and {model.stand_ins} stand-in steps; "
          f"samples {int(trainer.callback_metrics['samples'])} of {sum(SIZES)}; weights {digest.hexdigest()[:12]}",
          flush=True)
    if args.show_mistake and trainer.global_rank == 0:
        print(f"now the same data under Lightning's ddp (ended after {args.hang_timeout:.0f} s) ...", flush=True)
        launched = {"LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"}
        env = {k: v for k, v in os.environ.items() if k not in launched and not k.startswith("PL_")}
        ddp = subprocess.Popen([sys.executable, __file__, "--strategy", "ddp"], start_new_session=True, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            print(f"ddp ended (exit {ddp.wait(timeout=args.hang_timeout)}): unexpected", flush=True)
        except subprocess.TimeoutExpired:
            os.killpg(ddp.pid, signal.SIGKILL)  # both of its ranks
            ddp.wait()
            print(f"ddp hung: rank 0 waits in DDP's gradient all-reduce for rank 1, which ran out of data "
                  f"(killed after {args.hang_timeout:.0f} s)", flush=True)

if __name__ == "__main__":
    main()
