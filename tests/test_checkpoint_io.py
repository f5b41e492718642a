"""Atomic checkpoint files: one process for the file logic, a real 2-rank fit SIGKILLed while saving."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import lightning_sync as ls
from lightning_sync.checkpoint_io import (
    AtomicCheckpointIO,
    CorruptCheckpointError,
    atomic_save,
    checkpoint_problem,
    is_complete_checkpoint,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "fit_checkpoints.py"


class _Unpicklable:
    def __reduce__(self) -> tuple[object, ...]:
        raise RuntimeError("boom while pickling")


def _temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".lsync-tmp"))


def test_atomic_save_replaces_whole_files_and_leaves_no_temp_file(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    path = tmp_path / "sub" / "last.ckpt"
    io.save_checkpoint({"w": torch.arange(10)}, path)
    assert torch.equal(io.load_checkpoint(path)["w"], torch.arange(10))
    # a save that fails half-way keeps the good file and leaves no temporary file behind
    with pytest.raises(RuntimeError, match="boom while pickling"):
        io.save_checkpoint({"w": torch.zeros(3), "bad": _Unpicklable()}, path)
    assert torch.equal(io.load_checkpoint(path)["w"], torch.arange(10))
    assert _temp_files(path.parent) == []
    # a temporary file left by a killed writer of the same name is cleaned up by the next save
    (path.parent / ".last.ckpt.abc123.lsync-tmp").write_bytes(b"PK\x03\x04 half")
    io.save_checkpoint({"w": torch.ones(2)}, path)
    assert _temp_files(path.parent) == [] and torch.equal(io.load_checkpoint(path)["w"], torch.ones(2))
    # ... and so is one of another name whose writer on this host is gone; a live writer's is kept
    host = socket.gethostname().replace(".", "_")
    gone = _dead_pid()
    dead = path.parent / f".epoch=0-step=2.ckpt.{host}-{gone}.x1y2z3.lsync-tmp"
    live = path.parent / f".epoch=0-step=3.ckpt.{host}-{os.getppid()}.a1b2c3.lsync-tmp"
    dead.write_bytes(b"half")
    live.write_bytes(b"in progress")
    io.save_checkpoint({"w": torch.ones(2)}, path)
    assert _temp_files(path.parent) == [live.name]
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_truncated_or_corrupt_checkpoint_is_refused_with_its_name(tmp_path: Path) -> None:
    good = tmp_path / "epoch=0-step=2.ckpt"
    atomic_save({"w": torch.randn(1000)}, good)
    data = good.read_bytes()
    truncated = tmp_path / "last.ckpt"
    truncated.write_bytes(data[: len(data) // 2])
    assert is_complete_checkpoint(good) and not is_complete_checkpoint(truncated)
    assert "no zip directory" in (checkpoint_problem(truncated) or "")
    with pytest.raises(CorruptCheckpointError) as err:
        AtomicCheckpointIO().load_checkpoint(truncated)
    message = str(err.value)
    assert str(truncated) in message and "epoch=0-step=2.ckpt" in message and "ckpt_path" in message
    # bytes flipped inside a record: found by the CRC check
    corrupt = tmp_path / "flipped.ckpt"
    middle = bytearray(data)
    at = data.index(b"data/0") + 200
    middle[at: at + 8] = b"\xff" * 8
    corrupt.write_bytes(bytes(middle))
    assert is_complete_checkpoint(corrupt) and not is_complete_checkpoint(corrupt, verify_data=True)
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    assert checkpoint_problem(empty) == "it is empty"


def test_ddp_sync_uses_atomic_io_unless_told_otherwise() -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    assert isinstance(ls.SyncDDPStrategy().checkpoint_io, AtomicCheckpointIO)
    assert type(ls.SyncDDPStrategy(checkpoint_io=TorchCheckpointIO()).checkpoint_io) is TorchCheckpointIO
    wrapped = ls.SyncDDPStrategy(checkpoint_io=AsyncCheckpointIO()).checkpoint_io
    assert isinstance(wrapped.checkpoint_io, AtomicCheckpointIO)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (another file system than the checkout)")
def test_sigkill_of_rank_0_while_saving_leaves_complete_checkpoints(tmp_path: Path) -> None:
    """Before: with TMPDIR=/dev/shm, a SIGKILL during the move left epoch=0-step=4.ckpt and last.ckpt
    truncated. Now every *.ckpt is complete (the old last.ckpt or the new one) and loads."""
    out = tmp_path / "run"
    ckpt_dir = out / "ckpt"
    tmpdir = Path("/dev/shm") / f"lsync-test-{os.getpid()}"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--out", str(out)], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    killed_mid_write = False
    try:
        deadline = time.monotonic() + 300
        # wait for a complete last.ckpt, then kill rank 0 as soon as its next save has begun
        while time.monotonic() < deadline and proc.poll() is None:
            if (ckpt_dir / "last.ckpt").exists() and is_complete_checkpoint(ckpt_dir / "last.ckpt"):
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
        while time.monotonic() < deadline and proc.poll() is None:
            if ckpt_dir.exists() and _temp_files(ckpt_dir):
                os.kill(proc.pid, signal.SIGKILL)  # rank 0 is the launched process
                killed_mid_write = True
                break
            time.sleep(0.001)
        assert killed_mid_write, "never saw a save in progress"
        proc.wait(30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # rank 1, orphaned
        except ProcessLookupError:
            pass
        proc.wait(30)
        staged = sorted(p.name for p in tmpdir.iterdir())
        shutil.rmtree(tmpdir, ignore_errors=True)
    checkpoints = sorted(ckpt_dir.glob("*.ckpt"))
    assert any(p.name == "last.ckpt" for p in checkpoints)
    for path in checkpoints:
        assert checkpoint_problem(path, verify_data=True) is None, (path.name, checkpoint_problem(path))
        state = AtomicCheckpointIO().load_checkpoint(path)
        assert state["state_dict"]["net.weight"].shape == (4096, 4096)
    # the killed writer's temporary file goes with the next save into the directory (a resumed run's)
    atomic_save({"after": 1}, ckpt_dir / "after.ckpt")
    assert _temp_files(ckpt_dir) == []
    assert not [name for name in staged if "ckpt" in name or name.startswith("tmp")], staged  # nothing via TMPDIR


def test_umask_is_read_without_changing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """os.umask can only be read by setting it: a save must not race other threads creating files."""
    import os

    from lightning_sync import checkpoint_io

    calls: list[int] = []
    real = os.umask
    monkeypatch.setattr(os, "umask", lambda mask: calls.append(mask) or real(mask))
    expected = real(0o022)
    real(expected)
    assert checkpoint_io._umask() == expected and calls == []


def test_sharded_checkpoint_is_complete_only_with_meta_and_every_rank_file(tmp_path: Path) -> None:
    from argparse import Namespace

    from lightning_sync.checkpoint_io import expect_rank_files, invalidate_sharded_checkpoint, rank_file
    from lightning_sync.resume import find_resume_checkpoint

    old = tmp_path / "epoch=0-step=5.ckpt"
    new = tmp_path / "epoch=0-step=10.ckpt"
    torn = tmp_path / "epoch=0-step=15.ckpt"  # killed while DCP wrote its shards: no .metadata, no meta.pt
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"shard")
    for i, directory in enumerate((old, new)):
        directory.mkdir()
        expect_rank_files(directory, 3)
        (directory / "__0_0.distcp").write_bytes(b"shard")
        (directory / ".metadata").write_bytes(b"dcp")
        assert checkpoint_problem(directory) == ("it is a directory without meta.pt (not a sharded checkpoint, or "
                                                 "its save was cut short)")
        # hyperparameters that weights_only=True refuses: the check never unpickles meta.pt
        torch.save({"hyper_parameters": Namespace(lr=0.1), "lightning_sync": {"rank_files": "lightning_sync"}},
                   directory / "meta.pt")
        for r in range(3) if i == 0 else (1,):
            torch.save({"rng_state": None}, rank_file(directory, r, 3))
    assert checkpoint_problem(old) is None
    assert checkpoint_problem(new) == f"the per-rank state of rank(s) 0, 2 is missing from {new / 'lightning_sync'}"
    assert find_resume_checkpoint([tmp_path]) == old  # the newer ones are incomplete
    for r in (0, 2):
        torch.save({"rng_state": None}, rank_file(new, r, 3))
    assert find_resume_checkpoint([tmp_path]) == new
    (new / "meta.pt").write_bytes((new / "meta.pt").read_bytes()[:40])  # cut short
    assert "its meta.pt: " in (checkpoint_problem(new) or "")
    assert find_resume_checkpoint([tmp_path]) == old
    # about to be written over: incomplete at once, the rank files gone, other folders untouched
    (old / "lightning_sync" / "notes.txt").write_text("mine")
    invalidate_sharded_checkpoint(old)
    assert not (old / "meta.pt").exists() and not (old / ".metadata").exists()
    assert sorted(p.name for p in (old / "lightning_sync").iterdir()) == ["notes.txt"]
    plain = tmp_path / "plain"  # not a checkpoint: never touched
    (plain / "lightning_sync").mkdir(parents=True)
    (plain / "lightning_sync" / "rank0-of-1.pt").write_bytes(b"x")
    invalidate_sharded_checkpoint(plain)
    assert (plain / "lightning_sync" / "rank0-of-1.pt").exists()
    # Lightning's own ModelParallelStrategy (no rank files expected): complete with .metadata and meta.pt
    theirs = tmp_path / "theirs.ckpt"
    theirs.mkdir()
    (theirs / ".metadata").write_bytes(b"dcp")
    torch.save({"epoch": 0}, theirs / "meta.pt")
    assert checkpoint_problem(theirs) is None
