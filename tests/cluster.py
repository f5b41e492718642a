"""The two-node test cluster (``ci/cluster.sh``) as a session-scoped pytest fixture.

    @pytest.mark.cluster
    def test_something(cluster):
        out = cluster.run("n0", "srun", "-N2", "--ntasks-per-node=2", "lsync-train", "trainer.devices=2",
                          "trainer.num_nodes=2", timeout=120)
        assert out.returncode == 0, out.stdout

        procs = [cluster.start(node, "torchrun", ...) for node in ("n0", "n1")]   # both nodes at once
        results = cluster.wait(procs, timeout=120)

        job = cluster.sbatch("recipes/launch_slurm.sbatch", env={"SCRIPT": "..."}, timeout=120)
        assert job.exit_code == 0, job.output

The cluster comes up once per session (about a second) and always goes down at the end. Tests are
skipped, with the reason, when not root, when network namespaces cannot be created, or when SLURM
cannot be installed. Concurrent pytest sessions on one machine each get their own cluster name
(``lsn``, ``lsnb``, ...; chosen under a file lock), so they never tear down each other's nodes.
Commands run with the venv's ``bin`` first on PATH (``python``, ``torchrun``, ``lsync-doctor``,
``lsync-train``), with SLURM_CONF set, from the repository root.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "ci" / "cluster.sh"
ADDR = {"n0": "10.200.0.1", "n1": "10.200.0.2"}
IFACE = {"n0": "veth-ls0", "n1": "veth-ls1"}
_NAMES = ("lsn", "lsnb", "lsnc", "lsnd", "lsne", "lsnf")


@dataclass
class Result:
    """A finished command: exit code (124/137: killed by its timeout) and merged stdout+stderr."""

    returncode: int
    stdout: str
    seconds: float


@dataclass
class Job:
    """A finished batch job: SLURM's exit code of the batch script and the job's output file."""

    job_id: str
    exit_code: int
    output: str
    seconds: float


class Cluster:
    """Handle on a running cluster; see the module docstring."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dir = Path(os.environ.get("LSYNC_CLUSTER_DIR", f"/tmp/lsync-cluster-{name}"))
        self.namespaces = (f"{name}0", f"{name}1")
        self.addr = dict(ADDR)
        self.iface = dict(IFACE)
        self.slurm_conf = self.dir / "slurm.conf"
        venv_bin = str(Path(sys.executable).parent)
        self.env = dict(os.environ, LSYNC_CLUSTER=name, PATH=f"{venv_bin}:{os.environ.get('PATH', '')}",
                        PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")

    def script(self, *args: str, timeout: float = 120) -> Result:
        """Run ``ci/cluster.sh ARGS`` for this cluster."""
        return _run(["bash", str(SCRIPT), *args], self.env, timeout)

    def command(self, node: str, *cmd: str, timeout: float = 120, net_only: bool = False,
                env: Mapping[str, str] | None = None) -> list[str]:
        """The argv that runs ``cmd`` on ``node`` under ``timeout -k 5``, with extra ``env`` set inside."""
        inner = ["env", *(f"{k}={v}" for k, v in (env or {}).items()), *cmd]
        return ["timeout", "-k", "5", str(int(timeout)), "bash", str(SCRIPT), "run",
                *(["--net-only"] if net_only else []), node, *inner]

    def run(self, node: str, *cmd: str, timeout: float = 120, net_only: bool = False,
            env: Mapping[str, str] | None = None) -> Result:
        """Run ``cmd`` on ``node`` (``"n0"``/``"n1"``) and wait; never raises on a non-zero exit.

        Args:
            net_only: enter only the node's network namespace (the machine's hostname and /etc/hosts,
                which resolve the hostname to 127.0.0.1: the classic multi-node misconfiguration).
            env: extra variables for the command.
        """
        return _run(self.command(node, *cmd, timeout=timeout, net_only=net_only, env=env), self.env, timeout + 10)

    def start(self, node: str, *cmd: str, timeout: float = 120, net_only: bool = False,
              env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
        """Start ``cmd`` on ``node`` without waiting (collect it with :meth:`wait`)."""
        return subprocess.Popen(self.command(node, *cmd, timeout=timeout, net_only=net_only, env=env), env=self.env,
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

    def wait(self, procs: Sequence[subprocess.Popen[str]], timeout: float = 130) -> list[Result]:
        """Wait for processes from :meth:`start`; kill (whole process group) whatever outlives ``timeout``."""
        start = time.monotonic()
        results = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                out, _ = proc.communicate()
                out += f"\n[killed by the test after {timeout:.0f} s]"
            results.append(Result(proc.returncode, out, time.monotonic() - start))
        return results

    def sbatch(self, script: str | Path, *args: str, env: Mapping[str, str] | None = None,
               timeout: float = 120) -> Job:
        """Submit ``script`` from n0, poll ``squeue`` until it ends (``sbatch --wait`` returns ~30 s late)."""
        out_dir = self.dir / "jobs"
        out_dir.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        sub = self.run("n0", "sbatch", "--parsable", f"--output={out_dir}/%j.out", str(script), *args, env=env,
                       timeout=30)
        job_id = sub.stdout.strip().splitlines()[-1].split(";")[0] if sub.returncode == 0 else ""
        if not job_id.isdigit():
            raise AssertionError(f"sbatch failed (exit {sub.returncode}): {sub.stdout}")
        while time.monotonic() - start < timeout:
            if not self.run("n0", "squeue", "-h", "-j", job_id, timeout=20).stdout.strip():
                break
            time.sleep(0.5)
        else:
            self.run("n0", "scancel", job_id, timeout=20)
            raise AssertionError(f"job {job_id} still running after {timeout:.0f} s; cancelled. Output so far:\n"
                                 + _read(out_dir / f"{job_id}.out"))
        info = self.run("n0", "scontrol", "show", "job", job_id, timeout=20).stdout
        code = next((w.split("=")[1] for w in info.split() if w.startswith("ExitCode=")), "-1:0")
        return Job(job_id, int(code.split(":")[0]), _read(out_dir / f"{job_id}.out"), time.monotonic() - start)

    def daemons(self) -> list[int]:
        """Pids of this cluster's live slurm daemons and of every process in its namespaces."""
        pids: list[int] = []
        for pidfile in self.dir.glob("*.pid"):
            try:
                pid = int(pidfile.read_text().strip())
                os.kill(pid, 0)
                pids.append(pid)
            except (ValueError, OSError):
                continue
        for ns in self.namespaces:
            if Path(f"/run/netns/{ns}").exists():
                out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout
                pids += [int(p) for p in out.split()]
        return sorted(set(pids))


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as err:
        return f"(no output file {path}: {err.strerror})"


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, 9)  # the test started this session leader; its group is only its children
    except OSError:
        proc.kill()


def _run(argv: list[str], env: Mapping[str, str], timeout: float) -> Result:
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=dict(env), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        out += f"\n[killed by the test after {timeout:.0f} s: {shlex.join(argv)}]"
    return Result(proc.returncode, out, time.monotonic() - start)


def cluster_unavailable() -> str | None:
    """Why this machine cannot host the test cluster, or None. Installs nothing (see :func:`install_tools`)."""
    if os.geteuid() != 0:
        return "the two-node test cluster needs root (network namespaces, mounts, slurm daemons)"
    return _netns_problem() if shutil.which("ip") else None  # without iproute2 yet: install_tools decides


def _netns_problem() -> str | None:
    probe = f"lsync-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=20)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    if made.returncode != 0:
        return f"cannot create network namespaces here (`ip netns add` failed: {made.stderr.strip()})"
    return None


def install_tools() -> str | None:
    """Install SLURM and the namespace tools when missing (apt-get, via ci/cluster.sh); why not, or None.

    Called only by the ``cluster_tools`` fixture, i.e. when a cluster test is about to run.
    """
    inst = _run(["bash", str(SCRIPT), "install"], os.environ, 600)
    if inst.returncode != 0:
        return (f"cannot install the cluster's tools (`bash ci/cluster.sh install` exit {inst.returncode}): "
                + inst.stdout.strip()[-500:])
    return None


def _claim_name() -> tuple[str, IO[str]]:
    """Pick a cluster name no other live pytest session holds; the returned open file keeps the claim."""
    wanted = os.environ.get("LSYNC_CLUSTER")
    for name in ([wanted] if wanted else list(_NAMES)):
        lock = open(f"/tmp/lsync-cluster-{name}.lock", "w")  # noqa: SIM115 - held for the session
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wanted else fcntl.LOCK_NB))
            return name, lock
        except OSError:
            lock.close()
    raise RuntimeError(f"every test cluster name ({', '.join(_NAMES)}) is held by another pytest session")


@pytest.fixture(scope="session")
def cluster_tools() -> str:
    """Skip unless the machine can host the cluster (installing SLURM if needed); the path of ``ci/cluster.sh``."""
    reason = cluster_unavailable() or install_tools() or _netns_problem()
    if reason:
        pytest.skip(reason)
    return str(SCRIPT)


@pytest.fixture(scope="session")
def cluster(cluster_tools: str) -> Iterator[Cluster]:
    """A running two-node SLURM cluster (n0, n1) for the whole session; always torn down."""
    name, lock = _claim_name()
    handle = Cluster(name)
    try:
        up = handle.script("up", timeout=120)
        if up.returncode != 0:
            pytest.fail(f"ci/cluster.sh up failed (exit {up.returncode}):\n{up.stdout}")
        yield handle
    finally:
        down = handle.script("down", timeout=120)
        lock.close()
        if down.returncode != 0:
            print(f"ci/cluster.sh down failed (exit {down.returncode}):\n{down.stdout}", file=sys.stderr)
