"""``strategy="ddp_sync_notebook"`` in a real Jupyter kernel (nbclient runs a notebook the test writes).

Lightning refuses every start method but fork in an interactive session; the notebook strategy forks
the ranks like Lightning's ``ddp_notebook``. The cells are what a user types: a model, a Trainer,
``fit`` and ``validate``; the last cell prints the results as JSON for the test to read.
"""

from __future__ import annotations

import json
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

CELLS = [
    """\
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync  # registers ddp_sync_notebook""",
    """\
class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(11, 4, generator=g), torch.randn(11, 1, generator=g))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_count", float(len(y)), reduce_fx="sum", sync_dist=True)
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=2, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=2)""",
    """\
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_sync_notebook", max_epochs=2,
                    logger=False, enable_checkpointing=False)
model = Model()
trainer.fit(model)
fitted = {k: float(v) for k, v in trainer.callback_metrics.items()}
validated = trainer.validate(model, verbose=False)[0]""",
    """\
import json
print("RESULT " + json.dumps({"fitted": fitted, "validated": validated, "seed": trainer.strategy.seed,
                              "interactive": L.fabric.utilities.imports._IS_INTERACTIVE}))""",
]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_ddp_sync_notebook_fits_and_validates_exactly_in_a_jupyter_kernel(tmp_path) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in CELLS])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": tmp_path}},
                                     env=env)  # extra_arguments etc. go to the kernel manager
    client.execute()
    outputs = [o for o in nb.cells[-1].outputs if o.get("name") == "stdout"]
    line = next(ln for o in outputs for ln in o["text"].splitlines() if ln.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result["interactive"] is True  # a real interactive session: Lightning refuses ddp_sync/ddp_sync_spawn here
    assert result["validated"]["val_count"] == 11.0  # every sample once (ddp_notebook's padded sampler: 12)
    assert result["fitted"]["val_count"] == 11.0 and "train_loss" in result["fitted"]
    assert isinstance(result["seed"], int)
