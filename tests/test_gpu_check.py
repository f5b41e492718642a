"""scripts/gpu_check.sh on this CPU machine, up to where it needs CUDA (and, with LSYNC_GPU_DRY_RUN=1,
past it: the install from downloaded wheels into a venv over a bare host, the tier, the report).

The host stands in for a GPU machine's image: a venv with torch, Lightning, torchmetrics, pytest and
the test extras the tier imports, but none of hydra-core, omegaconf, torchdata (so the check must
install them, from the wheels ``--download`` fetched, with no index). It is kept in .cache/.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
HOST_NEEDS = ("torch", "lightning", "pytorch-lightning", "torchmetrics", "pytest", "pytest-timeout", "pyarrow")


def _run(command: list[str], timeout: int, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(["timeout", "-k", "5", str(timeout), *command], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout + 20, env={**full, **(env or {})})


def test_without_cuda_it_says_so_and_exits_2(tmp_path: Path) -> None:
    proc = _run(["bash", str(SCRIPT), str(tmp_path / "report")], 120, env={"PYTHON": sys.executable})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gpu_check: no CUDA device (torch " in proc.stderr and "CUDA build" in proc.stderr


def _bare_host() -> Path:
    pins = (REPO / "constraints.txt").read_bytes()
    key = hashlib.sha256(pins + " ".join(HOST_NEEDS).encode()).hexdigest()[:12]
    cache = REPO / ".cache"
    cache.mkdir(exist_ok=True)
    venv = cache / f"venv-gpu-host-{key}"
    with open(cache / "venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / "installed").is_file():
            for old in cache.glob("venv-gpu-host-*"):
                subprocess.run(["rm", "-rf", str(old)], check=True)
            assert _run([sys.executable, "-m", "venv", str(venv)], 120).returncode == 0
            pip = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", "-c",
                        str(REPO / "constraints.txt"), *HOST_NEEDS], 900)
            assert pip.returncode == 0, pip.stderr[-3000:]
            (venv / "installed").write_text(key)
    return venv


@pytest.mark.serial  # 2 minutes: on the serial worker, which is done early, not the last test of a run
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_dry_run_from_a_bare_host_installs_from_wheels_runs_the_tier_and_reports(tmp_path: Path) -> None:
    host = _bare_host() / "bin" / "python"
    assert _run([str(host), "-c", "import hydra"], 60).returncode != 0, "the host must lack hydra-core"
    wheels = tmp_path / "wheels"
    fetched = _run(["bash", str(SCRIPT), "--download", str(wheels)], 300, env={"PYTHON": sys.executable})
    assert fetched.returncode == 0, fetched.stderr[-3000:]
    names = {p.name.split("-")[0] for p in wheels.glob("*.whl")}
    assert {"hydra_core", "omegaconf", "antlr4_python3_runtime", "torchdata", "lightning"} <= names
    report = tmp_path / "report"
    proc = _run(["bash", str(SCRIPT), str(report)], 600,
                env={"PYTHON": str(host), "LSYNC_GPU_DRY_RUN": "1", "LSYNC_WHEELS": str(wheels),
                     "LSYNC_GPU_VENV": str(tmp_path / "venv-gpu"), "PIP_NO_INDEX": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: no CUDA device" in proc.stdout + proc.stderr
    installing = next(line for line in proc.stdout.splitlines() if line.startswith("gpu_check: installing"))
    assert all(name in installing for name in ("hydra-core", "omegaconf", "torchdata")), installing
    text = (report / "report.md").read_text()
    assert "failures 0, errors 0" in text and "pytest -m gpu: exit 0" in text
    for name in ("nccl_world_of_one", "two_ranks_on_one_gpu", "native_syncbatchnorm", "cuda_rng_states",
                 "cuda_outputs", "lsync_train_gpu_ddp"):
        assert any(name in line and "skipped" in line for line in text.splitlines()), (name, text)
    assert "bench/bench_gpu.py (exit 2)" in text and "no CUDA device" in text
    versions = (report / "versions.txt").read_text()
    host_torch = _run([str(host), "-c", "import torch; print(torch.__version__)"], 60).stdout.strip()
    assert f"torch=={host_torch}" in versions, "the check must keep the machine's torch"
