"""A 2-rank fit that makes one classic DDP mistake (or none); each rank writes OUT/rank{r}.json.

python tests/scripts/fit_guard.py --out DIR --scenario NAME [--no-guard] [--guard-timeout S] [--workers N] [--epochs E]
       [--dump-after S]

--no-guard: ddp_sync with guard=False and no ParameterConsistencyCheck (what happens without them).

The report holds the exception each rank raised (type and message), the warnings it saw and the
number of optimizer steps it ran. Scenarios: ok, rank0_log, rank0_checkpoint, log_keys (allowed), log_keys_synced, warnings
(plain sampler, different initial parameters and uneven batches with
uneven_batches="stop_together"), uneven, buffer_drift.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync as ls

RANK = int(os.environ.get("LOCAL_RANK", "0"))


def mistake_made(out: Path) -> None:
    """Rank 0 is about to make the scenario's mistake: when (wall clock, one host) it did, for the time to error."""
    (out / "mistake_at").write_text(repr(time.time()))


class Model(L.LightningModule):
    def __init__(self, scenario: str, out: Path) -> None:
        super().__init__()
        self.scenario = scenario
        self.out = out
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.register_buffer("seen", torch.zeros(()))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("loss", loss, sync_dist=True)
        if self.scenario == "rank0_log" and self.global_rank == 0 and batch_idx == 1:
            mistake_made(self.out)
            self.log("rank0_loss", loss, sync_dist=True)  # the mistake: a collective only rank 0 makes
        if self.scenario == "log_keys":
            self.log(f"loss_rank{self.global_rank}", loss)  # per-rank keys, not synced: allowed, as in Lightning
        if self.scenario == "log_keys_synced":
            # the mistake: per-rank keys synced, so each rank's reduction pairs with another metric
            self.log(f"loss_rank{self.global_rank}", loss, on_step=False, on_epoch=True, sync_dist=True)
        if self.scenario == "rank1_raises" and self.global_rank == 1 and batch_idx == 1:
            raise ValueError("a bad batch on rank 1")  # the program's own error, on one rank
        if self.scenario == "buffer_drift" and self.global_rank == 1:
            self.seen += len(x)  # the mistake: state updated on one rank only, never synced
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.scenario == "rank0_broadcast" and self.global_rank == 0 and batch_idx == 1:
            # the mistake: a collective between two steps on rank 0 only (rank 1 goes on to the
            # next step's start, where the strategy broadcasts its step flags)
            torch.distributed.broadcast(torch.zeros(3), src=0)

    def on_train_epoch_end(self) -> None:
        if self.scenario == "rank0_checkpoint" and self.trainer.is_global_zero:
            self.trainer.save_checkpoint(self.out / "manual.ckpt")  # the mistake: save_checkpoint on rank 0 only

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(-1), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenario", default="ok")
    parser.add_argument("--no-guard", action="store_true")
    parser.add_argument("--guard-timeout", type=float, default=5.0)
    parser.add_argument("--check-every", type=int, default=1)
    parser.add_argument("--workers", type=int, default=0, help="forked data-loader workers per loader")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--dump-after", type=float, default=0.0,
                        help="write every thread's Python stack to stderr if the process still runs after S seconds")
    args = parser.parse_args()
    if args.dump_after > 0:
        faulthandler.dump_traceback_later(args.dump_after, exit=False)
    scenario = args.scenario
    torch.manual_seed(1234 + (RANK if scenario == "warnings" else 0))  # "warnings": unsynchronised seeds
    n = 40 + (8 * RANK if scenario in ("uneven", "warnings") else 0)  # rank 1 has one more batch
    data = TensorDataset(torch.randn(n, 4), torch.randn(n))
    plain = scenario in ("warnings", "uneven")
    loader_kwargs: dict = {"num_workers": args.workers, "multiprocessing_context": "fork"} if args.workers else {}
    train = DataLoader(data, batch_size=8, shuffle=plain, **loader_kwargs)
    val = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16)), batch_size=8, **loader_kwargs)
    guard = ls.CollectiveGuard(check_every=args.check_every) if not args.no_guard else False
    strategy_kwargs: dict = {"guard": guard, "guard_timeout": args.guard_timeout}
    if scenario == "warnings":
        strategy_kwargs["uneven_batches"] = "stop_together"
    if scenario == "buffer_drift":
        strategy_kwargs["broadcast_buffers"] = False
    check = ls.ParameterConsistencyCheck(every_n_steps=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ls.SyncDDPStrategy(seed=7, **strategy_kwargs), max_epochs=args.epochs,
        logger=False, enable_checkpointing=scenario == "ok",
        use_distributed_sampler=not plain, callbacks=[] if args.no_guard else [check], default_root_dir=str(args.out),
        num_sanity_val_steps=0,
    )
    model = Model(scenario, args.out)
    report: dict = {"rank": RANK, "error": None, "warnings": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, train, val)
        except Exception as err:  # noqa: BLE001 - the report is what the test checks
            report["error"] = {"type": type(err).__name__, "message": str(err), "at": time.time()}
    report["warnings"] = [str(w.message) for w in caught]
    report["steps"] = trainer.global_step
    report["checks"] = check.checks
    report["patched_after"] = (hasattr(torch.distributed.all_reduce, "__lightning_sync_guarded__")
                               or type(torch.distributed.group.WORLD).__name__ == "WatchedGroup")
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
