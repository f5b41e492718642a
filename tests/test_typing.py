"""The package type-checks under mypy --strict (setup.cfg [mypy]) and ships py.typed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(660)  # above mypy's own 600 s limit
def test_package_is_typed_strict() -> None:
    assert (ROOT / "lightning_sync" / "py.typed").exists()
    proc = subprocess.run([sys.executable, "-m", "mypy", "lightning_sync"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
