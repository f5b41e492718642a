"""ddp_sync exits cleanly: the gloo teardown crash of Lightning's ddp (docs/strategy.md) does not happen."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "fit_seed.py"
RUNS = 12  # plain ddp aborts in about 1 run in 3-10 here: 12 runs miss that rate with p = 0.8% - 28%


@pytest.mark.serial  # 2 minutes: on the serial worker, which is done early, not the last test of a run
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_consecutive_fits_exit_zero(tmp_path: Path) -> None:
    """Plain ddp aborts at exit in about 1 run in 3-10 here ("terminate called without an active exception").

    Two runs at a time (4 ranks on 2 cores): start-up dominates a run, and a loaded machine is where
    exit-time races show."""
    codes: list[int] = []
    for first in range(0, RUNS, 2):
        procs = []
        for i in (first, first + 1):
            out = tmp_path / str(i)
            out.mkdir()
            procs.append((i, out, subprocess.Popen(["timeout", "-k", "5", "120", sys.executable, str(SCRIPT), "--out",
                                                    str(out), "--epochs", "1"], stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.PIPE, text=True)))
        for i, out, proc in procs:
            _, err = proc.communicate(timeout=140)
            codes.append(proc.returncode)
            assert proc.returncode == 0, f"run {i} exited {proc.returncode} (codes so far {codes}):\n{err[-3000:]}"
            assert (out / "rank0.json").exists() and (out / "rank1.json").exists()
