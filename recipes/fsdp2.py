"""FSDP2 (``fully_shard``) through Lightning's ModelParallelStrategy, with lightning_sync's guarantees.

    python recipes/fsdp2.py                                   # 2 CPU processes (gloo), model_parallel_sync
    python recipes/fsdp2.py --strategy model_parallel         # Lightning's own, for comparison
    python recipes/fsdp2.py --accelerator gpu --devices 4     # 4 GPUs (NCCL)

``configure_model`` builds the layers and shards them over the data-parallel mesh. Under
``model_parallel_sync`` it runs under the root seed broadcast from rank 0, so every rank builds the
same full parameters before ``fully_shard`` keeps its slice of them (under Lightning's own strategy
each rank shards its own random initialisation). Validation over 1001 samples is exact: every sample
once, on one rank (Lightning's padded sampler repeats one). Pass ``data_parallel_size`` as below:
Lightning's "auto" makes every device of a node one tensor-parallel group, and FSDP2 over a mesh of
one shards nothing.
"""

import argparse

import lightning as L
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync as ls


class Model(L.LightningModule):
    def configure_model(self) -> None:
        if hasattr(self, "net"):  # configure_model runs again for a later trainer call
            return
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", nn.functional.mse_loss(self.net(x), y), sync_dist=True, batch_size=len(y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, x[:, :4].sum(1, keepdim=True))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="model_parallel_sync", choices=["model_parallel_sync", "model_parallel"])
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-epochs", type=int, default=2)
    args = p.parse_args()
    sizes = {"data_parallel_size": args.devices, "tensor_parallel_size": 1}
    strategy = (ls.SyncModelParallelStrategy(seed=7, **sizes) if args.strategy == "model_parallel_sync"
                else L.pytorch.strategies.ModelParallelStrategy(**sizes))
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy,
                        max_epochs=args.max_epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    model = Model()
    trainer.fit(model, DataLoader(data(512), batch_size=32, shuffle=True), DataLoader(data(1001), batch_size=64))
    result = trainer.validate(model, DataLoader(data(1001), batch_size=64), verbose=False)[0]
    # the same weights in one process, on the whole validation set (a collective: every rank calls it)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.global_rank == 0:
        net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
        net.load_state_dict({k.removeprefix("net."): v for k, v in full.items()})
        x, y = data(1001).tensors
        with torch.no_grad():
            one = float(nn.functional.mse_loss(net(x), y))
        print(f"{args.strategy}: val_mse {result['val_mse']:.6f} over 1001 samples, one process {one:.6f}, "
              f"root seed {getattr(strategy, 'seed', None)}", flush=True)


if __name__ == "__main__":
    main()
