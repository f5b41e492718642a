"""lsync-train across the two-node test cluster (tests/cluster.py; root only): 2 nodes x 2 processes,
every launcher, the same exact validation accuracy as one node with 4 processes, traffic on the veth
link between the nodes; and a rank SIGKILLed mid-training takes everything down quickly, by name.

Every launcher runs under ``timeout -k 5 N`` (Cluster.run/start); the last test checks that nothing
is left in the nodes but the SLURM daemons.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import ROOT, Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

RECIPES = ROOT / "recipes"
SEED = 1
# 3 epochs of the default model (digits_cnn, ddp_sync, SyncBatchNorm): ~0.8-0.95 exact accuracy, ~20 s.
TRAIN = ["trainer.max_epochs=3", "callbacks=minimal", "trainer.enable_checkpointing=false",
         "trainer.enable_progress_bar=false", "logger=none"]
LAYOUT = ["trainer.devices=2", "trainer.num_nodes=2"]
STEPS = 3 * 12  # optimizer steps per rank: 1438 training images / 4 ranks = 360 -> 12 batches of 32, x 3 epochs


@pytest.fixture(scope="module")
def grad_bytes() -> int:
    """float32 gradient bytes of the default model: what one all-reduce moves per step (at least once
    across the link: half of the ranks' contributions live on the other node)."""
    from lightning_sync.models import DigitsCNN

    model = DigitsCNN(channels=32, num_classes=10, lr=0.1, momentum=0.9, weight_decay=5e-4, dropout=0.1)
    return 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def link_bytes(cluster: Cluster) -> int:
    """rx + tx bytes of n0's end of the veth pair (read from inside n0's network namespace)."""
    out = subprocess.run(["ip", "-n", cluster.namespaces[0], "-s", "-j", "link", "show", cluster.iface["n0"]],
                         capture_output=True, text=True, timeout=20, check=True).stdout
    stats = json.loads(out)[0]["stats64"]
    return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])


def summary(run_dir: Path, output: str) -> dict[str, Any]:
    path = run_dir / "summary.json"
    assert path.exists(), f"no {path}; output:\n{output[-6000:]}"
    result: dict[str, Any] = json.loads(path.read_text())
    return result


@pytest.fixture(scope="module")
def reference(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One node, 4 processes (torchrun --standalone, loopback), same seed: the accuracy to match."""
    run = tmp_path_factory.mktemp("reference")
    before = link_bytes(cluster)
    out = cluster.run("n0", "bash", str(RECIPES / "launch_torchrun_single_node.sh"), f"seed={SEED}", *TRAIN,
                      f"hydra.run.dir={run}", env={"NPROC": "4"}, timeout=240)
    assert out.returncode == 0, out.stdout[-6000:]
    result = summary(run, out.stdout)
    assert result["world_size"] == 4 and result["seed"] == SEED and result["val_size"] == 359
    assert result["val_acc"] > 0.5, result  # it learned something: equal accuracies mean something
    result["link_bytes"] = link_bytes(cluster) - before  # a control: one node, nothing on the link
    print(f"reference 1 node x 4: val acc {result['val_acc']!r}, {result['link_bytes']} bytes on veth "
          f"({out.seconds:.1f} s)")
    return result


def check_two_node_run(run: Path, output: str, reference: dict[str, Any], moved: int, grad_bytes: int) -> None:
    result = summary(run, output)
    assert result["world_size"] == 4, result
    assert result["val_acc"] == reference["val_acc"], (result, reference)  # exact, not approximately
    assert result["val_size"] == reference["val_size"]
    assert reference["link_bytes"] < 100_000, reference  # the one-node run kept off the link
    assert moved >= grad_bytes * STEPS, f"only {moved} bytes crossed veth; expected >= {grad_bytes} x {STEPS}"
    ranks = {int(p.stem.removeprefix("rank")) for p in run.glob("rank*.log")}
    assert ranks == {0, 1, 2, 3}, ranks
    print(f"{run.name}: val acc {result['val_acc']!r}, {moved} bytes on veth (gradients {grad_bytes} x {STEPS})")


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_torchrun_recipe_two_nodes(cluster: Cluster, tmp_path: Path, reference: dict[str, Any], grad_bytes: int,
                                   rdzv: str) -> None:
    run = tmp_path / f"torchrun-{rdzv}"
    port = "29611" if rdzv == "static" else "29612"
    before = link_bytes(cluster)
    procs = [cluster.start(node, "bash", str(RECIPES / "launch_torchrun_multinode.sh"), f"seed={SEED}", *TRAIN,
                           f"hydra.run.dir={run}", timeout=240,
                           env={"NNODES": "2", "NODE_RANK": str(r), "MASTER_ADDR": cluster.addr["n0"],
                                "MASTER_PORT": port, "RDZV": rdzv, "RDZV_ID": f"mn-{rdzv}-{os.getpid()}"})
             for r, node in enumerate(("n0", "n1"))]
    n0, n1 = cluster.wait(procs, timeout=250)
    assert n0.returncode == 0 and n1.returncode == 0, n0.stdout[-4000:] + "\n=== n1 ===\n" + n1.stdout[-4000:]
    check_two_node_run(run, n0.stdout + n1.stdout, reference, link_bytes(cluster) - before, grad_bytes)


def test_srun_two_nodes(cluster: Cluster, tmp_path: Path, reference: dict[str, Any], grad_bytes: int) -> None:
    run = tmp_path / "srun"
    before = link_bytes(cluster)
    out = cluster.run("n0", "srun", "-N2", "--ntasks-per-node=2", "lsync-train", *LAYOUT, f"seed={SEED}", *TRAIN,
                      f"hydra.run.dir={run}", timeout=240)
    assert out.returncode == 0, out.stdout[-6000:]
    check_two_node_run(run, out.stdout, reference, link_bytes(cluster) - before, grad_bytes)


def test_sbatch_recipe_two_nodes(cluster: Cluster, tmp_path: Path, reference: dict[str, Any],
                                 grad_bytes: int) -> None:
    run = tmp_path / "sbatch"
    before = link_bytes(cluster)
    job = cluster.sbatch(RECIPES / "launch_slurm.sbatch", f"seed={SEED}", *TRAIN, f"hydra.run.dir={run}",
                         timeout=240)
    assert job.exit_code == 0, job.output[-6000:]
    assert "2 node(s) x 2 task(s)" in job.output
    check_two_node_run(run, job.output, reference, link_bytes(cluster) - before, grad_bytes)


def test_submitit_slurm_multirun_two_jobs_two_nodes_each(cluster: Cluster, tmp_path: Path,
                                                         reference: dict[str, Any], grad_bytes: int) -> None:
    # hydra/launcher=submitit_slurm: nodes=${trainer.num_nodes}, tasks_per_node=${trainer.devices}, so each
    # job of the array is 2 nodes x 2 tasks. The test nodes announce 2 CPUs and no memory: 1 CPU per task.
    sweep = tmp_path / "sweep"
    before = link_bytes(cluster)
    out = cluster.run("n0", "lsync-train", "-m", f"seed={SEED},{SEED + 1}", "hydra/launcher=submitit_slurm", *LAYOUT,
                      *TRAIN, "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=null",
                      f"hydra.sweep.dir={sweep}", timeout=400)
    assert out.returncode == 0, out.stdout[-6000:]
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert jobs == ["0", "1"], jobs
    first, second = (summary(sweep / j, out.stdout) for j in jobs)
    assert (first["seed"], second["seed"]) == (SEED, SEED + 1)
    assert first["run_dir"] == str(sweep / "0") and second["run_dir"] == str(sweep / "1")
    assert second["world_size"] == 4 and 0 <= second["val_acc"] <= 1
    # job 0 is the reference's run; both jobs' traffic counts, so ask for twice the gradients
    check_two_node_run(sweep / "0", out.stdout, reference, (link_bytes(cluster) - before) // 2, grad_bytes)
    assert {int(p.stem.removeprefix("rank")) for p in (sweep / "1").glob("rank*.log")} == {0, 1, 2, 3}
    # submitit returns once the results are written; the batch steps end a moment later
    assert _wait_idle(cluster, 60), {**_node_pids(cluster, "n0"), **_node_pids(cluster, "n1")}


# ------------------------------------------------------------------ a rank dies


def _node_pids(cluster: Cluster, node: str) -> dict[int, str]:
    """pid -> command line of every process in a node's network namespace, SLURM's daemons excluded."""
    ns = cluster.namespaces[0 if node == "n0" else 1]
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20).stdout
    procs = {}
    for pid in map(int, out.split()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if cmd.split(" ")[0].rsplit("/", 1)[-1] not in ("slurmctld", "slurmd", "slurmstepd", ":"):
            procs[pid] = cmd
    return procs


def _wait_idle(cluster: Cluster, timeout: float) -> bool:
    """Wait until SLURM has no job and the nodes run nothing but its daemons."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (not cluster.run("n0", "squeue", "-h", timeout=20).stdout.strip()
                and not _node_pids(cluster, "n0") and not _node_pids(cluster, "n1")):
            return True
        time.sleep(0.5)
    return False


def _rank_of(pid: int) -> int | None:
    try:
        env = dict(line.split("=", 1) for line in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in line)
    except OSError:
        return None
    return int(env["RANK"]) if "RANK" in env and "TORCHELASTIC_RUN_ID" in env else None


def test_sigkilled_rank_takes_every_process_down_by_name(cluster: Cluster, tmp_path: Path) -> None:
    run = tmp_path / "killed"
    assert _wait_idle(cluster, 60), "leftovers from an earlier test"
    before = link_bytes(cluster)
    procs = [cluster.start(node, "bash", str(RECIPES / "launch_torchrun_multinode.sh"), f"seed={SEED}",
                           "trainer.max_epochs=1000", *TRAIN[1:], f"hydra.run.dir={run}", timeout=300,
                           env={"NNODES": "2", "NODE_RANK": str(r), "MASTER_ADDR": cluster.addr["n0"],
                                "MASTER_PORT": "29613"})
             for r, node in enumerate(("n0", "n1"))]
    try:
        deadline = time.monotonic() + 200
        while link_bytes(cluster) - before < 3_000_000:  # gradients are flowing: training is under way
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "training never started"
            time.sleep(0.5)
        victim = next((pid for pid in _node_pids(cluster, "n1") if _rank_of(pid) == 3), None)
        assert victim is not None, _node_pids(cluster, "n1")
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        n0, n1 = cluster.wait(procs, timeout=60)
        gone = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    left = {**_node_pids(cluster, "n0"), **_node_pids(cluster, "n1")}
    print(f"rank 3 (pid {victim}) SIGKILLed: every process gone after {gone:.1f} s")
    (tmp_path / "output.txt").write_text(n0.stdout + "\n=== n1 ===\n" + n1.stdout)  # to read after a failure
    assert not left, f"left behind: {left}"
    assert gone < 60, n0.stdout[-3000:] + n1.stdout[-3000:]
    assert n0.returncode not in (0, 124, 137) and n1.returncode not in (0, 124, 137), (n0.returncode, n1.returncode)
    # n1's torchrun names the rank it lost; n0's ranks name the node and its ranks (lightning_sync.peers)
    assert "rank      : 3 (local_rank: 1)" in n1.stdout and "Signal 9 (SIGKILL)" in n1.stdout, n1.stdout[-3000:]
    assert "lost contact with rank 2 or 3 (host n1, 10.200.0.2)" in n0.stdout, n0.stdout[-6000:]


# ------------------------------------------------------------------ preempted and requeued


def _job_state(cluster: Cluster, job_id: str) -> dict[str, str]:
    info = cluster.run("n0", "scontrol", "show", "job", job_id, timeout=20).stdout
    return dict(w.split("=", 1) for w in info.split() if "=" in w)


def test_sbatch_requeue_signal_resumes_to_the_uninterrupted_result(cluster: Cluster, tmp_path: Path) -> None:
    """`sbatch --requeue` on 2 nodes x 1 task; SIGUSR1 to every task mid-training (what
    `#SBATCH --signal=SIGUSR1@90` sends before the time limit): every rank writes Lightning's
    hpc_ckpt_1.ckpt at the same step, rank 0 runs `scontrol requeue`, SLURM restarts the job, and
    lsync-train resumes from the checkpoint to the very accuracy of an uninterrupted 2-rank run.
    (2 ranks: with more, DDP's first all-reduce after a resume sums in another order; docs/resume.md.)"""
    ref_run = tmp_path / "reference"
    ref = cluster.run("n0", "lsync-train", f"seed={SEED}", *TRAIN, "trainer.devices=2", f"hydra.run.dir={ref_run}",
                      timeout=240)
    assert ref.returncode == 0, ref.stdout[-6000:]
    reference = summary(ref_run, ref.stdout)
    assert _wait_idle(cluster, 60), "leftovers from an earlier test"
    run = tmp_path / "requeued"
    out_file = cluster.dir / "jobs" / f"requeue-{os.getpid()}.out"
    out_file.parent.mkdir(parents=True, exist_ok=True)
    before = link_bytes(cluster)
    sub = cluster.run("n0", "sbatch", "--parsable", "--requeue", "--open-mode=append", f"--output={out_file}",
                      "--ntasks-per-node=1", str(RECIPES / "launch_slurm.sbatch"), f"seed={SEED}", *TRAIN,
                      f"hydra.run.dir={run}", timeout=30)
    job_id = sub.stdout.strip().splitlines()[-1].split(";")[0] if sub.returncode == 0 else ""
    assert job_id.isdigit(), sub.stdout
    try:
        deadline = time.monotonic() + 200
        while link_bytes(cluster) - before < 3_000_000:  # ~13 steps of gradients: inside epoch 0 of 3 (22 steps)
            assert time.monotonic() < deadline, "training never started:\n" + out_file.read_text()[-4000:]
            time.sleep(0.2)
        signalled = cluster.run("n0", "scancel", "--signal=USR1", job_id, timeout=20)
        assert signalled.returncode == 0, signalled.stdout
        deadline = time.monotonic() + 300
        restarted = False
        while time.monotonic() < deadline:
            state = _job_state(cluster, job_id)
            if int(state.get("Restarts", "0")) >= 1 and state.get("JobState") == "PENDING" and not restarted:
                # SLURM holds a requeued job until its BeginTime (a delay of its own); no reason to wait here
                cluster.run("n0", "scontrol", "update", f"JobId={job_id}", "StartTime=now", timeout=20)
                restarted = True
            if state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"job {job_id} did not finish: {state}\n" + out_file.read_text()[-6000:])
    finally:
        cluster.run("n0", "scancel", job_id, timeout=20)
    output = out_file.read_text()
    assert state["JobState"] == "COMPLETED" and state.get("Restarts") == "1", (state, output[-6000:])
    assert (run / "hpc_ckpt_1.ckpt").is_file() and not (run / "hpc_ckpt_2.ckpt").exists()
    assert "resuming from" in output and "hpc_ckpt_1.ckpt" in output, output[-6000:]
    result = summary(run, output)
    assert result["world_size"] == reference["world_size"] == 2, (result, reference)
    assert result["val_acc"] == reference["val_acc"], (result, reference)  # exact, not approximately
    assert _wait_idle(cluster, 60), {**_node_pids(cluster, "n0"), **_node_pids(cluster, "n1")}


# ------------------------------------------------------------------ replica groups on torchft, one per node


@pytest.mark.parametrize("nproc", [1, 2])
def test_sbatch_ft_recipe_a_group_killed_on_its_node_recovers_from_the_other(cluster: Cluster, tmp_path: Path,
                                                                            nproc: int) -> None:
    """recipes/launch_slurm_ft.sbatch on 2 nodes: torchft's lighthouse on n0's address, one `lsync-ft-run --group
    g` job step per node, each group one process or two (NPROC_PER_REPLICA=2: torchrun on the node, devices=2).
    Group 1 (on n1) SIGKILLs itself in the middle of step 9; lsync-ft-run restarts it on n1, it recovers from group
    0 across the link, and (MIN_REPLICAS=2: no step alone) both end with the same weights."""
    import sys

    assert _wait_idle(cluster, 60), "leftovers from an earlier test"
    job = cluster.sbatch(RECIPES / "launch_slurm_ft.sbatch", sys.executable, str(RECIPES / "fault_tolerant_ddp.py"),
                         "--kill-at", "8", "--max-steps", "20",
                         env={"MIN_REPLICAS": "2", "NPROC_PER_REPLICA": str(nproc)}, timeout=300)
    (tmp_path / "output.txt").write_text(job.output)  # to read after a failure
    assert job.exit_code == 0, job.output[-6000:]
    assert f"lighthouse {cluster.addr['n0']}:" in job.output, job.output[-3000:]
    # (under torchrun: "its rank r was killed by SIGKILL first")
    assert re.search(r"lsync-ft-run: replica group 1 ended \([^)]*killed by SIGKILL[^)]*\); restarting it", job.output), \
        job.output[-6000:]
    assert "ddp_sync_ft: replica group 1 (life 1) recovers from a live group at step 8" in job.output
    checksums = dict(re.findall(r"replica group (\d) \(life \d\): step 20, weights checksum (\S+)", job.output))
    assert sorted(checksums) == ["0", "1"] and checksums["0"] == checksums["1"], job.output[-6000:]
    assert "lsync-ft: every replica group ended (exit 0)" in job.output
    assert _wait_idle(cluster, 60), {**_node_pids(cluster, "n0"), **_node_pids(cluster, "n1")}
