"""SyncBatchNorm with Lightning's Trainer on CPU: 2-process fits in a subprocess (Lightning's own
launcher re-runs tests/scripts/fit_batchnorm.py for rank 1), compared with one process on the same samples."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_sync.callbacks.batchnorm import PortableSyncBatchNorm, SyncBatchNormConversion, portable_layer_sync
from tests.scripts.fit_batchnorm import BATCH_PER_RANK, WORLD, BNModel, dataset

SCRIPT = Path(__file__).parent / "scripts" / "fit_batchnorm.py"
TOL = 1e-4


def _fit(tmp_path: Path, mode: str, timeout: float = 180) -> list[dict]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # A session of its own, so a hang kills rank 1 (started by Lightning) as well.
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), mode], cwd=SCRIPT.parents[2], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{mode} fit timed out after {timeout} s:\n{output[-4000:]}")
    assert proc.returncode == 0, f"{mode} fit exited with {proc.returncode}:\n{output[-4000:]}"
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


def _one_process_reference() -> nn.Module:
    """The same model trained in one process on the union of both ranks' batches."""
    torch.manual_seed(0)
    model = BNModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = dataset()
    # DistributedSampler(shuffle=False) gives rank r the indices r, r + 2, ...: step k of the two
    # ranks together covers exactly rows [k * 16, (k + 1) * 16).
    global_batch = BATCH_PER_RANK * WORLD
    for start in range(0, len(data), global_batch):
        x, y = data[start:start + global_batch]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if not b.is_floating_point():
        return float(not torch.equal(a, b))
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _check_fit(results: list[dict], tmp_path: Path) -> None:
    ref = _one_process_reference().state_dict()
    for rank, result in enumerate(results):
        assert "SyncBatchNorm" in result["classes_in_fit"]
        assert "SyncBatchNorm" not in result["classes_after"] and "BatchNorm1d" in result["classes_after"]
        errors = {k: _rel(result["state"][k], v) for k, v in ref.items()}
        bad = {k: e for k, e in errors.items() if e > TOL}
        assert not bad, f"rank {rank} differs from the one-process run: {bad}"
    for key in ref:
        if "running" in key:  # identical on both ranks, not just close
            assert torch.equal(results[0]["state"][key], results[1]["state"][key]), key
    # The checkpoint saved during fit (converted layers) loads into the plain model.
    ckpt = torch.load(tmp_path / "final.ckpt", weights_only=False)
    plain = BNModel()
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()}
    plain.load_state_dict(state, strict=True)
    for key, value in ref.items():
        assert _rel(plain.state_dict()[key], value) <= TOL, key


@pytest.mark.slow
def test_ddp_with_conversion_callback_matches_one_process(tmp_path: Path) -> None:
    _check_fit(_fit(tmp_path, "callback"), tmp_path)


@pytest.mark.slow
def test_ddp_with_layer_sync_plugin_matches_one_process(tmp_path: Path) -> None:
    _check_fit(_fit(tmp_path, "plugin"), tmp_path)


@pytest.mark.slow
def test_ddp_sync_strategy_with_sync_batchnorm_flag_matches_one_process(tmp_path: Path) -> None:
    _check_fit(_fit(tmp_path, "ddp_sync"), tmp_path)


def test_callback_with_sync_batchnorm_flag_raises() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", sync_batchnorm=True, logger=False,
                         enable_checkpointing=False)
    with pytest.raises(MisconfigurationException, match="Use one or the other"):
        SyncBatchNormConversion().setup(trainer, pl.LightningModule(), "fit")


def test_portable_layer_sync_swaps_torch_sync_batchnorm_only() -> None:
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

    assert isinstance(portable_layer_sync(TorchSyncBatchNorm()), PortableSyncBatchNorm)
    assert portable_layer_sync(None) is None
    mine = PortableSyncBatchNorm(exclude=["x"])
    assert portable_layer_sync(mine) is mine
