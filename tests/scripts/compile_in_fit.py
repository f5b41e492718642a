"""``torch._dynamo.explain`` of functions that issue collectives, inside a 2-rank Lightning fit's first training
step (the strategy set up: under ``ddp_sync`` the guard watches the default group), for the side-by-side check
with ``ddp`` in tests/test_compile.py:

    python compile_in_fit.py OUT STRATEGY

Each rank writes ``OUT/rank<r>.json``: per case, the graph and graph-break counts and the compiled output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync  # noqa: F401 - registers "ddp_sync"

OUT, STRATEGY = Path(sys.argv[1]), sys.argv[2]


def all_reduce_in_the_middle(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    dist.all_reduce(y)  # in-graph under ddp: one graph, no break
    return y + 1


def broadcast_between(x: torch.Tensor) -> torch.Tensor:
    y = x * 3
    dist.broadcast(y, src=0)  # not an in-graph collective: a graph break under ddp too
    return y - 1


def gather_then_reduce(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.numel() * dist.get_world_size())
    dist.all_gather_into_tensor(out, x * 2)
    dist.all_reduce(out)
    return out.sum() + x


CASES = {"all_reduce": all_reduce_in_the_middle, "broadcast": broadcast_between, "gather_reduce": gather_then_reduce}


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == 0:
            report = {"watched": type(dist.group.WORLD).__name__}
            for name, fn in CASES.items():
                x = torch.arange(4, dtype=torch.float32) + 10 * self.global_rank
                torch._dynamo.reset()
                explained = torch._dynamo.explain(fn)(x)
                torch._dynamo.reset()
                out = torch.compile(fn, backend="eager")(x)
                torch._dynamo.reset()
                report[name] = {"graphs": explained.graph_count, "breaks": explained.graph_break_count,
                                "out": out.tolist()}
            (OUT / f"rank{self.global_rank}.json").write_text(json.dumps(report))
        return torch.nn.functional.mse_loss(self.layer(batch[0]).squeeze(-1), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    data = TensorDataset(torch.randn(32, 4), torch.randn(32))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=STRATEGY, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(), DataLoader(data, batch_size=8))
