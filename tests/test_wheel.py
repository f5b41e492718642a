"""`pip install .` into a fresh venv, then `lsync-train` from outside the repository: the README's path.

The venv is made with `python3 -m venv` and `pip install -c constraints.txt .` (no extras, not
editable: torch is the CPU build pinned by constraints.txt), so it proves that the main job needs
nothing beyond setup.cfg's install_requires (the digits ship inside the package; no scikit-learn)
and that the configs and data land in the wheel. Installing torch takes 1-2 minutes, so the venv is
kept in .cache/ (git-ignored), keyed by setup.cfg + constraints.txt + pyproject.toml; later runs only
reinstall lightning_sync itself (`--force-reinstall --no-deps`) from a clean copy of the sources.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
CACHE = REPO / ".cache"


def run(*command: str | Path, timeout: int = 180, check: bool = True,
        **kwargs: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["timeout", "-k", "5", str(timeout), *map(str, command)], capture_output=True, text=True,
                          timeout=timeout + 20, **kwargs)  # type: ignore[call-overload]
    if check:
        assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def clean_copy(dest: Path) -> Path:
    """The sources pip needs, without build/ or egg-info left over in the checkout."""
    shutil.copytree(REPO / "lightning_sync", dest / "lightning_sync", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dest / name)
    return dest


def fresh_venv(src: Path) -> Path:
    """A venv with `pip install -c constraints.txt SRC` done (cached; see the module docstring)."""
    key = hashlib.sha256(b"".join((REPO / n).read_bytes() for n in ("setup.cfg", "constraints.txt",
                                                                    "pyproject.toml"))).hexdigest()[:12]
    CACHE.mkdir(exist_ok=True)
    venv = CACHE / f"venv-pip-install-{key}"
    pip_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    with open(CACHE / "venv.lock", "w") as lock:  # two test runs at once share one install
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / "installed").is_file():
            shutil.rmtree(venv, ignore_errors=True)
            for old in CACHE.glob("venv-pip-install-*"):  # an older key: setup.cfg or the pins changed
                shutil.rmtree(old, ignore_errors=True)
            run(sys.executable, "-m", "venv", venv, timeout=120, env=pip_env)
            run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-compile", "-c", REPO / "constraints.txt",
                src, timeout=900, env=pip_env)
            (venv / "installed").write_text(key)
        else:  # dependencies unchanged: reinstall only this package, from this checkout
            run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-compile", "--no-deps",
                "--force-reinstall", src, timeout=300, env=pip_env)
    return venv


@pytest.mark.serial  # 2 minutes: on the serial worker, which is done early, not the last test of a run
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_pip_install_then_lsync_train_outside_the_repo(tmp_path: Path) -> None:
    venv = fresh_venv(clean_copy(tmp_path / "src"))
    python = venv / "bin" / "python"
    site = Path(run(python, "-c", "import lightning_sync, pathlib; print(pathlib.Path(lightning_sync.__file__).parent)",
                    cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}).stdout.strip())
    assert site.is_relative_to(venv), f"lightning_sync imported from {site}, not the fresh venv"
    assert (site / "conf" / "trainer" / "cpu_ddp.yaml").is_file() and (site / "assets" / "digits.npz").is_file()
    no_sklearn = run(python, "-c", "import sklearn", check=False)
    assert no_sklearn.returncode != 0, "the fresh venv has scikit-learn: the test would not prove the data ships"

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | {"OMP_NUM_THREADS": "1"}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # what `source venv/bin/activate` does
    proc = run("lsync-train", "trainer.max_epochs=1", cwd=outside, env=env, timeout=300)
    (summary_file,) = outside.glob("outputs/*/*/summary.json")
    summary = json.loads(summary_file.read_text())
    assert summary["world_size"] == 2 and summary["val_size"] == 359 and 0.0 <= summary["val_acc"] <= 1.0, summary
    assert "lsync-train: root seed 1234 | world size 2" in proc.stdout
    for rank in (0, 1):  # both ranks ran the installed copy
        assert f"lightning_sync from {site}" in (summary_file.parent / f"rank{rank}.log").read_text()

    # The resume promise needs no extra: a checkpoint written mid-epoch resumes to the exact batch and the
    # same final weights with the default install (torchdata is a requirement, not an extra).
    script = REPO / "tests" / "scripts" / "fit_resume.py"
    run(python, script, "--out", tmp_path / "resume", "--plan", "full:2@full,stop:2:10:5@stop,resume:2:stop@resume",
        cwd=outside, env=env, timeout=400)
    steps = {tag: [json.loads((tmp_path / "resume" / tag / f"rank{r}.json").read_text())["steps"] for r in (0, 1)]
             for tag in ("full", "stop", "resume")}
    for r in (0, 1):
        assert steps["stop"][r] == steps["full"][r][:10] and steps["resume"][r] == steps["full"][r][10:], r
        import torch

        full, resumed = (torch.load(tmp_path / "resume" / tag / f"rank{r}.pt") for tag in ("full", "resume"))
        assert all(torch.equal(full[k], resumed[k]) for k in full), f"rank {r}: the final weights differ"

    # A dependency that really is optional: one message, before any rank starts, with an install
    # command that works from a clone.
    proc = run("lsync-train", "logger=tensorboard", f"hydra.run.dir={outside / 'tb'}", cwd=outside, env=env,
               check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137), out[-3000:]
    assert out.count("lsync-train: config error: logger.tensorboard") == 1, out[-3000:]
    assert "pip install tensorboard" in out and "-c constraints.txt" in out, out[-3000:]
    assert "Traceback" not in out and not (outside / "tb").exists(), out[-3000:]
    proc = run("lsync-train", "-m", "seed=1,2", "hydra/launcher=submitit_local", f"hydra.sweep.dir={outside / 'sw'}",
               cwd=outside, env=env, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137) and "Traceback" not in out, out[-3000:]
    assert out.count("lsync-train: config error: hydra/launcher._target_=") == 1, out[-3000:]
    assert "pip install hydra-submitit-launcher" in out and not (outside / "sw").exists(), out[-3000:]


def test_shipped_digits_equal_scikit_learns() -> None:
    """assets/digits.npz was written once from scikit-learn's load_digits(): same values, same order. scikit-learn
    is the reference scripts/bootstrap.sh installs beside the venv (``$VENV/reference``, off sys.path); compared in
    a process of its own, so that no other test's processes import scipy."""
    reference = Path(sys.prefix) / "reference"
    assert (reference / "sklearn").is_dir(), f"no scikit-learn in {reference}: run bash scripts/bootstrap.sh"
    check = """
import numpy as np, torch
from sklearn.datasets import load_digits as reference
from lightning_sync.data import load_digits
images, labels = load_digits()
ref_images, ref_labels = reference(return_X_y=True)
assert images.dtype == labels.dtype == torch.uint8 and tuple(images.shape) == (1797, 64), (images.dtype, images.shape)
assert np.array_equal(images.double().numpy(), ref_images) and np.array_equal(labels.long().numpy(), ref_labels)
print("same digits")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(reference), os.environ.get("PYTHONPATH")]))}
    proc = run(sys.executable, "-c", check, env=env, cwd=REPO)
    assert proc.stdout.strip() == "same digits"
    assert (REPO / "lightning_sync" / "assets" / "digits.npz").stat().st_size < 100_000
