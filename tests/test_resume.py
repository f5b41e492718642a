"""Mid-epoch resume under ddp_sync: sampler arithmetic (no processes), then real 2- and 3-rank fits.

The fits run tests/scripts/fit_resume.py: an uninterrupted run, a run stopped inside an epoch with
ModelCheckpoint(every_n_train_steps=...), and its resume; each training step records the epoch, the
batch's dataset indices and the augmentation drawn in ``__getitem__``; final weights per rank.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_sync.errors import ResumeError
from lightning_sync.resume import ResumableDistributedSampler, find_resume_checkpoint, is_mid_epoch, make_resumable
from tests.launch import free_port, load_script

SCRIPT = Path(__file__).parent / "scripts" / "fit_resume.py"
N = 50  # fit_resume.py's data set size

pytest.importorskip("torchdata.stateful_dataloader")


# ------------------------------------------------------------------------------ sampler arithmetic


def _samplers(n: int, world: int, **kwargs: object) -> list[ResumableDistributedSampler]:
    return [ResumableDistributedSampler(list(range(n)), num_replicas=world, rank=r, seed=3, **kwargs)  # type: ignore[arg-type]
            for r in range(world)]


@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_equals_torch_distributed_sampler(drop_last: bool) -> None:
    for rank in range(3):
        ours = ResumableDistributedSampler(list(range(50)), num_replicas=3, rank=rank, seed=3,  # type: ignore[arg-type]
                                           drop_last=drop_last)
        theirs = DistributedSampler(list(range(50)), num_replicas=3, rank=rank, seed=3,  # type: ignore[arg-type]
                                    drop_last=drop_last)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def _take(sampler: ResumableDistributedSampler, k: int) -> list[int]:
    it = iter(sampler)
    return [next(it) for _ in range(k)]


def test_sampler_state_same_world_continues_exactly() -> None:
    for rank, sampler in enumerate(_samplers(50, 2)):
        sampler.set_epoch(1)
        whole = list(sampler)
        head = _take(sampler, 12)
        state = sampler.state_dict()
        resumed = ResumableDistributedSampler(list(range(50)), num_replicas=2, rank=rank)  # type: ignore[arg-type]
        resumed.load_state_dict(state)
        resumed.set_epoch(1)  # Lightning sets the same epoch again: the position is kept
        unused = iter(resumed)  # torchdata creates iterators it never runs (after load_state_dict)
        assert head + list(resumed) == whole
        del unused


@pytest.mark.parametrize(("old", "new", "n"), [(2, 3, 50), (3, 2, 50), (4, 3, 11), (2, 5, 51)])
def test_sampler_reshard_sees_every_remaining_sample_once(old: int, new: int, n: int) -> None:
    before = _samplers(n, old)
    seen = Counter()
    for s in before:
        s.set_epoch(2)
        seen.update(_take(s, min(2, len(s))))
    state = before[0].state_dict()
    after = _samplers(n, new)
    rest = Counter()
    for s in after:
        s.load_state_dict(state)
        rest.update(list(s))
    assert len({len(s) for s in after}) == 1, "ranks would take different numbers of steps"
    assert set(seen) | set(rest) == set(range(n)) and not set(seen) & set(rest)
    assert sum(rest.values()) - len(rest) <= new - 1
    for s in after:  # the next epoch is a normal one again
        s.set_epoch(3)
    epoch3 = Counter(i for s in after for i in s)
    assert set(epoch3) == set(range(n)) and sum(epoch3.values()) - n <= new - 1


def test_sampler_complete_epoch_resumes_at_next_epoch() -> None:
    s = _samplers(10, 2)[0]
    s.set_epoch(4)
    list(s)
    t = _samplers(10, 2)[0]
    t.load_state_dict(s.state_dict())
    s.set_epoch(5)
    assert t.epoch == 5 and list(t) == list(s)


@pytest.mark.parametrize("drop_last", [False, True])
def test_loader_state_after_the_last_batch_is_epoch_end(drop_last: bool) -> None:
    """33 samples, batch 2: with drop_last the epoch ends after 16 batches, one sample short of the
    sampler's end (Lightning stops there without asking the loader for more)."""
    pytest.importorskip("torchdata")
    from torch.utils.data import DataLoader

    data = list(range(33))
    loader: Any = make_resumable(DataLoader(data, batch_size=2, drop_last=drop_last,  # type: ignore[arg-type]
                                            sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=3)))
    it = iter(loader)
    for _ in range(16 if drop_last else 17):
        next(it)
    state = loader.state_dict()["lightning_sync"]["sampler"]
    assert not is_mid_epoch(state) and state["yielded"] == state["segment_len"] == 33
    next_it = iter(loader)  # a mid-epoch state for contrast
    next(next_it)
    assert is_mid_epoch(loader.state_dict()["lightning_sync"]["sampler"])


def test_sampler_rejects_other_dataset_length() -> None:
    state = _samplers(50, 2)[0].state_dict()
    with pytest.raises(ResumeError, match=r"has 49 samples, the checkpoint's had 50.*same data set"):
        _samplers(49, 2)[0].load_state_dict(state)


# ----------------------------------------------------------------------- damaged checkpoint files


def test_auto_resume_skips_a_damaged_newest_checkpoint_and_keeps_it(tmp_path: Path) -> None:
    good = tmp_path / "run" / "epoch=0-step=5.ckpt"
    good.parent.mkdir()
    torch.save({"state_dict": {}, "loops": {}}, good)
    bad = tmp_path / "run" / "last.ckpt"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])  # a write cut short by a kill
    os.utime(good, (1, 1))  # the damaged one is the newest
    assert find_resume_checkpoint([tmp_path / "run"]) == good
    assert bad.exists() and good.exists()
    assert find_resume_checkpoint([tmp_path / "missing"]) is None


# ------------------------------------------------------------------------------- real rank fits


def _launch(out: Path, plan: str, *args: str, devices: int = 2, timeout: int = 400) -> str:
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["timeout", "-k", "5", str(timeout), sys.executable, str(SCRIPT), "--out", str(out), "--plan", plan,
           "--devices", str(devices), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 20)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


def _steps(run: Path, world: int) -> list[list]:
    return [json.loads((run / f"rank{r}.json").read_text())["steps"] for r in range(world)]


def _weights_equal(a: Path, b: Path, world: int) -> bool:
    for r in range(world):
        x, y = torch.load(a / f"rank{r}.pt"), torch.load(b / f"rank{r}.pt")
        if not all(torch.equal(x[k], y[k]) for k in x):
            return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mid_epoch_resume_is_exact_with_and_without_workers(tmp_path: Path) -> None:
    """2 ranks, 3 epochs of 7 steps; stopped at step 10 (epoch 1, step 3), resumed from that checkpoint."""
    plan = ",".join(f"full:3@{t},stop:3:10:5@{t}stop,resume:3:{t}stop@{t}resume" for t in ("w0", "w2", "w2p"))
    _launch(tmp_path, plan)
    for tag in ("w0", "w2", "w2p"):
        full, stop, resumed = (_steps(tmp_path / f"{tag}{s}", 2) for s in ("", "stop", "resume"))
        for r in range(2):
            assert stop[r] == full[r][:10]
            assert resumed[r] == full[r][10:], f"{tag} rank {r}: the resumed batches differ"
        assert full[0][10][0] == 1 and full[0][10] != full[1][10]  # mid-epoch; ranks differ
        assert _weights_equal(tmp_path / tag, tmp_path / f"{tag}resume", 2), f"{tag}: final weights differ"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mid_epoch_resume_after_a_worker_snapshot_is_exact(tmp_path: Path) -> None:
    """80 samples, batch size 2: 20 steps an epoch; stopped at step 19, after torchdata's snapshot at
    step 16 (resume.SNAPSHOT_EVERY), so the resume restores that snapshot and fetches 17-19 again."""
    plan = ",".join(f"full:2@{t},stop:2:19:19@{t}stop,resume:2:{t}stop@{t}resume" for t in ("w2", "w2p"))
    _launch(tmp_path, plan, "--batch-size", "2", "--n", "80", "--lr", "0.005")
    for tag in ("w2", "w2p"):
        full, stop, resumed = (_steps(tmp_path / f"{tag}{s}", 2) for s in ("", "stop", "resume"))
        for r in range(2):
            assert stop[r] == full[r][:19] and full[r][18][0] == 0  # stopped inside epoch 0
            assert resumed[r] == full[r][19:], f"{tag} rank {r}: the resumed batches differ"
        assert _weights_equal(tmp_path / tag, tmp_path / f"{tag}resume", 2), f"{tag}: final weights differ"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_ddp_sync_checkpoint_resumes_under_lightnings_own_ddp(tmp_path: Path) -> None:
    """Issue 45, point 2: a step-5 checkpoint of a 2-rank ddp_sync fit (mid-epoch, with ddp_sync's loader state)
    resumed by Lightning's strategy="ddp" to the end, and by ddp_sync exactly. Before: "The CombinedLoader has 0
    stateful loaders, but found 1 states in the checkpoint"."""
    output = _launch(tmp_path, "full:2,stop:2:5:5@stop,ddpresume:2:stop@ddp,resume:2:stop@sync")
    ckpt = torch.load(tmp_path / "stop" / "last.ckpt", weights_only=False)
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == []  # Lightning's place: nothing to refuse
    assert ckpt["lightning_sync"]["fit_loop_loader_states"], "ddp_sync keeps the loader state in its own entry"
    full, stop, ddp, sync = (_steps(tmp_path / tag, 2) for tag in ("full", "stop", "ddp", "sync"))
    for r in range(2):
        assert stop[r] == full[r][:5]
        assert ddp[r] and all(step[0] in (0, 1) for step in ddp[r])  # Lightning's own (inexact) mid-epoch resume
        assert ddp[r][-1][0] == 1  # trained to the end of the second epoch
        assert sync[r] == full[r][5:], f"rank {r}: ddp_sync's exact resume of the same file differs"
    assert _weights_equal(tmp_path / "full", tmp_path / "sync", 2)
    assert "CombinedLoader" not in output
    # and the model alone loads as any Lightning checkpoint does
    model = load_script(SCRIPT).Model.load_from_checkpoint(tmp_path / "stop" / "last.ckpt", map_location="cpu")
    assert torch.equal(model.state_dict()["net.0.weight"], ckpt["state_dict"]["net.0.weight"])


def _epoch_samples(steps: list[list], epoch: int) -> Counter:
    return Counter(i for rank_steps in steps for e, idx, _ in rank_steps if e == epoch for i in idx)


@pytest.fixture(scope="module")
def stopped_2ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank run stopped at step 10 (inside epoch 1) with its checkpoint in <dir>/stop/last.ckpt."""
    out = tmp_path_factory.mktemp("stopped")
    _launch(out, "stop:3:10:10", devices=2)
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_on_another_world_size_loses_no_sample(tmp_path: Path, stopped_2ranks: Path) -> None:
    """2 -> 3 ranks and 3 -> 2 ranks, each from a checkpoint inside epoch 1."""
    (tmp_path / "a").symlink_to(stopped_2ranks)
    ckpt2 = tmp_path / "a" / "stop" / "last.ckpt"
    output = _launch(tmp_path / "b", f"resume:3:{ckpt2},stop:3:7:7@stop3", devices=3)
    banners = re.findall(r"lightning_sync: root seed (\d+) \(rank 0's, from ([^)]*)\)", output)
    # the resumed run's one banner names the seed it uses (the checkpoint's), not the one the ranks agreed first;
    # the second run of this process (seed=1234 as an argument) has its own
    assert banners == [("1234", "the checkpoint being resumed"), ("1234", "argument")], banners
    _launch(tmp_path / "c", f"resume:3:{tmp_path / 'b' / 'stop3' / 'last.ckpt'}", devices=2)
    for before, world_before, after, world_after in ((tmp_path / "a" / "stop", 2, tmp_path / "b" / "resume", 3),
                                                     (tmp_path / "b" / "stop3", 3, tmp_path / "c" / "resume", 2)):
        seen, rest = _epoch_samples(_steps(before, world_before), 1), _epoch_samples(_steps(after, world_after), 1)
        assert not set(seen) & set(rest), "a sample seen before the checkpoint came again"
        assert set(seen) | set(rest) == set(range(N)), "samples of the interrupted epoch were lost"
        assert sum(rest.values()) - len(rest) <= world_after - 1
        steps_after = _steps(after, world_after)
        assert len({sum(1 for s in rank if s[0] == 1) for rank in steps_after}) == 1
        epoch2 = _epoch_samples(steps_after, 2)
        assert set(epoch2) == set(range(N)) and sum(epoch2.values()) - N <= world_after - 1
        seeds = {json.loads((after / f"rank{r}.json").read_text())["seed"] for r in range(world_after)}
        assert seeds == {1234}, "the checkpoint's root seed must carry over"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_torchrun_restart_after_sigkill_resumes_to_equal_weights(tmp_path: Path) -> None:
    """torchrun --max-restarts=1; rank 1 SIGKILLs itself at step 12 of the first attempt; resume='auto'."""
    _launch(tmp_path / "ref", "full:3")
    out = tmp_path / "elastic"
    out.mkdir()
    cmd = ["timeout", "-k", "5", "500", sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", "--max-restarts=1", str(SCRIPT), "--out", str(out), "--auto", "auto",
           "--kill-at", "12", "--plan", "stop:3:-1:5@auto"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "resume: resuming from" in proc.stderr, proc.stderr[-3000:]
    assert _weights_equal(tmp_path / "ref" / "full", out / "auto", 2)
    full, resumed = _steps(tmp_path / "ref" / "full", 2), _steps(out / "auto", 2)
    for r in range(2):
        assert resumed[r] == full[r][10:]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("args", "message"), [
    (("--batch-size", "5"), r"training batch size 5, the checkpoint's was 4.*batch_size=4"),
    (("--n", "49"), r"training data set has 49 samples, the checkpoint's had 50"),
])
def test_resume_with_other_data_stops_before_training(tmp_path: Path, stopped_2ranks: Path,
                                                       args: tuple[str, ...], message: str) -> None:
    ckpt = stopped_2ranks / "stop" / "last.ckpt"
    before = {p.name: p.read_bytes() for p in ckpt.parent.glob("*.ckpt")}
    cmd = ["timeout", "-k", "5", "300", sys.executable, str(SCRIPT), "--out", str(tmp_path), "--plan",
           f"resume:3:{ckpt}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=320)
    assert proc.returncode != 0
    assert re.search(message, proc.stderr, re.S), proc.stderr[-4000:]
    assert "ResumeError" in proc.stderr
    assert not (tmp_path / "resume").exists(), "training ran"
    assert {p.name: p.read_bytes() for p in ckpt.parent.glob("*.ckpt")} == before, "a checkpoint changed"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("step", [9, 6])  # 6: rank 0's signal in epoch 0's last step, the save in epoch 1's first
def test_slurm_requeue_signal_checkpoints_at_an_agreed_step_and_resumes_exactly(tmp_path: Path, step: int) -> None:
    """Two ranks as `srun --ntasks-per-node=2` starts them (SLURM's environment variables; SLURMEnvironment
    with auto-requeue, Lightning's default under SLURM); a stand-in `scontrol` on PATH records the requeue.
    Rank 0 gets SIGUSR1 inside step S, rank 1 inside step S+1: Lightning's handler, run right there,
    would call save_checkpoint's collectives at different steps. Under ddp_sync both agree at the start
    of step S+1 and save at its end; resuming that checkpoint ends bit-identical to the uninterrupted run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    out = tmp_path / "out"
    plan = f"full:2@ref,preempt:2:{step}@pre,resume:2:{out / 'pre' / 'hpc_ckpt_1.ckpt'}@res"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK")}
    env |= {"PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", "PYTHONPATH": str(Path(__file__).parents[1]),
            "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1",
            "SLURM_NODEID": "0", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "preempt", "SLURM_NODELIST": "localhost",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen(["timeout", "-k", "5", "400", sys.executable, str(SCRIPT), "--out", str(out),
                               "--plan", plan], env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=430)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n=== rank 1 ===\n".join(log[-5000:] for log in logs)
    pre = [json.loads((out / "pre" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [p["requeue_checkpoints"] for p in pre] == [1, 1], pre  # one agreed save, not one per signal
    assert calls.read_text().split("\n")[0] == "requeue 4242", calls.read_text()  # rank 0 only, once
    assert sorted(p.name for p in (out / "pre").glob("hpc_ckpt_*.ckpt")) == ["hpc_ckpt_1.ckpt"]
    full, resumed = _steps(out / "ref", 2), _steps(out / "res", 2)
    for r in range(2):
        assert resumed[r] == full[r][step + 2:], f"rank {r}: the resumed batches differ"
    assert full[0][step + 1][0] == 1  # epoch 1 (7 steps per epoch)
    assert _weights_equal(out / "ref", out / "res", 2), "final weights differ from the uninterrupted run"


@pytest.mark.parametrize("compact", [False, True], ids=["checkpoint", "worker snapshot"])
def test_rng_state_encodings_round_trip(compact: bool) -> None:
    """One encoding of an RNG state, two forms: tensors for checkpoints, bytes for worker snapshots."""
    import pickle
    import random

    import numpy as np

    from lightning_sync.seeding import _collect_rng_state, _restore_rng_state

    torch.manual_seed(3)
    random.seed(4)
    np.random.seed(5)
    np.random.randn()  # numpy keeps a cached gaussian in its state
    state = _collect_rng_state(compact=compact)
    if compact:
        assert isinstance(state["torch"], bytes) and isinstance(state["numpy"][1], bytes)
    else:
        assert isinstance(state["torch"], torch.Tensor) and isinstance(state["numpy"][1], torch.Tensor)
    drawn = (torch.rand(3).tolist(), random.random(), np.random.randn(2).tolist())
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    _restore_rng_state(pickle.loads(pickle.dumps(state)))
    assert (torch.rand(3).tolist(), random.random(), np.random.randn(2).tolist()) == drawn


@pytest.mark.parametrize("world_size, data_world, reshards", [(2, 1, False), (2, None, True), (1, 2, False)])
def test_a_loader_position_is_compared_with_the_ranks_the_data_is_split_over(
        caplog: pytest.LogCaptureFixture, world_size: int, data_world: int | None, reshards: bool) -> None:
    """A mid-epoch loader position written by a sampler over ``data_world`` ranks, loaded by a strategy whose
    processes are more (tensor parallelism: ranks share a slice) or fewer (ddp_sync_ft: every replica group's
    ranks split the data): the same split, so no re-shard (the batch progress is kept); without a
    ``data_world_size``, the process count is compared and the same position is taken for another world size."""
    import types

    from lightning_sync.parts.data import ResumableDataPart
    from lightning_sync.resume.loader import STATE_KEY
    from lightning_sync.resume.sampler import SAMPLER_NAME

    sampler = {"sampler": SAMPLER_NAME, "epoch": 0, "seed": 0, "shuffle": True, "drop_last": False,
               "dataset_len": 100, "world_size": data_world or 1, "start": 0, "yielded": 4, "segment_len": 10,
               "order": "randperm"}
    progress = {"ready": 4, "started": 4, "processed": 4, "completed": 4}
    checkpoint = {"loops": {"fit_loop": {"state_dict": {"combined_loader": [{STATE_KEY: {"sampler": sampler}}]},
                                         "epoch_loop.batch_progress": {"current": dict(progress)}}}}
    strategy = types.SimpleNamespace(world_size=world_size, global_rank=0)
    if data_world is not None:
        strategy.data_world_size = data_world
    with caplog.at_level("WARNING"):
        ResumableDataPart(resume=None).on_load_checkpoint(strategy, checkpoint, True, None)
    current = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    assert (current["ready"] == 0) is reshards and ("dealt out again" in caplog.text) is reshards
