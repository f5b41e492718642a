"""Fault tolerance across replica groups (issue 43): ``lsync-ft-run``, torchft's manager bound to loopback, and
``strategy="ddp_sync_ft"`` (``FaultTolerantDDPStrategy``).

Real processes: torchft's lighthouse (in lsync-ft-run's process, on 127.0.0.1), two replica groups of
tests/scripts/ft_replica.py (torchft's Manager through ``lightning_sync.ft.replica_context``) or of
tests/scripts/fit_ft.py (a Lightning fit under ``ddp_sync_ft``). A group killed mid-run is restarted by
lsync-ft-run, recovers from the live group (no checkpoint file) and both end with the same weights, while the
other group never stopped; under ``ddp_sync_ft`` with ``--min-replicas 2`` the run with the kill ends with the
weights of Lightning's 2-rank ``ddp_sync`` run, bit for bit; a group that fails in every life is named with its
causes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# one at a time on the serial worker, beside the other worker's tests (tests/conftest.py): a restarted group is
# paced for (the survivor waits for its next life to start: scripts/_ft_pacing.py), so a loaded
# machine slows the run down without breaking it; two of them at once would share the lighthouses' heartbeats'
# margins. The two that measure a stall against torchft's timeouts run alone.
pytestmark = pytest.mark.serial

SCRIPT = Path(__file__).parent / "scripts" / "ft_replica.py"
FIT = Path(__file__).parent / "scripts" / "fit_ft.py"


# With 3 groups, fit_ft.py paces group 0 alone (--alone-sleep: after a step without group 1 it waits for group 1's
# next life to start); group 2 goes on to the next quorum. At lsync-ft-run's default join timeout (10 s) the lighthouse
# forms that quorum without group 0 (heartbeating, not yet asking) once a restart takes longer than that on a loaded
# machine; group 0 then asks several steps behind and, as designed, is restarted (lives [1, 1, 0], seen in a clean-clone
# run). A quorum that waits for every heartbeating group keeps the three together, as the test means them to be.
PACED_JOIN = ["--join-timeout-ms", "120000"]


def _ft_run(out: Path, ft_args: list[str], script_args: list[str], timeout: int = 180,
            script: Path = SCRIPT) -> subprocess.CompletedProcess[str]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["timeout", "-k", "5", str(timeout), sys.executable, "-m", "lightning_sync.ft.launch", *ft_args, "--",
           sys.executable, str(script), "--out", str(out), *script_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 20)


def _why(stderr: str) -> str:
    """lsync-ft-run's lines on its groups (which ended, why, which restarted) and the end of the run's output: what a
    failed assertion on the groups' lives shows (a group that ended in a run that succeeded leaves no other trace)."""
    groups = [line for line in stderr.splitlines() if "replica group" in line or "Error" in line]
    return "\n".join(groups[-40:]) + "\n--- the run's last output ---\n" + stderr[-3000:]


_CONTROLS: dict[tuple[str, ...], Path] = {}  # the control runs of this process, by their arguments


def _control(out: Path, *args: str) -> torch.Tensor:
    """Lightning's 2-rank ddp_sync run of fit_ft.py's model, seed and data: what the replica groups train (with
    ``--invariant``: one process). Run once per set of arguments in this process; later calls get a copy."""
    if args in _CONTROLS and _CONTROLS[args].is_dir():
        shutil.copytree(_CONTROLS[args], out)
        return torch.load(out / "group0.pt")["weights"]
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["timeout", "-k", "5", "150", sys.executable, str(FIT), "--out", str(out), "--control", *args],
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _CONTROLS[args] = out
    return torch.load(out / "group0.pt")["weights"]


def _same_state(ft: Path, control: Path, group: int) -> None:
    """Group ``group``'s whole state_dict (BatchNorm's running statistics included) is the control rank's, bit for bit."""
    mine, theirs = torch.load(ft / f"group{group}.pt")["state"], torch.load(control / f"group{group}.pt")["state"]
    assert mine.keys() == theirs.keys()
    differ = [k for k in mine if not torch.equal(mine[k], theirs[k])]
    assert not differ, f"group {group}: {differ} differ from the ddp_sync rank's"


def _epoch_means(out: Path, group: int) -> list[dict]:
    """Each epoch's logged values as the group saw them at its end (``loss_mean``: every step's loss once)."""
    rows = [json.loads(line) for line in (out / f"group{group}.epochs").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in ("life", "group_flag")} for row in rows]


def _same_means(ours: list[dict], theirs: list[dict]) -> None:
    """Epoch means alike: the training ones bit for bit, ``val_loss`` within 1e-6: a group evaluates the whole
    validation set in one process, a ddp_sync rank its shard before the sync, and the two sums round alike or
    not depending on the CPU's vector width (both are exact evaluations; the last bit differed on an AMD EPYC
    host, 2026-12-06)."""
    assert [{k: v for k, v in row.items() if k != "val_loss"} for row in ours] == \
        [{k: v for k, v in row.items() if k != "val_loss"} for row in theirs]
    assert [row.get("val_loss") for row in ours] == pytest.approx([row.get("val_loss") for row in theirs], rel=1e-6)


def _steps(out: Path, group: int | str) -> list[dict]:
    name = group if isinstance(group, str) else f"group{group}"  # ("group1r1": process 1 of group 1)
    return [json.loads(line) for line in (out / f"{name}.log").read_text().splitlines()]


def _log(out: Path, group: int) -> list[tuple[int, int, int, int]]:
    rows = []
    for line in (out / f"group{group}.log").read_text().splitlines():
        _, life, _, step, _, participants, _, committed = line.split()
        rows.append((int(life), int(step), int(participants), int(committed)))
    return rows


@pytest.mark.slow
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


def test_the_launcher_drains_a_groups_stderr_and_keeps_its_error_whatever_becomes_of_its_own(monkeypatch) -> None:
    """lsync-ft-run copies each group's standard error to its own and keeps the group's last exception line for
    the summary; when its own standard error fails (a closed pipe), it goes on draining the group's (the group
    would otherwise block writing to a full pipe)."""
    import io

    from lightning_sync.ft import launch

    class Closed(io.TextIOBase):
        def write(self, text: str) -> int:
            raise BrokenPipeError("closed")

    monkeypatch.setattr(sys, "stderr", Closed())
    life = launch._Life()
    stream = io.BytesIO(b"training\n[rank0]: ValueError: boom at step 5\n" * 5000
                        + b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    launch._pass_stderr(life, stream)
    assert stream.closed and life.last_error == "ValueError: boom at step 5"  # not torchrun's summary


def test_the_launcher_names_the_rank_torchrun_saw_fail_first_not_the_error_of_a_rank_it_took_down() -> None:
    """A group of several processes (torchrun): the rank that failed first is its cause (killed by a signal, or its
    own exception), not the last error printed, which is a survivor's lost connection."""
    from lightning_sync.ft import launch

    summary = ["[rank0]: RuntimeError: Connection reset by peer", "Failures:", "[1]:", "  rank      : 0 (local_rank: 0)",
               "  exitcode  : 1 (pid: 11)", "Root Cause (first observed failure):", "[0]:",
               "  rank      : 1 (local_rank: 1)", "  exitcode  : -9 (pid: 12)  (SIGKILL)",
               "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "]
    killed = launch._Life()
    for line in summary:
        killed.read(line)
    assert killed.cause() == "its rank 1 was killed by SIGKILL first"
    raised = launch._Life()
    for line in ["[rank1]: ValueError: a bad batch", *summary[:-2], "  exitcode  : 1 (pid: 12)"]:
        raised.read(line)
    assert raised.cause() == "its rank 1 failed first (exit code 1: ValueError: a bad batch)"
    alone = launch._Life()
    alone.read("ValueError: one process")
    assert alone.cause() == "ValueError: one process"


def test_the_launcher_finds_a_stopped_process_among_a_groups_descendants() -> None:
    from lightning_sync.ft import launch

    # torchrun (10) starts its ranks (11, 12) in sessions of their own; 12's DataLoader worker (13) is stopped
    table = {10: (1, b"S"), 11: (10, b"S"), 12: (10, b"S"), 13: (12, b"T"), 20: (1, b"T")}
    tree = launch._tree(10, table)
    assert sorted(tree) == [10, 11, 12, 13] and next(p for p in tree if table[p][1] == b"T") == 13
    assert launch._tree(99, table) == []


@pytest.mark.parametrize(("args", "message"), [
    (["--replicas", "0", "--", "true"], "--replicas must be >= 1"),
    (["--replicas", "2", "--min-replicas", "3", "--", "true"], "--min-replicas 3 is more than --replicas 2"),
    (["--replicas", "2"], "give the training command after --"),
])
def test_bad_arguments_are_refused_before_anything_starts(args: list[str], message: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # (in this process: a new one spends its seconds importing Lightning; the runs below start lsync-ft-run as users do)
    from lightning_sync.ft import launch

    with pytest.raises(SystemExit) as ended:
        launch.main(args)
    err = capsys.readouterr().err
    assert ended.value.code == 2 and message in err and "lsync-ft-run: lighthouse http" not in err, err


def test_outside_a_replica_group_the_context_says_how_to_start_one() -> None:
    from lightning_sync.ft import ReplicaGroup

    with pytest.raises(RuntimeError, match="lsync-ft-run --replicas R -- CMD"):
        ReplicaGroup.from_env({})


# ---------------------------------------------------------------------------------------- strategy="ddp_sync_ft"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_groups_checkpointing_into_one_directory_are_refused_and_their_own_directories_work(tmp_path: Path) -> None:
    """Each group saves as rank 0: two groups of one run with one ModelCheckpoint directory would overwrite each
    other's last.ckpt. Refused at the start of fit with a message naming the directory and the fix; with a
    directory per group both train, checkpoint, and leave no marker behind."""
    shared = tmp_path / "ckpt"
    proc = _ft_run(tmp_path / "one", ["--replicas", "2", "--max-restarts", "2"],
                   ["--steps", "1000", "--ckpt-dir", str(shared)], script=FIT)
    assert proc.returncode == 1, proc.stderr[-6000:]
    # the group that came second (or both, when they come together) refuses: a set-up error, not restarted (its
    # restarts would refuse again, or slip past the check into a new logger version), and the run ends there
    # rather than leaving the other group to train alone
    assert f"writes its checkpoints or logs where another group of this run writes too: {shared}" in proc.stderr
    assert "default_root_dir" in proc.stderr and "restarting it" not in proc.stderr
    assert re.search(r"lsync-ft-run: replica group [01] stopped for a set-up error, not restarted; ending the run",
                     proc.stderr), proc.stderr[-3000:]
    assert re.search(r"lsync-ft-run: replica group [01] failed: exit code 1 \(a set-up error\) after 0 restart\(s\)"
                     r".*: ddp_sync_ft: replica group [01] writes its checkpoints", proc.stderr), proc.stderr[-3000:]
    assert "1000 steps committed" not in proc.stderr  # the other group did not train the run alone
    # a directory per group, group 1 SIGKILLed in step 11 and recovered from group 0: ModelCheckpoint's decisions
    # (does last.ckpt exist? did the value improve?) stay in each group (across groups they mismatched in number
    # and stalled a step for torchft's 30 s timeout); the received checkpoint's paths are moved to group 1's own
    # directory (Lightning dropped the state of a changed dirpath: last-v1.ckpt, a stale top-k file)
    proc = _ft_run(tmp_path / "own", ["--replicas", "2", "--min-replicas", "2"],
                   ["--steps", "30", "--kill-at", "10", "--ckpt-dir", str(tmp_path / "g{group}")], script=FIT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "recovers from a live group at step 10" in proc.stderr
    assert torch.load(tmp_path / "own" / "group0.pt")["report"]["redone"] == 1  # the kill's step only
    for group in (0, 1):  # each group's own checkpoints, as without the kill; the claim markers gone with fit's end
        assert sorted(p.name for p in (tmp_path / f"g{group}").iterdir()) == ["epoch=1-step=30.ckpt", "last.ckpt"]
    # an earlier last.ckpt in group 1's directory only: group 1 versions its own (Lightning's rule), group 0 does not
    (tmp_path / "h1").mkdir()
    (tmp_path / "h1" / "last.ckpt").write_bytes(b"an earlier run's")
    proc = _ft_run(tmp_path / "again", ["--replicas", "2"], ["--steps", "4", "--ckpt-dir", str(tmp_path / "h{group}")],
                   script=FIT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert sorted(p.name for p in (tmp_path / "h0").iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert sorted(p.name for p in (tmp_path / "h1").iterdir()) == ["epoch=0-step=4.ckpt", "last-v1.ckpt", "last.ckpt"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_replica_groups_train_what_two_ddp_ranks_train(tmp_path: Path) -> None:
    """No fault: each group (one process, devices=1) takes the shard a rank of a 2-rank run takes and its own
    dropout stream; the gradients are averaged over the quorum, and BatchNorm's running statistics are taken from
    the quorum's first group where DDP takes rank 0's (before a training forward, and before the first validation
    forward after training): every group's whole state is that ddp_sync rank's, bit for bit, and so are its
    training epoch means (validation's within 1e-6: see _same_means). The gradients cross the groups in 4 buckets,
    each all-reduce started in DDP's hook and waited for by DDP at the end of the backward."""
    args = ["--steps", "24", "--batchnorm", "--val", "--bucket-cap-mb", "0.0002"]  # (4 buckets in flight at once)
    proc = _ft_run(tmp_path / "ft", ["--replicas", "2"], args, script=FIT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    first, second = torch.load(tmp_path / "ft" / "group0.pt"), torch.load(tmp_path / "ft" / "group1.pt")
    assert torch.equal(first["weights"], second["weights"])
    assert torch.equal(first["weights"], _control(tmp_path / "control", *args))
    for group in (0, 1):
        _same_state(tmp_path / "ft", tmp_path / "control", group)
        _same_means(_epoch_means(tmp_path / "ft", group), _epoch_means(tmp_path / "control", group))
    assert first["report"] == {"committed": 24, "redone": 0, "caught_up": 0, "missing_shards": 0, "taken_over": 0,
                               "healed": 0, "participants": 2}
    assert "ddp_sync_ft: replica group 0 (life 0): 24 steps committed, 0 run again" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_a_group_killed_mid_run_recovers_from_the_live_one_and_nothing_is_lost(tmp_path: Path) -> None:
    """--min-replicas 2, group 1 SIGKILLed in the middle of step 11: the survivor's step that the kill interrupted
    is run again once the restarted group is back; the restarted group's fit (no ckpt_path) is restored from the
    survivor's checkpoint at the end of step 10, sent by torchft (weights, optimizer, a StepLR scheduler stepped
    every step, loops, data position; the gradients in 4 buckets, in flight at once when the kill breaks them): the
    run ends, across an epoch boundary, with the weights of the 2-rank ddp_sync run without a fault, bit for bit
    (no dropout: the lost group's random stream died with it). The survivor's step that was run again puts back
    what its first attempt changed outside the optimizer: BatchNorm's running statistics are updated once and its
    logged epoch mean counts the step once (both were counted twice before)."""
    proc = _ft_run(tmp_path / "ft", ["--replicas", "2", "--min-replicas", "2"],
                   ["--steps", "40", "--kill-at", "10", "--dropout", "0", "--batchnorm", "--val", "--scheduler",
                    "--bucket-cap-mb", "0.0002"], script=FIT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "replica group 1 ended (killed by SIGKILL); restarting it (restart 1 of 3)" in proc.stderr
    assert "ddp_sync_ft: replica group 1 (life 1) recovers from a live group at step 10 (global step 10)" in proc.stderr
    assert "BatchNorm layers net.1 compute their batch statistics over this process's own rows" in proc.stderr
    first, second = torch.load(tmp_path / "ft" / "group0.pt"), torch.load(tmp_path / "ft" / "group1.pt")
    assert (first["life"], second["life"], first["global_step"], second["global_step"]) == (0, 1, 40, 40)
    assert torch.equal(first["weights"], second["weights"])
    assert torch.equal(first["weights"], _control(tmp_path / "control", "--steps", "40", "--dropout", "0",
                                                  "--batchnorm", "--val", "--scheduler", "--bucket-cap-mb",
                                                  "0.0002"))
    for group in (0, 1):
        _same_state(tmp_path / "ft", tmp_path / "control", group)  # running statistics included
    _same_means(_epoch_means(tmp_path / "ft", 0), _epoch_means(tmp_path / "control", 0))  # the redone epoch too
    # the restarted group's running means of the epoch it joined start at its restart (Lightning's checkpoint does
    # not hold them); the next epoch's are the control rank's
    _same_means(_epoch_means(tmp_path / "ft", 1)[-1:], _epoch_means(tmp_path / "control", 1)[-1:])
    assert first["report"]["redone"] == 1 and first["report"]["missing_shards"] == 0
    assert second["report"]["healed"] == 1 and second["report"]["committed"] == 30
    survivor = _steps(tmp_path / "ft", 0)
    assert [r["step"] for r in survivor] == list(range(1, 41))  # every step once, in order: none skipped
    restarted = [r for r in _steps(tmp_path / "ft", 1) if r["life"] == 1]
    assert [r["step"] for r in restarted] == list(range(11, 41))
    assert [r["batch"] for r in restarted] == [r["batch"] for r in _steps(tmp_path / "control", 1)][10:]
    # its loops go on at the survivor's batch of the epoch (a live group's loader state is of the same data split,
    # not a resume on another world size: batch_idx restarted at 0 before), with a random stream of its own
    assert [(r["epoch"], r["batch_idx"]) for r in restarted] == [(r["epoch"], r["batch_idx"]) for r in survivor][10:]
    assert "dealt out again" not in proc.stderr
    # the lost group's failed collective in one line (no traceback of torchft's frames), no flight-recorder warning:
    # the survivor was in the gradient all-reduce across the groups (started in DDP's hook, not waited for there)
    assert "ddp_sync_ft: an all-reduce across the replica groups failed (" in proc.stderr
    lines = proc.stderr.splitlines()
    assert not any("got exception waiting for work" in line and lines[i + 1:i + 2] == ["Traceback (most recent call "
                   "last):"] for i, line in enumerate(lines))
    assert "flight recorder" not in proc.stderr
    assert "per-rank streams: rank 1 " in proc.stderr and "(new: recovered from another process's state)" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_with_world_size_invariant_a_run_with_a_killed_group_trains_the_one_process_model(tmp_path: Path) -> None:
    """world_size_invariant=True: each group takes its slice of the one-process run's global batch (32), and
    dropout masks are keyed by the global batch's rows, not drawn from a group's stream: with group 1 SIGKILLed
    in the middle of step 11 (the step run again draws the same masks) and recovered, both groups end within float rounding of
    ONE process training with batch 32, dropout included."""
    proc = _ft_run(tmp_path / "ft", ["--replicas", "2", "--min-replicas", "2"],
                   ["--steps", "40", "--kill-at", "10", "--invariant"], script=FIT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "ddp_sync_ft: replica group 1 (life 1) recovers from a live group at step 10" in proc.stderr
    first, second = torch.load(tmp_path / "ft" / "group0.pt"), torch.load(tmp_path / "ft" / "group1.pt")
    assert torch.equal(first["weights"], second["weights"]) and first["report"]["redone"] == 1
    restarted = [(r["step"], r["epoch"], r["batch_idx"]) for r in _steps(tmp_path / "ft", 1) if r["life"] == 1]
    assert restarted == [(r["step"], r["epoch"], r["batch_idx"]) for r in _steps(tmp_path / "ft", 0)][10:]
    one_process = _control(tmp_path / "control", "--steps", "40", "--invariant")
    assert torch.allclose(first["weights"], one_process, rtol=0, atol=1e-5 * one_process.abs().max().item())


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("groups, samples", [(3, 640), (3, 641)])  # (2 groups: the group killed twice, below)
def test_with_world_size_invariant_the_live_groups_train_a_missing_groups_slices_and_nothing_is_lost(
        tmp_path: Path, groups: int, samples: int) -> None:
    """world_size_invariant=True, --min-replicas 1: while group 1 is away, the live groups split the whole global
    batch of each step among them (group 1's slice included, loaded in their own processes; with 3 groups the
    normal steps' slices are 11/11/10 rows, weighted, and 16/16 while group 1 is away); none is skipped
    (``missing_shards`` 0), and every group ends within float rounding of ONE process training with batch 32,
    dropout included. 641 samples: epoch 0's last step has 1 row, trained while group 1 is away (the other live
    group runs a stand-in weighted zero)."""
    # 640: issue 43's case, group 1 SIGKILLed in step 7 of 40 and --max-restarts 1; 641: group 1 dies in step 21,
    # which the live groups then redo
    kill_at = "6" if samples == 640 else "20"
    proc = _ft_run(tmp_path / "ft", ["--replicas", str(groups), "--max-restarts", "1", "--heartbeat-timeout-ms", "1000",
                                     *PACED_JOIN],
                   ["--steps", "40", "--kill-at", kill_at, "--alone-sleep", "0.5", "--invariant", "--samples",
                    str(samples)], script=FIT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    ends = [torch.load(tmp_path / "ft" / f"group{g}.pt") for g in range(groups)]
    assert [end["life"] for end in ends] == [0, 1, 0][:groups], _why(proc.stderr)  # only the killed group restarted
    assert "replica group 1 ended (killed by SIGKILL); restarting it (restart 1 of 1)" in proc.stderr
    # its first life committed the steps before the kill (LSYNC_FT_RESTART=0), its second the rest (=1)
    assert max(r["step"] for r in _steps(tmp_path / "ft", 1) if r["life"] == 0) == int(kill_at)
    for survivor in (0, 2):  # the survivors kept their processes: one pid over every step
        assert len({r["pid"] for r in _steps(tmp_path / "ft", survivor)}) == 1
    assert not list(tmp_path.rglob("*.ckpt")), "a checkpoint file was written: recovery is from a live group"
    assert all(torch.equal(ends[0]["weights"], end["weights"]) for end in ends[1:])
    away = [r for r in _steps(tmp_path / "ft", 0) if r["participants"] < groups]
    assert away, "group 0 never trained without group 1: the test did not test the take-over"
    if samples == 641:
        assert any(r["epoch"] == 0 and r["batch_idx"] == 20 for r in away), f"the one-row step was not taken over: {away}"
    assert all(end["report"]["missing_shards"] == 0 for end in ends)
    assert ends[0]["report"]["taken_over"] == len(away) == ends[1]["report"]["taken_over"]  # (carried to group 1)
    assert f"0 data shards of missing groups not trained, {len(away)} trained by the live groups" in proc.stderr
    # a step's sync_dist=True value is the group's own (its process group), not weighted by the global batch's split
    assert all(r["loss_synced"] == r["loss"] for g in range(groups) for r in _steps(tmp_path / "ft", g))
    one_process = _control(tmp_path / "control", "--steps", "40", "--invariant", "--samples", str(samples))
    assert torch.allclose(ends[0]["weights"], one_process, rtol=0, atol=1e-5 * one_process.abs().max().item())


@pytest.mark.slow
@pytest.mark.alone  # timing: the survivor's stall is compared with the timeouts
@pytest.mark.timeout(360)
def test_a_frozen_group_stalls_the_others_for_a_timeout_then_is_replaced_and_nothing_is_lost(tmp_path: Path) -> None:
    """Group 1 SIGSTOPs itself in the middle of step 11 (frozen: its connections stay open, nothing fails on the
    wire). Group 0 waits in the gradient all-reduce for torchft's timeout (5 s here), runs the step again without
    group 1 (whose heartbeats stopped: out of the quorum after 1 s) and trains on alone; lsync-ft-run ends the
    frozen group after --stopped-timeout (5 s) and restarts it; it recovers from group 0. Both end within float
    rounding of ONE process training with batch 32: nothing lost."""
    proc = _ft_run(tmp_path / "ft", ["--replicas", "2", "--heartbeat-timeout-ms", "1000", "--stopped-timeout", "5"],
                   ["--steps", "40", "--stop-at", "10", "--ft-timeout", "5", "--alone-sleep", "0.3", "--invariant"],
                   script=FIT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert re.search(r"replica group 1 is stopped \(process \d+, SIGSTOP\); the others wait for it up to torchft's "
                     r"timeout in a collective they share with it, then train without it; it is ended and restarted "
                     r"in 5 s", proc.stderr), proc.stderr[-4000:]
    assert re.search(r"replica group 1 ended \(stopped \(SIGSTOP\) for \d+ s, ended by lsync-ft-run\); restarting it "
                     r"\(restart 1 of 3\)", proc.stderr)
    ends = [torch.load(tmp_path / "ft" / f"group{g}.pt") for g in range(2)]
    assert [end["life"] for end in ends] == [0, 1], _why(proc.stderr)
    assert torch.equal(ends[0]["weights"], ends[1]["weights"])
    survivor = _steps(tmp_path / "ft", 0)
    assert [r["step"] for r in survivor] == list(range(1, 41)) and ends[0]["report"]["redone"] == 1
    # the bound: torchft's timeout (the all-reduce with the frozen group) + the lighthouse's heartbeat timeout
    stall = survivor[10]["t"] - survivor[9]["t"]
    assert 4.5 < stall < 5 + 1 + 10, f"group 0's step 11 took {stall:.1f} s (timeout 5 s, heartbeat timeout 1 s)"
    assert any(r["participants"] == 1 for r in survivor[10:])  # trained on alone while group 1 was frozen / away
    one_process = _control(tmp_path / "control", "--steps", "40", "--invariant")
    assert torch.allclose(ends[0]["weights"], one_process, rtol=0, atol=1e-5 * one_process.abs().max().item())


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_a_group_killed_twice_recovers_twice_and_nothing_is_lost(tmp_path: Path) -> None:
    """Group 1 SIGKILLed in step 11 of its first life and in step 26 of its second (or its first step after that if
    it healed later): restarted twice, it recovers from group 0 each time; both end within float rounding of ONE
    process training with batch 32. Group 0, left alone, waits for group 1's next life to start, then trains alone
    at >= 0.5 s a step until it joins (fit_ft.py's wait_for_restarts: a slow restart does not race the run's end)."""
    proc = _ft_run(tmp_path / "ft", ["--replicas", "2", "--max-restarts", "2", "--heartbeat-timeout-ms", "1000"],
                   ["--steps", "50", "--kill-at", "10", "25", "--alone-sleep", "0.5", "--invariant"], script=FIT,
                   timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "replica group 1 ended (killed by SIGKILL); restarting it (restart 2 of 2)" in proc.stderr, proc.stderr[-6000:]
    assert "all 2 replica groups finished; restarted: group 1 x2" in proc.stderr, proc.stderr[-6000:]
    assert all(f"ddp_sync_ft: replica group 1 (life {life}) recovers from a live group" in proc.stderr for life in (1, 2))
    ends = [torch.load(tmp_path / "ft" / f"group{g}.pt") for g in range(2)]
    assert [end["life"] for end in ends] == [0, 2], _why(proc.stderr)
    assert torch.equal(ends[0]["weights"], ends[1]["weights"])
    assert [r["step"] for r in _steps(tmp_path / "ft", 0)] == list(range(1, 51))
    assert {r["life"] for r in _steps(tmp_path / "ft", 1)} == {0, 1, 2}
    # while group 1 was away group 0 trained the whole global batch alone: nothing skipped, the count carried over
    away = [r for r in _steps(tmp_path / "ft", 0) if r["participants"] < 2]
    assert away and all(end["report"]["missing_shards"] == 0 for end in ends)
    assert ends[0]["report"]["taken_over"] == len(away) == ends[1]["report"]["taken_over"]
    assert f"0 data shards of missing groups not trained, {len(away)} trained by the live groups" in proc.stderr
    one_process = _control(tmp_path / "control", "--steps", "50", "--invariant")
    assert torch.allclose(ends[0]["weights"], one_process, rtol=0, atol=1e-5 * one_process.abs().max().item())

def _same_as(end: dict, one_process: dict, rel: float) -> bool:
    """A group's whole state (BatchNorm's running statistics included) within ``rel`` of the one-process run's."""
    return all(torch.allclose(value.double(), one_process["state"][key].double(), rtol=0,
                              atol=rel * max(1.0, one_process["state"][key].double().abs().max().item()))
               for key, value in end["state"].items())


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_with_sync_batchnorm_the_statistics_span_every_live_group_and_nothing_is_lost(tmp_path: Path) -> None:
    """sync_batchnorm=True under ddp_sync_ft, world_size_invariant=True, 3 groups, --min-replicas 1: a BatchNorm
    layer's batch statistics (forward) and gradient sums (backward) are exchanged across the live groups
    (torchft), so the layer normalises by the global batch; while group 1 is away the two live groups split the
    global batch and exchange between the two of them. Every group ends within float rounding of ONE process
    training with batch 32, running statistics included. Without sync_batchnorm the same model is not that
    model (a group's own rows), and the warning names the fix."""
    proc = _ft_run(tmp_path / "ft", ["--replicas", "3", "--heartbeat-timeout-ms", "1000", *PACED_JOIN],
                   ["--steps", "40", "--kill-at", "10", "--alone-sleep", "0.5", "--invariant", "--batchnorm",
                    "--sync-bn"], script=FIT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "compute their batch statistics" not in proc.stderr
    ends = [torch.load(tmp_path / "ft" / f"group{g}.pt") for g in range(3)]
    assert [end["life"] for end in ends] == [0, 1, 0], _why(proc.stderr)
    assert ends[0]["report"]["taken_over"] > 0
    assert all(torch.equal(ends[0]["weights"], end["weights"]) for end in ends[1:])
    _control(tmp_path / "control", "--steps", "40", "--invariant", "--batchnorm", "--sync-bn")
    one_process = torch.load(tmp_path / "control" / "group0.pt")
    assert all(_same_as(end, one_process, 1e-5) for end in ends)
    # the control: per-group statistics (no sync_batchnorm), no fault, are another model
    unsynced = _ft_run(tmp_path / "unsynced", ["--replicas", "3"], ["--steps", "40", "--invariant", "--batchnorm"],
                       script=FIT, timeout=240)
    assert unsynced.returncode == 0, unsynced.stderr[-6000:]
    assert "Pass Trainer(sync_batchnorm=True): under ddp_sync_ft it synchronises them" in unsynced.stderr
    assert not _same_as(torch.load(tmp_path / "unsynced" / "group0.pt"), one_process, 1e-4)


#: a group's processes under --nproc-per-replica 2: fit_ft.py's file names, and the control rank of each (g * 2 + r)
_PROCESSES = {"group0": "group0", "group0r1": "group1", "group1": "group2", "group1r1": "group3"}


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_groups_of_two_processes_train_what_four_ddp_ranks_train(tmp_path: Path) -> None:
    """--nproc-per-replica 2 (torchrun in each group, devices=2), no fault: process r of group g takes the shard
    and the dropout stream of rank g * 2 + r of a 4-rank ddp_sync run; the gradients are averaged in the group,
    then across the groups; BatchNorm's running statistics are rank 0's of the quorum's first group. Every
    process ends with that rank's whole state within float rounding (the two-level mean sums in another order)."""
    args = ["--steps", "24", "--batchnorm", "--val"]
    proc = _ft_run(tmp_path / "ft", ["--replicas", "2", "--nproc-per-replica", "2"], args, script=FIT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    _control(tmp_path / "control", *args, "--control-devices", "4")
    for mine, rank in _PROCESSES.items():
        ours, theirs = torch.load(tmp_path / "ft" / f"{mine}.pt"), torch.load(tmp_path / "control" / f"{rank}.pt")
        assert ours["state"].keys() == theirs["state"].keys()
        for key, value in ours["state"].items():
            expected = theirs["state"][key]
            assert torch.allclose(value.double(), expected.double(), rtol=0,
                                  atol=1e-5 * max(1.0, expected.double().abs().max().item())), (mine, key)
        assert ours["report"]["committed"] == 24 and ours["report"]["participants"] == 2
    assert "per-rank streams: rank 2 " in proc.stderr  # group 1's processes are ranks 2 and 3 of the data split


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("kill_rank", [0, 1])
def test_a_process_killed_in_a_group_of_two_ends_its_group_and_the_restarted_group_heals_rank_by_rank(
        tmp_path: Path, kill_rank: int) -> None:
    """--nproc-per-replica 2, world_size_invariant=True: process ``kill_rank`` of group 1 SIGKILLed in step 11
    (rank 0 holds the group's torchft manager server and store, rank 1 neither). torchrun ends the group,
    lsync-ft-run names the killed rank and restarts the group; each of its processes is sent the live group's
    process of its own rank at the end of step 10; every process of both groups ends within float rounding of ONE
    process training with batch 32, dropout included."""
    proc = _ft_run(tmp_path / "ft", ["--replicas", "2", "--min-replicas", "2", "--nproc-per-replica", "2"],
                   ["--steps", "40", "--kill-at", "10", "--kill-rank", str(kill_rank), "--invariant"], script=FIT,
                   timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert (f"replica group 1 ended (exit code 1: its rank {kill_rank} was killed by SIGKILL first); restarting it"
            in proc.stderr)
    assert "ddp_sync_ft: replica group 1 (life 1) recovers from a live group at step 10" in proc.stderr
    assert proc.stderr.count("replica group 0: step 10 not committed") == 1  # (once a group, not once a process)
    ends = {name: torch.load(tmp_path / "ft" / f"{name}.pt") for name in _PROCESSES}
    assert {name: end["life"] for name, end in ends.items()} == {"group0": 0, "group0r1": 0, "group1": 1,
                                                                 "group1r1": 1}
    assert all(torch.equal(end["weights"], ends["group0"]["weights"]) for end in ends.values())
    assert all(end["report"]["healed"] == 1 for name, end in ends.items() if name.startswith("group1"))
    for name in ("group1", "group1r1"):  # each process of the restarted group goes on at the survivors' batch
        restarted = [(r["step"], r["epoch"], r["batch_idx"]) for r in _steps(tmp_path / "ft", name) if r["life"] == 1]
        assert restarted == [(r["step"], r["epoch"], r["batch_idx"]) for r in _steps(tmp_path / "ft", 0)][10:]
    one_process = _control(tmp_path / "control", "--steps", "40", "--invariant")
    assert torch.allclose(ends["group0"]["weights"], one_process, rtol=0, atol=1e-5 * one_process.abs().max().item())


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_fsdp2_groups_of_two_processes_train_what_four_ddp_ranks_train(tmp_path: Path) -> None:
    """model_parallel_sync_ft (--fsdp): FSDP2 inside each group of 2 processes (process r holds shard r of every
    layer), no fault, a BatchNorm layer (its batch statistics each process's own, as under ddp without
    SyncBatchNorm). The gradient shards averaged in the group (FSDP2's reduce-scatter) then across the groups
    (process r with process r, in 4 buckets) are the 4-rank ddp_sync run's mean: every process's full weights end
    within float rounding of that run's (the same data shard and dropout stream as rank g * 2 + r)."""
    args = ["--steps", "24", "--batchnorm"]
    proc = _ft_run(tmp_path / "ft", ["--replicas", "2", "--nproc-per-replica", "2"],
                   [*args, "--fsdp", "--bucket-cap-mb", "0.0002"], script=FIT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    # (the BatchNorm layer trains on each process's rows, as under ddp; the warning names what helps under FSDP2)
    assert "model_parallel_sync_ft: BatchNorm layers net.1 compute their batch statistics" in proc.stderr
    assert "ModelParallelStrategy ignores Trainer(sync_batchnorm=True)" in proc.stderr
    _control(tmp_path / "control", *args, "--control-devices", "4")
    for mine, rank in _PROCESSES.items():
        ours, theirs = torch.load(tmp_path / "ft" / f"{mine}.pt"), torch.load(tmp_path / "control" / f"{rank}.pt")
        assert ours["state"].keys() == theirs["state"].keys()
        expected = theirs["weights"].double()
        assert torch.allclose(ours["weights"].double(), expected, rtol=0, atol=1e-5 * expected.abs().max().item()), mine
        assert ours["report"]["committed"] == 24 and ours["report"]["participants"] == 2
        assert ours["report"]["missing_shards"] == 0


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_fsdp2_a_process_killed_in_a_group_heals_shard_by_shard_and_trains_the_one_process_model(
        tmp_path: Path) -> None:
    """model_parallel_sync_ft, 2 groups of 2 FSDP2 processes, world_size_invariant=True, a step-wise LR scheduler:
    process 1 of group 1 SIGKILLed in step 11. Its group is restarted, and each of its processes is sent the live
    group's process of its own rank's shards (weights and momentum, no full tensor gathered, no file) at the end
    of step 10; every process of both groups ends within float rounding of ONE process training with batch 32."""
    args = ["--steps", "40", "--invariant", "--scheduler"]
    proc = _ft_run(tmp_path / "ft", ["--replicas", "2", "--min-replicas", "2", "--nproc-per-replica", "2"],
                   [*args, "--fsdp", "--kill-at", "10", "--kill-rank", "1", "--bucket-cap-mb", "0.0002"],
                   script=FIT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "replica group 1 ended (exit code 1: its rank 1 was killed by SIGKILL first); restarting it" in proc.stderr
    assert "ddp_sync_ft: replica group 1 (life 1) recovers from a live group at step 10" in proc.stderr
    assert proc.stderr.count("replica group 0: step 10 not committed") == 1
    ends = {name: torch.load(tmp_path / "ft" / f"{name}.pt") for name in _PROCESSES}
    assert {name: end["life"] for name, end in ends.items()} == {"group0": 0, "group0r1": 0, "group1": 1,
                                                                 "group1r1": 1}
    assert all(end["report"]["healed"] == 1 for name, end in ends.items() if name.startswith("group1"))
    assert all(torch.equal(end["weights"], ends["group0"]["weights"]) for end in ends.values())
    assert not list((tmp_path / "ft").rglob("*.ckpt")) and not list(Path.cwd().glob("lightning_logs/**/*.ckpt"))
    one_process = _control(tmp_path / "control", *args)
    assert torch.allclose(ends["group0"]["weights"], one_process, rtol=0, atol=1e-5 * one_process.abs().max().item())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fewer_groups_left_than_min_replicas_end_the_run_at_once(tmp_path: Path) -> None:
    """--min-replicas 2, --max-restarts 0: group 1 dies for good, so no step can commit again; the run ends then
    (before, group 0 waited for a quorum max_step_retries x quorum_timeout: 20 minutes), naming why."""
    start = time.monotonic()
    proc = _ft_run(tmp_path, ["--replicas", "2", "--min-replicas", "2", "--max-restarts", "0"],
                   ["--steps", "40", "--kill-at", "10"], script=FIT, timeout=200)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert ("lsync-ft-run: 1 replica group(s) left, fewer than --min-replicas 2: no step can commit any more; ending "
            "the run") in proc.stderr
    assert "replica group 0 failed: ended by lsync-ft-run: fewer than --min-replicas 2 groups left" in proc.stderr
    assert time.monotonic() - start < 120


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_group_restarted_after_the_run_finished_ends_at_once(tmp_path: Path) -> None:
    """Group 1 killed in step 38 of 40 and slow to restart (8 s): group 0 finishes the run alone; the restarted
    group finds no live group and the run over, and ends at once (before, it waited quorum_timeout, 120 s, and then
    told the user to start again from a checkpoint)."""
    start = time.monotonic()
    proc = _ft_run(tmp_path, ["--replicas", "2", "--heartbeat-timeout-ms", "1000"],
                   ["--steps", "40", "--kill-at", "37", "--restart-delay", "8"], script=FIT, timeout=200)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "(life 1): the run finished while this group was restarting" in proc.stderr, proc.stderr[-4000:]
    # the group's cause is its error, quoted from its own output
    assert ("replica group 1 ended (exit code 1: lightning_sync.errors.LightningSyncError: ddp_sync_ft: replica group 1 "
            "(life 1): the run finished while this group was restarting") in proc.stderr
    assert ") after group 0 finished the run (its training is complete there); not restarted" in proc.stderr
    assert torch.load(tmp_path / "group0.pt")["global_step"] == 40
    assert time.monotonic() - start < 110

def _lighthouse(port: int) -> subprocess.Popen[bytes]:
    """A lighthouse of the test's own for 2 groups, its ``--min_replicas`` the group count: started again, it forms
    no quorum until both groups are back. (With 1, the first group to ask the new one may form a quorum alone before
    the other's heartbeat has reconnected; seen on a loaded host: the other then failed to heal from it and was
    restarted, nothing lost but the no-restart promise gone. docs/fault_tolerance.md says so.)"""
    exe = Path(sys.executable).parent / "torchft_lighthouse"
    return subprocess.Popen([str(exe), "--bind", f"127.0.0.1:{port}", "--min_replicas", "2", "--heartbeat_timeout_ms",
                             "1000", "--join_timeout_ms", "10000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.mark.slow
@pytest.mark.timeout(420)  # (beside the other worker's tests: its stall bound leaves room for a loaded machine)
def test_a_restarted_lighthouse_costs_a_quorum_timeout_and_no_group_restarts(tmp_path: Path) -> None:
    """The groups join a lighthouse of their own (``--lighthouse``), which is SIGKILLed after step 60 and started
    again on its address 2 s later. The quorum request in flight is lost with it: each group waits quorum_timeout
    (5 s here), asks again (a warning line), and the run goes on with no group restarted and no step lost (before,
    every group stopped after quorum_timeout, lsync-ft-run restarted all of them and, none being ahead, they trained
    again from step 0). Both end within float rounding of ONE process training with batch 32."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "ft"
    out.mkdir()
    lighthouse = _lighthouse(port)
    cmd = ["timeout", "-k", "5", "300", sys.executable, "-m", "lightning_sync.ft.launch", "--replicas", "2",
           "--lighthouse", f"127.0.0.1:{port}", "--", sys.executable, str(FIT), "--out", str(out), "--steps", "200",
           "--samples", "3200", "--invariant", "--quorum-timeout", "5", "--ft-timeout", "10"]
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log = out / "group0.log"
        while run.poll() is None and (not log.exists() or len(log.read_text().splitlines()) < 60):
            time.sleep(0.2)
        lighthouse.kill()
        lighthouse.wait()
        time.sleep(2)
        lighthouse = _lighthouse(port)
        _, stderr = run.communicate(timeout=320)
    finally:
        run.kill()
        lighthouse.kill()
        lighthouse.wait()
    assert run.returncode == 0, stderr[-6000:]
    assert ("within 5 s (quorum_timeout): fewer than min_replicas groups joined, or the lighthouse http://127.0.0.1:"
            in stderr), stderr[-4000:]
    assert "lsync-ft-run: all 2 replica groups finished\n" in stderr + "\n" and "restarting it" not in stderr, stderr[-8000:]
    ends = [torch.load(out / f"group{g}.pt") for g in range(2)]
    assert [end["life"] for end in ends] == [0, 0], _why(stderr)
    assert torch.equal(ends[0]["weights"], ends[1]["weights"])
    steps = [r["step"] for r in _steps(out, 0)]
    assert steps == sorted(set(steps)) and steps[-1] == 200 and steps[59] == 60
    # bounded: the longest pause between two steps is the lost request's quorum_timeout (5 s) and the restart (2 s),
    # with room for a loaded machine, never a hang
    times = [r["t"] for r in _steps(out, 0)]
    stall = max(b - a for a, b in zip(times, times[1:]))
    assert 4.5 < stall < 5 + 2 + 15, f"the longest pause between two steps: {stall:.1f} s"
    one_process = _control(tmp_path / "control", "--steps", "200", "--samples", "3200", "--invariant")
    assert torch.allclose(ends[0]["weights"], one_process, rtol=0, atol=1e-5 * one_process.abs().max().item())

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_survivor_training_alone_counts_the_shards_it_could_not_train(tmp_path: Path) -> None:
    """--min-replicas 1: the survivor goes on alone while the lost group restarts; the missing group's shards
    are counted (never silent), the count goes on in the recovered group, and both end equal."""
    proc = _ft_run(tmp_path, ["--replicas", "2", "--heartbeat-timeout-ms", "1000"],
                   ["--steps", "40", "--kill-at", "10", "--alone-sleep", "0.5"], script=FIT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    first, second = torch.load(tmp_path / "group0.pt"), torch.load(tmp_path / "group1.pt")
    assert torch.equal(first["weights"], second["weights"])
    alone = [r for r in _steps(tmp_path, 0) if r["participants"] == 1]
    assert alone and first["report"]["missing_shards"] == len(alone) == second["report"]["missing_shards"]
    assert f"{len(alone)} data shards of missing groups not trained" in proc.stderr
    logged = _steps(tmp_path, 0)[-1]
    assert logged["missing_shards"] == len(alone)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_early_stop_one_group_asks_for_stops_every_group_at_the_same_step(tmp_path: Path) -> None:
    """EarlyStopping on a value only group 1 sees (its shard's): Lightning's reduce_boolean_decision is agreed
    across the quorum's groups too, so both stop after epoch 0 (step 20) with equal weights. (Without it group 1
    stopped alone and group 0, --min-replicas 2, waited out quorum_timeout.)"""
    proc = _ft_run(tmp_path, ["--replicas", "2", "--min-replicas", "2"], ["--steps", "40", "--early-stop"], script=FIT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    first, second = torch.load(tmp_path / "group0.pt"), torch.load(tmp_path / "group1.pt")
    assert first["global_step"] == second["global_step"] == 20
    assert torch.equal(first["weights"], second["weights"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_timer_that_runs_out_in_the_first_group_stops_every_group_at_the_same_step(tmp_path: Path) -> None:
    """Timer's stop is Lightning's broadcast of a bool from rank 0: across the quorum's groups too, from its first
    group. Group 0's Timer runs out after 1 s, group 1's would in an hour: both stop at the same step, long before
    max_steps, with equal weights. (Before, group 0 stopped alone and group 1 trained on alone to max_steps.)"""
    proc = _ft_run(tmp_path, ["--replicas", "2"], ["--steps", "400", "--timer"], script=FIT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    first, second = torch.load(tmp_path / "group0.pt"), torch.load(tmp_path / "group1.pt")
    assert first["global_step"] == second["global_step"] < 400, (first["global_step"], second["global_step"])
    assert torch.equal(first["weights"], second["weights"])
    assert first["report"]["missing_shards"] == second["report"]["missing_shards"] == 0


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mistake, message", [
    ("--no-seed", "every replica group must start from the same root seed (the groups split the training data by it, "
                  "and build the same model from it), but none was given, so each group drew its own. Pass "
                  "FaultTolerantDDPStrategy(seed=N) or call lightning.seed_everything(N)"),
    ("--accumulate=2", "ddp_sync_ft: accumulate_grad_batches=2 is not supported yet (torchft commits every optimizer "
                       "step); pass a larger batch instead"),
])
def test_a_set_up_mistake_is_refused_before_training_and_the_group_is_not_restarted(
        tmp_path: Path, mistake: str, message: str) -> None:
    """No seed every group knows, or gradient accumulation: refused at the start of fit, before any step, as a
    set-up error lsync-ft-run does not restart (every life would meet it again; before, the seed's refusal was
    restarted until --max-restarts ran out, and accumulation was refused only at the first optimizer step)."""
    proc = _ft_run(tmp_path, ["--replicas", "1", "--max-restarts", "2"], ["--steps", "4", mistake], script=FIT)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert message in proc.stderr, proc.stderr[-4000:]
    assert "restarting it" not in proc.stderr, proc.stderr[-4000:]
    assert not (tmp_path / "group0.log").exists()  # not one step


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_manual_optimisation_is_refused_before_any_step_and_the_group_is_not_restarted(tmp_path: Path) -> None:
    """torchft commits each step through the automatic loop's closure (run again when a group is lost): a module with
    automatic_optimization = False is refused at the start of fit, before the first quorum, as a set-up error that
    lsync-ft-run does not restart. (Before, nothing refused it: the first optimizer.step() got Lightning's do-nothing
    closure and the run stopped on "training_step returned None", after a quorum and a gradient all-reduce.)"""
    proc = _ft_run(tmp_path, ["--replicas", "1", "--max-restarts", "2"], ["--steps", "4", "--manual"], script=FIT)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert ("ddp_sync_ft: ManualModel sets automatic_optimization = False (manual optimisation), which ddp_sync_ft "
            "does not support: torchft commits every optimizer step through Lightning's automatic loop"
            in proc.stderr), proc.stderr[-4000:]
    assert "leave automatic_optimization True and return the loss from training_step" in proc.stderr
    assert "replica group 0 stopped for a set-up error, not restarted" in proc.stderr, proc.stderr[-4000:]
    assert "restarting it" not in proc.stderr and "training_step returned None" not in proc.stderr
    assert not (tmp_path / "group0.log").exists()  # not one step


def test_ddp_sync_ft_outside_a_replica_group_and_bad_arguments_say_how_to_fix_them(monkeypatch) -> None:
    import lightning_sync as ls
    from lightning.pytorch.strategies import StrategyRegistry

    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="lsync-ft-run --replicas R -- CMD"):
        ls.FaultTolerantDDPStrategy()
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "2")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    with pytest.raises(ValueError, match="find_unused_parameters=True and static_graph=False"):
        ls.FaultTolerantDDPStrategy(static_graph=True)
    with pytest.raises(ValueError, match="min_replicas=0"):
        ls.FaultTolerantDDPStrategy(min_replicas=0)
    with pytest.raises(ValueError, match="ckpt_path= to fit"):
        ls.FaultTolerantDDPStrategy(resume="auto")
    strategy = ls.FaultTolerantDDPStrategy()
    assert strategy.min_replicas == 1 and strategy.seed_stream_rank == 0
    with pytest.raises(ValueError, match=r"FaultTolerantModelParallelStrategy\(tensor_parallel_size=2\): tensor "
                                         "parallelism inside a replica group is not supported yet"):
        ls.FaultTolerantModelParallelStrategy(tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"FaultTolerantModelParallelStrategy\(bucket_cap_mb=0\): more than 0"):
        ls.FaultTolerantModelParallelStrategy(bucket_cap_mb=0)
    with pytest.raises(ValueError, match=r"FaultTolerantModelParallelStrategy\(min_replicas=0\)"):
        ls.FaultTolerantModelParallelStrategy(min_replicas=0)
    sharded = StrategyRegistry.get("model_parallel_sync_ft")
    assert isinstance(sharded, ls.FaultTolerantModelParallelStrategy) and sharded.bucket_cap_mb == 25.0


def test_without_torchft_the_error_names_the_extra_to_install(monkeypatch) -> None:
    """torchft is an extra: without it, require_torchft and building the strategy (by class or by its registry name,
    inside a replica group's environment) say which one to install, and the ImportError behind it is kept."""
    import lightning_sync as ls
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_sync.ft import require_torchft

    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft` raises ImportError
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "2")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    message = r"runs on torchft, which is not installed\. Install the extra: pip install \"lightning_sync\[ft\]\""
    with pytest.raises(ImportError, match=message) as raised:
        require_torchft()
    assert isinstance(raised.value.__cause__, ImportError)
    with pytest.raises(ImportError, match=message):
        ls.FaultTolerantDDPStrategy()
    with pytest.raises(ImportError, match=message):
        StrategyRegistry.get("ddp_sync_ft")


def test_output_dir_claims_refuse_another_group_of_the_same_run_only(tmp_path: Path) -> None:
    from lightning_sync.errors import LightningSyncError
    from lightning_sync.ft.outputs import claim_output_dirs, release_output_dirs, run_key

    shared, own = str(tmp_path / "shared"), str(tmp_path / "own")
    markers = claim_output_dirs([shared], 0, "run-a")  # (made if missing)
    assert markers == [str(tmp_path / "shared" / ".lsync_ft_group0")]
    assert claim_output_dirs([shared], 0, "run-a") == markers  # group 0 restarted: its own marker again
    assert claim_output_dirs([shared, own], 1, "run-b")  # group 1 of ANOTHER run (a stale marker): not refused
    with pytest.raises(LightningSyncError, match=r"replica group 1 writes .* too: .*shared \(also replica group"
                                                 r"\(s\) 0\)\. .*default_root_dir"):
        claim_output_dirs([own, shared], 1, "run-a")
    assert sorted(p.name for p in (tmp_path / "own").iterdir()) == []  # the refused group's markers are removed
    release_output_dirs(markers)
    assert claim_output_dirs([shared], 1, "run-a")  # group 0's fit ended: its directory is free
    assert run_key({"LSYNC_FT_RUN_ID": "x", "TORCHFT_LIGHTHOUSE": "http://h:1"}) == "x"
    assert run_key({"TORCHFT_LIGHTHOUSE": "http://h:1"}) == "http://h:1"
