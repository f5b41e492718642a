"""lsync-doctor: launcher detection and diagnosis (no processes), then real local runs.

The two-node runs (torchrun across network namespaces, srun) are in test_cluster.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from lightning_sync import doctor
from lightning_sync.doctor import Launch, Report, check_rank, detect_launch, diagnose, slurm_root_node
from tests.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def _slurm_env(**extra: str) -> dict[str, str]:
    env = {"SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_JOB_ID": "1234", "SLURM_NODELIST": "n[0-1]", "SLURM_JOB_NAME": "train"}
    env.update(extra)
    return env


def _report(rank: int, node: int, **changes: object) -> Report:
    base = dict(rank=rank, world_size=4, local_rank=rank % 2, node_rank=node, num_nodes=2, launcher="torchrun",
                hostname="vm", master="10.200.0.1:29500", master_ips=["10.200.0.1"], backend="gloo", gloo_iface="lo",
                gloo_addr="127.0.0.1", gloo_how="hostname 'vm' resolves to 127.0.0.1",
                route_iface=f"veth-ls{node}", interfaces={"lo": "127.0.0.1"},
                versions={"python": "3.11.7", "torch": "2.13.0", "lightning": "2.6.6", "lightning_sync": "0.1.0",
                          "nccl": "-"},
                cuda_visible="(unset)", cuda_count=0)
    base.update(changes)
    return Report(**base)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# launcher detection


def test_torchrun_environment() -> None:
    env = {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "n0", "MASTER_PORT": "29500",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "SLURM_NTASKS": "1"}  # torchrun inside SLURM: torchrun wins
    launch = detect_launch(env, devices=2, num_nodes=2)
    layout = (launch.launcher, launch.rank, launch.world_size, launch.node_rank, launch.num_nodes)
    assert layout == ("torchrun", 3, 4, 1, 2)
    assert launch.agent_store and launch.master_port == 29500 and not launch.problems


def test_slurm_environment_with_ntasks_per_node() -> None:
    launch = detect_launch(_slurm_env(SLURM_NTASKS_PER_NODE="2"), devices=2, num_nodes=2)
    assert (launch.launcher, launch.rank, launch.local_rank, launch.node_rank) == ("slurm", 3, 1, 1)
    assert (launch.master_addr, launch.master_port) == ("n0", 15000 + 1234)  # Lightning's SLURMEnvironment rule
    assert not launch.problems


def test_srun_n_without_ntasks_per_node_is_named() -> None:
    launch = detect_launch(_slurm_env(), devices=2, num_nodes=2)
    [problem] = launch.problems
    assert "-n/--ntasks=4" in problem.text and "SLURM_NTASKS_PER_NODE unset" in problem.text
    assert "srun -N2 --ntasks-per-node=2" in problem.fix


def test_slurm_tasks_per_node_must_equal_devices() -> None:
    launch = detect_launch(_slurm_env(SLURM_NTASKS_PER_NODE="2(x2)"), devices=4, num_nodes=2)
    [problem] = launch.problems
    assert "--ntasks-per-node=2" in problem.text and "--devices 4" in problem.text


def test_interactive_slurm_job_is_not_slurm() -> None:
    launch = detect_launch(_slurm_env(SLURM_JOB_NAME="bash"), devices=2, num_nodes=1)
    assert launch.launcher == "none" and "Lightning ignores SLURM" in launch.notes[0]


def test_multi_node_without_launcher_needs_master() -> None:
    launch = detect_launch({"LOCAL_RANK": "0", "NODE_RANK": "1"}, devices=2, num_nodes=2)
    assert launch.launcher == "lightning" and launch.rank == 2
    assert launch.problems[0].blocking and "MASTER_ADDR=(unset)" in launch.problems[0].text


# The doctor imports no Lightning (it starts in about a second), so it reads the launcher's variables
# itself; Lightning's cluster environments are the judge of what it must find.
_LAUNCH_ENVS = {
    "torchrun": {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                 "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"},
    "torchrun inside slurm": {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                              "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": "29511", **_slurm_env(SLURM_NTASKS="1")},
    "slurm batch": _slurm_env(SLURM_NTASKS_PER_NODE="2"),
    "slurm, nodes as a list": _slurm_env(SLURM_NTASKS_PER_NODE="2", SLURM_NODELIST="gpu[12,15]", SLURM_JOB_ID="77"),
    "slurm, MASTER_PORT set": _slurm_env(SLURM_NTASKS_PER_NODE="2", MASTER_PORT="23456", MASTER_ADDR="10.200.0.1"),
    "slurm interactive (bash)": _slurm_env(SLURM_JOB_NAME="bash", LOCAL_RANK="1", NODE_RANK="0",
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT="29512"),
    "lightning's own launcher": {"LOCAL_RANK": "1", "NODE_RANK": "1", "MASTER_ADDR": "10.200.0.1",
                                 "MASTER_PORT": "29513"},
}


@pytest.mark.parametrize("name", list(_LAUNCH_ENVS))
def test_detection_agrees_with_lightnings_cluster_environments(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.fabric.plugins.environments import (LightningEnvironment, SLURMEnvironment,
                                                       TorchElasticEnvironment)

    env = _LAUNCH_ENVS[name]
    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_")) or k in (
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
            "MASTER_PORT")]:
        monkeypatch.delenv(key)
    for key in ("MASTER_ADDR", "MASTER_PORT"):  # SLURMEnvironment writes them: restored after the test
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    launch = detect_launch(dict(env), devices=2, num_nodes=2)
    if TorchElasticEnvironment.detect():
        cluster: Any = TorchElasticEnvironment()
        assert launch.launcher == "torchrun"
        assert (launch.rank, launch.world_size) == (cluster.global_rank(), cluster.world_size())
    elif SLURMEnvironment.detect():
        cluster = SLURMEnvironment()
        assert launch.launcher == "slurm"
        assert (launch.rank, launch.world_size) == (cluster.global_rank(), cluster.world_size())
    else:
        cluster = LightningEnvironment()  # world size and global rank come from the Trainer's devices x nodes
        assert launch.launcher == "lightning"
        assert launch.rank == cluster.node_rank() * 2 + cluster.local_rank()
    assert (launch.local_rank, launch.node_rank) == (cluster.local_rank(), cluster.node_rank())
    assert (launch.master_addr, launch.master_port) == (cluster.main_address, cluster.main_port)


@pytest.mark.parametrize(("nodes", "root"), [("n[0-1]", "n0"), ("gpu[12,15]", "gpu12"), ("a,b", "a"),
                                             ("host7", "host7"), ("node[3]", "node3")])
def test_slurm_root_node(nodes: str, root: str) -> None:
    assert slurm_root_node(nodes) == root


# --------------------------------------------------------------------------------------------------
# checks and diagnosis


def test_world_size_mismatch_shows_the_arithmetic() -> None:
    launch = Launch("torchrun", rank=0, world_size=2, local_world_size=2, num_nodes=1, master_port=1)
    report = check_rank(launch, devices=3, num_nodes=None, backend="gloo", accelerator="cpu")
    texts = [p["text"] for p in report.problems]
    assert any("WORLD_SIZE=2" in t and "devices(3) x num_nodes(1) = 3" in t for t in texts), texts


def test_missing_gloo_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    report = check_rank(Launch("torchrun", master_port=1), devices=None, num_nodes=None, backend="gloo",
                        accelerator="cpu")
    [problem] = [p for p in report.problems if "GLOO_SOCKET_IFNAME" in p["text"]]
    assert problem["blocking"] and "no interface nosuch0" in problem["text"] and "lo" in problem["text"]


def test_loopback_gloo_on_two_nodes_names_each_node_interface() -> None:
    reports = {r: _report(r, r // 2) for r in range(4)}
    [problem] = diagnose(reports, 4, num_nodes=2)
    assert problem.blocking and "gloo would bind loopback in a 2-node job" in problem.text
    assert "connectFullMesh" in problem.text and "hostname 'vm' resolves to 127.0.0.1" in problem.text
    assert "node 0 veth-ls0, node 1 veth-ls1" in problem.fix


def test_loopback_gloo_on_one_node_is_fine() -> None:
    reports = {r: _report(r, 0, num_nodes=1, world_size=2) for r in range(2)}
    assert diagnose(reports, 2, num_nodes=1) == []


def test_versions_and_missing_ranks() -> None:
    reports = {r: _report(r, 0, num_nodes=1, world_size=3) for r in range(2)}
    reports[1].versions = dict(reports[1].versions, torch="2.5.0")
    texts = [p.text for p in diagnose(reports, 3, num_nodes=1)]
    assert any("rank(s) 2 never reported" in t for t in texts), texts
    assert any("torch versions differ across ranks: rank 0 2.13.0, rank 1 2.5.0" in t for t in texts), texts


def test_report_round_trips_through_json() -> None:
    report = _report(0, 0)
    assert Report(**asdict(report)) == report


# --------------------------------------------------------------------------------------------------
# real runs (subprocesses, each with a hard timeout)


def _run(argv: list[str], timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
    if "MASTER_PORT" not in env:
        full_env.pop("MASTER_PORT", None)
    try:
        return subprocess.run(["timeout", "-k", "5", str(int(timeout)), *argv], cwd=ROOT, env=full_env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout + 15)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"{argv} hung past {timeout} s: {err.output}") from err


DOCTOR = [sys.executable, "-m", "lightning_sync.doctor", "--timeout", "30"]


@pytest.mark.slow
def test_plain_two_processes_via_console_script() -> None:
    out = _run([str(VENV_BIN / "lsync-doctor"), "--devices", "2", "--timeout", "30"])
    assert out.returncode == 0, out.stdout
    assert "launcher lightning, 2 rank(s) on 1 node(s), backend gloo" in out.stdout
    assert "OK: 2 rank(s) joined a gloo group" in out.stdout


@pytest.mark.slow
def test_torchrun_loopback() -> None:
    # --standalone is covered by test_recipes.py::test_torchrun_single_node
    out = _run([str(VENV_BIN / "torchrun"), "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                "--nproc_per_node=2", "-m", "lightning_sync.doctor", "--devices", "2", "--timeout", "30"])
    assert out.returncode == 0, out.stdout
    assert "launcher torchrun, 2 rank(s) on 1 node(s)" in out.stdout and "OK: 2 rank(s)" in out.stdout


@pytest.mark.slow
def test_world_size_mismatch_under_torchrun() -> None:
    out = _run([str(VENV_BIN / "torchrun"), "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                "--nproc_per_node=2", "-m", "lightning_sync.doctor", "--devices", "3", "--timeout", "30"])
    assert out.returncode != 0, out.stdout
    assert "world size mismatch: the torchrun launch has WORLD_SIZE=2" in out.stdout
    assert "devices(3) x num_nodes(1) = 3" in out.stdout and "--nproc_per_node=3" in out.stdout


@pytest.mark.slow
def test_master_port_in_use() -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _run([*DOCTOR[:-1], "10", "--devices", "2"], timeout=60, MASTER_PORT=str(port))
    assert out.returncode != 0, out.stdout
    assert f"MASTER_PORT={port} is already in use" in out.stdout, out.stdout


def test_doctor_imports_only_torch_and_stdlib() -> None:
    # It must start fast and run where Lightning is broken; lightning_sync/__init__ is not its business.
    import ast

    tree = ast.parse(Path(doctor.__file__).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) <= {"torch", "lightning_sync"}, imported


# --------------------------------------------------------------------------------------------------
# exposure and fail-fast (issue 17)


def test_public_master_addr_and_public_interfaces_are_warned() -> None:
    # only addresses are looked at: nothing is sent to 8.8.8.8 (the route lookup is a UDP connect, no packet)
    env = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "8.8.8.8", "MASTER_PORT": "29500"}
    report = check_rank(detect_launch(env, devices=2, num_nodes=1), 2, 1, "gloo", "cpu")
    warned = [n for n in report.notes if n.startswith("security: MASTER_ADDR=8.8.8.8 is a public address")]
    assert warned and "docs/security.md" in warned[0], report.notes
    notes = doctor.security_notes("127.0.0.1", ["127.0.0.1"], {"lo": "127.0.0.1", "eth0": "8.8.4.4"}, 29500)
    assert len(notes) == 1 and "eth0 8.8.4.4" in notes[0] and "*:29500" in notes[0]
    for private in ("127.0.0.1", "10.1.2.3", "172.16.0.9", "192.168.1.1", "100.64.0.1", "fd00::1", "169.254.0.5"):
        assert doctor.security_notes(private, [private], {"lo": "127.0.0.1", "eth0": private}, 1) == [], private


@pytest.mark.slow
def test_unresolvable_master_addr_fails_fast_with_the_right_hint() -> None:
    import time

    start = time.monotonic()
    out = _run([*DOCTOR, "--devices", "2"], timeout=60, MASTER_ADDR="no-such-host.invalid")
    took = time.monotonic() - start
    assert out.returncode != 0, out.stdout
    assert "MASTER_ADDR='no-such-host.invalid' does not resolve" in out.stdout, out.stdout
    assert "pick another free port" not in out.stdout and "frame #" not in out.stdout, out.stdout
    assert took < 30, (took, out.stdout)  # was 51 s
