"""Two real "nodes" (network namespaces + SLURM, from ci/cluster.sh): lsync-doctor across them, healthy and
broken, and the cluster script's own up/down cycle. Root only; skipped elsewhere (see tests/cluster.py).

Healthy torchrun across the nodes (static and c10d rendezvous) is covered by test_recipes.py (the
multi-node recipe with the doctor as payload); a world-size mismatch by test_doctor.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.cluster import SCRIPT, Cluster, Result, _run, cluster_unavailable

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

DOCTOR = ["python", "-m", "lightning_sync.doctor", "--devices", "2", "--num-nodes", "2", "--timeout", "30"]


def _torchrun_both(cluster: Cluster, rdzv: list[str], net_only: bool = False,
                   env: dict[str, dict[str, str]] | None = None) -> list[Result]:
    """One torchrun per node (2 x 2 ranks); returns [n0, n1]."""
    procs = []
    for rank, node in enumerate(("n0", "n1")):
        node_args = [f"--node_rank={rank}"] if "--master_addr=10.200.0.1" in rdzv else []
        procs.append(cluster.start(node, "torchrun", "--nnodes=2", "--nproc_per_node=2", *node_args, *rdzv,
                                   "--no-python", *DOCTOR, timeout=120, net_only=net_only,
                                   env=(env or {}).get(node)))
    return cluster.wait(procs, timeout=135)


def _static(port: int) -> list[str]:
    return ["--master_addr=10.200.0.1", f"--master_port={port}"]


def test_srun_two_nodes(cluster: Cluster) -> None:
    out = cluster.run("n0", "srun", "-N2", "--ntasks-per-node=2", *DOCTOR, timeout=120)
    assert out.returncode == 0, out.stdout
    assert "launcher slurm, 4 rank(s) on 2 node(s)" in out.stdout and "n0 -> 10.200.0.1" in out.stdout
    assert "OK: 4 rank(s)" in out.stdout


def test_hostname_resolving_to_loopback_is_diagnosed_without_hanging(cluster: Cluster) -> None:
    # Only the network namespaces: both "nodes" keep the machine's hostname, which /etc/hosts maps to
    # 127.0.0.1, so gloo would bind loopback and plain gloo fails with connectFullMesh ... Connection refused.
    n0, n1 = _torchrun_both(cluster, _static(29530), net_only=True)
    assert n0.returncode != 0 and n1.returncode != 0, n0.stdout + n1.stdout
    assert "gloo would bind loopback in a 2-node job" in n0.stdout, n0.stdout
    assert "resolves to 127.0.0.1" in n0.stdout
    assert "GLOO_SOCKET_IFNAME per node to the interface that reaches MASTER_ADDR: node 0 veth-ls0, node 1 veth-ls1" \
        in n0.stdout
    assert "process group not joined" in n0.stdout  # diagnosed instead of hanging in connectFullMesh
    assert max(n0.seconds, n1.seconds) < 100


def test_the_suggested_fix_works(cluster: Cluster) -> None:
    env = {"n0": {"GLOO_SOCKET_IFNAME": "veth-ls0"}, "n1": {"GLOO_SOCKET_IFNAME": "veth-ls1"}}
    n0, n1 = _torchrun_both(cluster, _static(29540), net_only=True, env=env)
    assert n0.returncode == 0 and n1.returncode == 0, n0.stdout + n1.stdout
    assert "OK: 4 rank(s)" in n0.stdout


def test_srun_n_instead_of_ntasks_per_node(cluster: Cluster) -> None:
    out = cluster.run("n0", "srun", "-n", "4", *DOCTOR, timeout=120)
    assert out.returncode != 0, out.stdout
    assert "SLURM started 4 tasks with -n/--ntasks=4 and no --ntasks-per-node" in out.stdout
    assert "Lightning refuses this" in out.stdout and "srun -N2 --ntasks-per-node=2" in out.stdout


def test_up_down_cycle_leaves_nothing_behind(cluster_tools: str) -> None:
    name = f"lsc{os.getpid() % 10000}"
    other = Cluster(name)
    try:
        # a crashed run's leftovers: a stale namespace and a stale state directory
        subprocess.run(["ip", "netns", "add", f"{name}0"], check=True, timeout=20)
        (other.dir / "log").mkdir(parents=True, exist_ok=True)
        (other.dir / "slurmctld.pid").write_text("999999\n")
        up = other.script("up", timeout=120)
        assert up.returncode == 0, up.stdout
        status = other.script("status", timeout=60)
        assert status.returncode == 0 and status.stdout.count("idle") == 2, status.stdout
        assert len(other.daemons()) >= 3
        hostnames = [other.run(node, "hostname", timeout=30).stdout.strip() for node in ("n0", "n1")]
        assert hostnames == ["n0", "n1"]
    finally:
        pids = other.daemons()
        down = other.script("down", timeout=120)
    assert down.returncode == 0, down.stdout
    assert not any(Path(f"/run/netns/{ns}").exists() for ns in other.namespaces)
    alive = [p for p in pids if Path(f"/proc/{p}").exists()]
    assert not alive, f"processes left behind: {alive}"
    assert not other.dir.exists()
    again = other.script("down", timeout=60)  # idempotent
    assert again.returncode == 0, again.stdout
    assert other.script("status", timeout=60).returncode != 0


def test_cluster_script_errors_are_actionable(cluster_tools: str) -> None:
    out = _run(["bash", str(SCRIPT), "run", "n7", "true"], os.environ, 30)
    assert out.returncode != 0 and "unknown node 'n7': use n0 or n1" in out.stdout
    out = _run(["bash", str(SCRIPT), "run", "n0", "true"], dict(os.environ, LSYNC_CLUSTER="lsnone"), 30)
    assert out.returncode != 0 and "run: bash ci/cluster.sh up" in out.stdout


def test_skips_with_a_reason_when_not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    reason = cluster_unavailable()
    assert reason is not None and "needs root" in reason
