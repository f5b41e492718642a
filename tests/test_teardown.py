"""ddp_sync exits cleanly: the gloo teardown crash of Lightning's ddp (docs/strategy.md) does not happen."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "fit_seed.py"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_twenty_consecutive_fits_exit_zero(tmp_path: Path) -> None:
    """Plain ddp aborts at exit in about 1 run in 3-10 here ("terminate called without an active exception")."""
    codes = []
    for i in range(20):
        out = tmp_path / str(i)
        out.mkdir()
        proc = subprocess.run(["timeout", "-k", "5", "120", sys.executable, str(SCRIPT), "--out", str(out),
                               "--epochs", "1"], capture_output=True, text=True, timeout=140)
        codes.append(proc.returncode)
        assert proc.returncode == 0, f"run {i} exited {proc.returncode} (codes so far {codes}):\n{proc.stderr[-3000:]}"
        assert (out / "rank0.json").exists() and (out / "rank1.json").exists()
