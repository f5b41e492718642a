"""Training on data that differs in amount per rank: ``uneven_batches="join"`` and its controls.

python tests/scripts/fit_uneven.py --out DIR [--devices 2] [--source iterable|sampler|hf] [--split 60/40|rr]
    [--workers 2] [--syncbn] [--strategy ddp_sync|ddp] [--mode join|error|stop_together]
    [--own-collective] [--accumulate 2] [--epochs 1]

Each rank trains on its own shard of N samples (an IterableDataset sharded by rank, a map-style set
with the user's per-rank sampler, or a Hugging Face ``datasets`` stream split with
``split_dataset_by_node``) and writes OUT/fit.rank{r}.json: per training step the dataset indices of
its real batch (none in a stand-in step), the final weights, the logged metrics and the global step;
or, when the run raised, the error. :func:`expected_batches` and :func:`reference_weights` give the
same run computed in one process (each step's gradient the mean over the samples all ranks had).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info

import lightning_sync as ls

N, DIM, CLASSES, BATCH, LR = 1001, 5, 3, 32, 0.2


def sample(i: int) -> tuple[torch.Tensor, int]:
    g = torch.Generator().manual_seed(11_000 + i)
    x = torch.randn(DIM, generator=g) * 2 + 1
    return x, int((x[:CLASSES] + 0.5 * torch.randn(CLASSES, generator=g)).argmax())


def shard(split: str, world: int, rank: int, n: int = N) -> list[int]:
    """Rank ``rank``'s indices: ``"rr"`` round-robin, or percentages such as ``"60/40"`` (contiguous; ``"100/0"``:
    rank 1 has none)."""
    if split == "rr":
        return list(range(rank, n, world))
    shares = [float(p) for p in split.split("/")]
    assert len(shares) == world, f"--split {split} needs {len(shares)} ranks"
    bounds = [round(n * sum(shares[:k]) / sum(shares)) for k in range(world + 1)]
    return list(range(bounds[rank], bounds[rank + 1]))


def expected_batches(split: str, world: int, rank: int, workers: int) -> list[list[int]]:
    """The batches a DataLoader yields over the rank's shard (workers each batch their own part, in turn)."""
    mine = shard(split, world, rank)
    parts = [mine[w::workers] for w in range(workers)] if workers else [mine]
    chunks = [[p[k:k + BATCH] for k in range(0, len(p), BATCH)] for p in parts]
    out: list[list[int]] = []
    for k in range(max(len(c) for c in chunks)):
        out += [c[k] for c in chunks if k < len(c)]
    return out


class Stream(IterableDataset):  # type: ignore[type-arg]
    """The rank's shard as a stream; with workers, each worker yields every num_workers-th sample."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = indices

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int, int]]:
        info = get_worker_info()
        mine = self.indices if info is None else self.indices[info.id::info.num_workers]
        for i in mine:
            x, y = sample(i)
            yield x, y, i


class Points(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        x, y = sample(i)
        return x, y, i


class RankSampler(Sampler[int]):
    """A user's own sampler: this rank's indices, however many there are."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = indices

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def hf_stream(split: str, world: int, rank: int, root: Path) -> Any:
    """A Hugging Face ``datasets`` IterableDataset over local JSON-lines files (file k holds ``shard(split,
    world, k)``), split with ``split_dataset_by_node``: one file per rank, so rank r streams its shard."""
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    files = []
    for part in range(world):
        path = root / f"part{part}.jsonl"
        if rank == 0 and not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps({"i": i}) + "\n" for i in shard(split, world, part)))
            tmp.rename(path)
        files.append(str(path))
    if dist.is_initialized():
        dist.barrier()
    stream = load_dataset("json", data_files=files, split="train", streaming=True)
    return split_dataset_by_node(stream, rank=rank, world_size=world)


def hf_collate(rows: list[dict[str, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(sample(r["i"]) for r in rows))
    return torch.stack(xs), torch.tensor(ys), torch.tensor([r["i"] for r in rows])


def build_net(syncbn: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 8), nn.BatchNorm1d(8) if syncbn else nn.Identity(), nn.ReLU(),
                         nn.Linear(8, CLASSES))


class Model(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = build_net(args.syncbn)
        self.acc = torchmetrics.Accuracy("multiclass", num_classes=CLASSES)
        self.val_acc = torchmetrics.Accuracy("multiclass", num_classes=CLASSES)
        self.steps: list[list[int]] = []
        self.validated: list[int] = []  # the global step of each validation run

    def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        a, t = self.args, self.trainer
        if a.source == "hf":
            return DataLoader(hf_stream(a.split, t.world_size, t.global_rank, Path(a.out)), batch_size=BATCH,
                              collate_fn=hf_collate, num_workers=a.workers)
        mine = shard(a.split, t.world_size, t.global_rank)
        if a.source == "sampler":
            return DataLoader(Points(), batch_size=BATCH, sampler=RankSampler(mine), num_workers=a.workers)
        if a.source == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(Points(), batch_size=BATCH, sampler=RankSampler(mine), num_workers=a.workers)
        return DataLoader(Stream(mine), batch_size=BATCH, num_workers=a.workers)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        stand_in = getattr(self.trainer.strategy, "stand_in_step", False)
        self.steps.append([] if stand_in else [int(i) for i in idx])
        self.log("samples", float(len(idx)), reduce_fx="sum", on_step=False, on_epoch=True, sync_dist=True)
        self.log("step_loss", loss, on_step=True, on_epoch=False, sync_dist=True)
        self.log("loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=len(idx))
        self.acc(logits, y)
        self.log("acc", self.acc, on_step=False, on_epoch=True)
        if self.args.own_collective and batch_idx >= 2:
            dist.all_reduce(torch.ones(1))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.args.save_at and self.trainer.global_step == self.args.save_at:
            self.trainer.save_checkpoint(Path(self.args.out, "mid.ckpt"))
            raise Crash(f"stopped at step {self.args.save_at} after saving")

    def val_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        return DataLoader(Points(), batch_size=100)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, idx = batch
        self.validated.append(self.trainer.global_step) if batch_idx == 0 else None
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("val_loss", loss, sync_dist=True, batch_size=len(idx))
        self.log("val_step_loss", loss, on_step=True, on_epoch=False, sync_dist=True)  # a collective every step
        self.log("val_n", float(len(idx)), reduce_fx="sum", sync_dist=True)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc)


class Crash(RuntimeError):
    pass


def reference_run(split: str, world: int, workers: int, syncbn: bool, accumulate: int = 1,
                  epochs: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The run in one process: step s trains on the union of every rank's s-th batch (the mean loss over those
    samples), ``accumulate`` steps per optimizer step (Lightning's mean of the steps' losses). Returns the
    final weights and the epoch metrics the script logs (over every sample, at the weights it was trained at)."""
    net = build_net(syncbn)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    per_rank = [expected_batches(split, world, r, workers) for r in range(world)]
    steps = max(len(b) for b in per_rank)
    for _ in range(epochs):
        loss_sum = correct = count = 0.0  # the last epoch's values are the ones logged
        for s in range(steps):
            union = [i for b in per_rank if s < len(b) for i in b[s]]
            xs, ys = zip(*(sample(i) for i in union))
            logits = net(torch.stack(xs))
            target = torch.tensor(ys)
            loss = F.cross_entropy(logits, target)
            loss_sum += float(loss.detach()) * len(union)
            correct += float((logits.argmax(1) == target).sum())
            count += len(union)
            (loss / accumulate).backward()
            if (s + 1) % accumulate == 0 or s + 1 == steps:
                opt.step()
                opt.zero_grad()
    weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return weights, {"loss": loss_sum / count, "acc": correct / count, "samples": count}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--source", default="iterable", choices=("iterable", "sampler", "stateful", "hf"))
    p.add_argument("--split", default="60/40")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--syncbn", action="store_true")
    p.add_argument("--strategy", default="ddp_sync")
    p.add_argument("--mode", default="join")
    p.add_argument("--own-collective", action="store_true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--save-at", type=int, default=0, help="save a checkpoint at this global step, then crash")
    p.add_argument("--resume", default=None, help="fit from this checkpoint")
    p.add_argument("--val-every", type=int, default=0, help="validate every N training batches")
    p.add_argument("--validate-stream", action="store_true", help="trainer.validate on the ranks' uneven streams")
    p.add_argument("--checkpoint", action="store_true", help="ModelCheckpoint top-2 by step_loss every 4 steps")
    args = p.parse_args()
    strategy: Any = (ls.SyncDDPStrategy(uneven_batches=args.mode, guard_timeout=60)
                     if args.strategy == "ddp_sync" else args.strategy)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=args.epochs,
                        sync_batchnorm=args.syncbn, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=args.checkpoint, accumulate_grad_batches=args.accumulate,
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(
                            Path(args.out, "ckpt"), monitor="step_loss", save_top_k=2, every_n_train_steps=4)]
                        if args.checkpoint else None,
                        enable_model_summary=False, limit_val_batches=2 if args.val_every else 1.0 if args.validate_stream else 0,
                        val_check_interval=args.val_every or None, num_sanity_val_steps=0)
    model = Model(args)
    report: dict[str, Any] = {}
    code = 0
    try:
        if args.validate_stream:
            # the loader is built before Lightning's launcher starts the ranks: each process builds its rank's
            mine = shard(args.split, args.devices, int(os.environ.get("LOCAL_RANK", 0)))
            trainer.validate(model, DataLoader(Stream(mine), batch_size=BATCH, num_workers=args.workers))
        else:
            trainer.fit(model, ckpt_path=args.resume)
    except Exception as err:  # noqa: BLE001 - the report says what each rank raised
        report["error"] = f"{type(err).__name__}: {err}"
        code = 3
    rank = trainer.global_rank
    report.update(steps=model.steps, global_step=trainer.global_step, validated=model.validated,
                  metrics={k: float(v) for k, v in trainer.callback_metrics.items()},
                  weights={k: v.tolist() for k, v in model.net.state_dict().items()})
    Path(args.out, f"fit.rank{rank}.json").write_text(json.dumps(report))
    sys.stdout.flush()
    os._exit(code) if code else None


if __name__ == "__main__":
    main()
