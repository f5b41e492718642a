"""The launch recipes under recipes/, run on the two-node test cluster with lsync-doctor as the payload.

Point SCRIPT at the training job instead of the doctor to test training launches the same way.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster import Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
DOCTOR = {"SCRIPT": "python -m lightning_sync.doctor"}


def test_recipes_open_with_their_commands() -> None:
    for recipe in sorted(RECIPES.glob("launch_*")):
        head = recipe.read_text().splitlines()[:12]
        assert any(f"recipes/{recipe.name}" in line for line in head), f"{recipe.name}: no launch command up top"
        assert "set -euo pipefail" in recipe.read_text()


def test_torchrun_single_node(cluster: Cluster) -> None:
    out = cluster.run("n0", "bash", str(RECIPES / "launch_torchrun_single_node.sh"), "--timeout", "30",
                      env={**DOCTOR, "NPROC": "2"}, timeout=120)
    assert out.returncode == 0, out.stdout
    assert "launcher torchrun, 2 rank(s) on 1 node(s)" in out.stdout and "OK: 2 rank(s)" in out.stdout


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_torchrun_multinode(cluster: Cluster, rdzv: str) -> None:
    port = "29560" if rdzv == "static" else "29570"
    procs = [cluster.start(node, "bash", str(RECIPES / "launch_torchrun_multinode.sh"), "--timeout", "30",
                           env={**DOCTOR, "NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": "10.200.0.1",
                                "MASTER_PORT": port, "RDZV": rdzv, "RDZV_ID": f"recipe-{rdzv}"}, timeout=120)
             for rank, node in enumerate(("n0", "n1"))]
    results = cluster.wait(procs, timeout=135)
    assert all(r.returncode == 0 for r in results), results[0].stdout + results[1].stdout
    [head] = [r.stdout for r in results if "launcher torchrun, 4 rank(s) on 2 node(s)" in r.stdout]  # rank 0's node
    assert "OK: 4 rank(s) joined a gloo group" in head
    assert "veth-ls0 10.200.0.1" in head and "veth-ls1 10.200.0.2" in head  # each node's own interface


def test_slurm_sbatch(cluster: Cluster) -> None:
    job = cluster.sbatch(RECIPES / "launch_slurm.sbatch", "--timeout", "30", env=DOCTOR, timeout=150)
    assert job.exit_code == 0, job.output
    assert "2 node(s) x 2 task(s), MASTER_ADDR=n0" in job.output
    assert "launcher slurm, 4 rank(s) on 2 node(s)" in job.output and "OK: 4 rank(s)" in job.output
