"""Fault tolerance across replica groups (issue 43): ``lsync-ft-run`` and torchft's manager bound to loopback.

Real processes: torchft's lighthouse (in lsync-ft-run's process, on 127.0.0.1), two replica groups of
tests/scripts/ft_replica.py (torchft's Manager through ``lightning_sync.ft.replica_context``). A group killed
mid-run is restarted by lsync-ft-run, heals from the live group (no checkpoint file) and both end with the same
weights, while the other group never stopped; a group that fails in every life is named with its causes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "scripts" / "ft_replica.py"


def _ft_run(out: Path, ft_args: list[str], script_args: list[str], timeout: int = 180) -> subprocess.CompletedProcess[str]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["timeout", "-k", "5", str(timeout), sys.executable, "-m", "lightning_sync.ft.launch", *ft_args, "--",
           sys.executable, str(SCRIPT), "--out", str(out), *script_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 20)


def _log(out: Path, group: int) -> list[tuple[int, int, int, int]]:
    rows = []
    for line in (out / f"group{group}.log").read_text().splitlines():
        _, life, _, step, _, participants, _, committed = line.split()
        rows.append((int(life), int(step), int(participants), int(committed)))
    return rows


@pytest.mark.slow
@pytest.mark.alone  # timing: the survivor must still be training when the restarted group is back
@pytest.mark.timeout(240)
def test_a_killed_group_is_restarted_healed_from_its_peer_and_the_other_never_stops(tmp_path: Path) -> None:
    proc = _ft_run(tmp_path, ["--replicas", "2", "--max-restarts", "2", "--heartbeat-timeout-ms", "1000"],
                   ["--steps", "40", "--kill-at", "12", "--alone-sleep", "0.5"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "lighthouse http://127.0.0.1:" in proc.stderr
    assert "replica group 1 ended (killed by SIGKILL); restarting it (restart 1 of 2); the others go on" in proc.stderr
    assert "all 2 replica groups finished; restarted: group 1 x1" in proc.stderr
    first, second = torch.load(tmp_path / "group0.pt"), torch.load(tmp_path / "group1.pt")
    assert first["step"] == second["step"] == 40
    assert torch.equal(first["weights"], second["weights"])  # the restarted group took the live one's state
    assert (first["restart"], second["restart"], second["healed"]) == (0, 1, True)
    assert first["steps_alone"] >= 1  # group 0 committed steps while group 1 was dead
    survivor = _log(tmp_path, 0)
    assert {life for life, *_ in survivor} == {0}  # one life: it was never restarted
    committed = [step for _, step, _, c in survivor if c]
    # from the kill on, every step once, in order (a failed step is redone, not skipped). (At the start the group
    # that formed the first quorum alone may be a few steps ahead: the other one then heals from it.)
    assert committed[committed.index(12):] == list(range(12, 40)), committed
    restarted = [step for life, step, _, _ in _log(tmp_path, 1) if life == 1]
    # its first step (numbered before the heal) took the live group's state: it goes on at that group's step
    assert restarted[0] == 0 and restarted[1] > 12 and restarted[1:] == list(range(restarted[1], 40)), restarted


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_group_failing_in_every_life_is_named_with_its_causes_and_the_other_finishes(tmp_path: Path) -> None:
    proc = _ft_run(tmp_path, ["--replicas", "2", "--max-restarts", "1"], ["--steps", "10", "--fail-always"])
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert ("replica group 1 failed: exit code 3 after 1 restart(s) (causes in order: exit code 3, exit code 3)"
            in proc.stderr), proc.stderr[-4000:]
    alone = torch.load(tmp_path / "group0.pt")
    assert alone["step"] == 10 and alone["steps_alone"] == 10


@pytest.mark.parametrize(("args", "message"), [
    (["--replicas", "0", "--", "true"], "--replicas must be >= 1"),
    (["--replicas", "2", "--min-replicas", "3", "--", "true"], "--min-replicas 3 is more than --replicas 2"),
    (["--replicas", "2"], "give the training command after --"),
])
def test_bad_arguments_are_refused_before_anything_starts(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "lightning_sync.ft.launch", *args], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_outside_a_replica_group_the_context_says_how_to_start_one() -> None:
    from lightning_sync.ft import ReplicaGroup

    with pytest.raises(RuntimeError, match="lsync-ft-run --replicas R -- CMD"):
        ReplicaGroup.from_env({})
