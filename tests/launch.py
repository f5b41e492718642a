"""Run a test script from tests/scripts/ the way a user runs a training script, with a hard timeout.

    proc = launch_script(SCRIPT, out_dir, "--phase", "fit")     # Lightning's launcher starts the ranks
    reports = read_reports(out_dir, "fit", world=2)             # what each rank wrote: <phase>.rank<N>.json
    module = load_script(SCRIPT)                                # its helpers, imported without running it
    port = free_port()                                          # a free loopback port, for MASTER_PORT

The script runs under ``timeout -k 5`` (the launcher and the ranks it started are killed together),
and a failed run shows the tail of both output streams.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def load_script(path: Path) -> Any:
    """Import ``path`` as a module (its ``main`` guard keeps it from running)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch_script(script: Path, out: Path, *args: str, timeout: int = 300,
                  check: bool = True) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT --out OUT ARGS`` under ``timeout -k 5 TIMEOUT``; with ``check``, exit 0 is asserted."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["timeout", "-k", "5", str(timeout), sys.executable, str(script), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout + 20)
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for MASTER_PORT and --master_port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def read_reports(out: Path, phase: str, world: int) -> list[dict[str, Any]]:
    """The JSON report each rank wrote for ``phase``."""
    return [json.loads((out / f"{phase}.rank{r}.json").read_text()) for r in range(world)]
