"""The built wheel carries lightning_sync/conf: lsync-train works from a fresh venv, outside the repo."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
TINY = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "callbacks=minimal",
        "trainer.enable_checkpointing=false"]


def run(*command: str | Path, timeout: int = 180, **kwargs: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["timeout", "-k", "5", str(timeout), *map(str, command)], capture_output=True, text=True,
                          timeout=timeout + 20, **kwargs)  # type: ignore[call-overload]
    assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.mark.slow
@pytest.mark.timeout(3 * (180 + 20) + (240 + 20) + 60)  # the inner limits of its four commands, in a row
def test_wheel_install_runs_lsync_train_outside_the_repo(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a clean copy: building in the checkout would leave build/ behind (and reuse it)
    shutil.copytree(REPO / "lightning_sync", src / "lightning_sync", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src)
    (wheel,) = (tmp_path / "dist").glob("lightning_sync-*.whl")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    # Dependencies (torch, lightning, hydra, scikit-learn) come from this venv, *after* the fresh
    # one's own site-packages; .pth files there (our editable install) are not processed.
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", "--no-deps", wheel)
    outside, out = tmp_path / "elsewhere", tmp_path / "elsewhere" / "run"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    proc = run(venv / "bin" / "lsync-train", *TINY, f"hydra.run.dir={out}", cwd=outside, env=env, timeout=240)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and "lsync-train: root seed 1234 | world size 2" in proc.stdout
    for rank in (0, 1):  # both ranks ran the installed copy, configs included
        assert f"lightning_sync from {site / 'lightning_sync'}" in (out / f"rank{rank}.log").read_text()
    assert (site / "lightning_sync" / "conf" / "trainer" / "cpu_ddp.yaml").is_file()
