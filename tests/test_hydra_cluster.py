"""lsync-train with ranks from srun on the two-node test cluster (tests/cluster.py; root only):
a single run and a multirun, 2 nodes x 2 tasks, every rank writing into its job's directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SRUN = ["srun", "-N2", "--ntasks-per-node=2", "lsync-train"]
LAYOUT = ["trainer.devices=2", "trainer.num_nodes=2"]
TINY = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "callbacks=minimal",
        "trainer.enable_checkpointing=false", "trainer.enable_progress_bar=false"]


def test_srun_run_and_multirun_two_nodes(cluster: Cluster, tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = cluster.run("n0", *SRUN, *LAYOUT, *TINY, f"hydra.run.dir={run}", timeout=180)
    assert out.returncode == 0, out.stdout[-5000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["val_size"] == 4 * 64
    assert sorted(p.name for p in run.glob("rank*.log")) == [f"rank{r}.log" for r in range(4)]

    sweep = tmp_path / "sweep"
    out = cluster.run("n0", *SRUN, "-m", "model.lr=0.05,0.1", *LAYOUT, *TINY, f"hydra.sweep.dir={sweep}", timeout=240)
    assert out.returncode == 0, out.stdout[-5000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [j.name for j in jobs] == ["0", "1"]
    for job, lr in zip(jobs, [0.05, 0.1]):
        assert json.loads((job / "summary.json").read_text())["lr"] == lr
        assert sorted(p.name for p in job.glob("rank*.log")) == [f"rank{r}.log" for r in range(4)]
        assert f"rank 3/4 done: lr={lr} " in (job / "rank3.log").read_text()
        assert len(list(job.rglob(".hydra/config.yaml"))) == 1
