"""Memory flat in the size of the data set: exact evaluation and prediction over 1e7 samples on 2 real ranks.

The samplers and the batch-index bookkeeping of ``ddp_sync`` hold no Python list of the epoch's
indices (an unshuffled order is a ``range``, a shuffled one a single int32 tensor, or above 2**24
samples a permutation computed as it is read), so rank 0's
peak RSS growth over a 10,000,001-sample epoch stays under 64 MiB (Lightning's ``ddp`` grows by
~390 MiB on the same epoch: ``bench/bench_scale.py``), and the logged values still equal one
process on the whole set.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.launch import load_script

# One run of the benchmark's measurement (fresh rank processes, rank 0's RSS sampled every 2 ms);
# the benchmark prints the same figures beside Lightning's ddp at 1e6..1e8 samples.
BENCH = Path(__file__).parents[1] / "bench" / "bench_scale.py"
N = 10_000_001
BOUND = 64 * 2**20


def measure(tmp_path: Path, mode: str, *args: str) -> dict[str, Any]:
    cmd = [sys.executable, str(BENCH), "--one", "--mode", mode, "--strategy", "ddp_sync", "--n", str(N),
           "--out", str(tmp_path), *args]
    proc = subprocess.run(["timeout", "-k", "5", "240", *cmd], capture_output=True, text=True, timeout=260)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])  # type: ignore[no-any-return]


def one_process(n: int) -> dict[str, float]:
    """The whole set in one process, in chunks: the mean cross-entropy and the accuracy."""
    rows = load_script(BENCH.parent / "bench_predict.py").Rows(n)
    net = load_script(BENCH).make_model()
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for start in range(0, n, 1 << 20):
            x, y = rows.__getitems__(list(range(start, min(n, start + (1 << 20)))))
            logits = net(x)
            loss_sum += float(torch.nn.functional.cross_entropy(logits.double(), y, reduction="sum"))
            correct += int((logits.argmax(-1) == y).sum())
    return {"val_loss": loss_sum / n, "val_acc": correct / n}


@pytest.fixture(scope="module")
def reference() -> dict[str, float]:
    return one_process(N)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_validation_epoch_of_1e7_samples_grows_rank0_by_at_most_64_mib(tmp_path: Path, shuffle: bool,
                                                                       reference: dict[str, float]) -> None:
    report = measure(tmp_path, "validate", *(["--shuffle"] if shuffle else []))
    growth = report["growth"]
    print(f"shuffle={shuffle}: rank 0 peak RSS growth {growth / 2**20:.1f} MiB over {N} samples")
    assert growth <= BOUND, f"{growth / 2**20:.1f} MiB"  # measured 18 MiB ordered, 56 MiB shuffled (int32 order)
    assert report["metrics"]["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
    assert report["metrics"]["val_acc"] == pytest.approx(reference["val_acc"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_predict_loop_of_1e7_samples_holds_no_epoch_of_batch_indices(tmp_path: Path) -> None:
    # Lightning's _IndexBatchSamplerWrapper keeps every batch's index list for the epoch (~360 MiB here)
    growth = measure(tmp_path, "predict")["growth"]
    print(f"predict: rank 0 peak RSS growth {growth / 2**20:.1f} MiB over {N} samples")
    assert growth <= BOUND, f"{growth / 2**20:.1f} MiB"  # measured 20 MiB


class _Peak:
    """This process's peak RSS growth over a block (VmHWM reset through /proc/self/clear_refs)."""

    def __enter__(self) -> _Peak:
        Path("/proc/self/clear_refs").write_text("5")
        self.base = self._status("VmRSS")
        return self

    @staticmethod
    def _status(key: str) -> int:
        text = Path("/proc/self/status").read_text()
        return int(text.split(key + ":")[1].split()[0]) * 1024

    def __exit__(self, *exc: object) -> None:
        self.growth = self._status("VmHWM") - self.base


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_samplers_walk_1e7_indices_without_a_list(shuffle: bool) -> None:
    from torch.utils.data import DistributedSampler

    from lightning_sync.resume import ResumableDistributedSampler
    from lightning_sync.sampling import ExactEvalBatchSampler

    n = N

    class Sized:
        def __len__(self) -> int:
            return n

    with _Peak() as train:
        sampler = ResumableDistributedSampler(Sized(), num_replicas=2, rank=1, shuffle=shuffle, seed=3)  # type: ignore[arg-type]
        count = last = 0
        for last in sampler:
            count += 1
        state = sampler.state_dict()
    assert count == len(sampler) == (n + 1) // 2 and state["yielded"] == count
    with _Peak() as evaluation:
        batches = ExactEvalBatchSampler(DistributedSampler(Sized(), 2, 0, shuffle=shuffle, seed=3), 8192, 0, 2)  # type: ignore[arg-type]
        seen = sum(len(b) for b in batches)
    assert seen == (n + 1) // 2
    if not shuffle:
        assert last == 0  # rank 1's last sample pads the odd epoch with its first index, as torch's sampler does
    # a list of the epoch's indices would be ~36 bytes a sample (360 MB); a shuffled order is one int32 tensor
    limit = 16 * 2**20 + (4 * n if shuffle else 0)
    assert train.growth < limit and evaluation.growth < limit, (train.growth, evaluation.growth)


def test_prediction_index_wrapper_holds_recent_batches_only() -> None:
    from torch.utils.data import BatchSampler, SequentialSampler

    from lightning_sync._compat.lightning_api import RecentBatches, index_batch_sampler
    from lightning_sync.pl._compat.lightning_api import index_batch_sampler as pl_index_batch_sampler

    wrapper = index_batch_sampler(BatchSampler(SequentialSampler(range(100)), 3, False), window=4)
    from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper

    assert isinstance(wrapper, _IndexBatchSamplerWrapper)  # the type Lightning's predict loop looks for
    seen = []
    for batch_idx, batch in enumerate(wrapper):
        if batch_idx % 2 == 0:  # the loop reads batch_idx (with a prediction writer), in order
            assert wrapper.seen_batch_indices[batch_idx] == batch
        seen.append(batch)
        assert len(wrapper.seen_batch_indices) == batch_idx + 1 and len(wrapper.seen_batch_indices._held) <= 4
    assert [i for b in seen for i in b] == list(range(100))
    with pytest.raises(IndexError, match="no longer held"):
        wrapper.seen_batch_indices[0]
    assert isinstance(wrapper.seen_batch_indices, RecentBatches)
    assert type(pl_index_batch_sampler(BatchSampler(SequentialSampler(range(3)), 2, False))).__mro__[1].__module__ \
        .startswith("pytorch_lightning")


def test_epoch_order_reads_like_a_list_and_keeps_keys_beyond_int64() -> None:
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from torch.utils.data import Sampler

    from lightning_sync.sampling import EpochOrder, global_order

    for order in (EpochOrder.of(11, False, 0), EpochOrder.of(11, True, 5), EpochOrder(3, ["a", "b", "c"])):
        ref = order.tolist()
        assert list(order) == ref and [order[i] for i in range(len(ref))] == ref and order[-1] == ref[-1]
        assert order[2:9:3] == ref[2:9:3] and order[::-2] == ref[::-2]
        with pytest.raises(IndexError):
            order[len(ref)]

    class Keys(Sampler[int]):  # 64-bit hash keys as "indices" of a user's own sampler
        def __init__(self, keys: list[int]) -> None:
            self.keys = keys

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(self.keys)

        def __len__(self) -> int:
            return len(self.keys)

    keys = [2**63 + i for i in range(4)]
    assert global_order(DistributedSamplerWrapper(Keys(keys), num_replicas=1, rank=0, shuffle=False)).tolist() == keys


# ---------------------------------------------------------------- shuffled orders beyond IN_MEMORY_SHUFFLE_MAX


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 1000, 4097, 65536, 100_003])
def test_random_permutation_is_a_seeded_bijection(n: int) -> None:
    from lightning_sync.sampling import RandomPermutation

    perm = RandomPermutation(n, 7)
    whole = perm[0:n]
    assert whole.dtype == torch.int64 and sorted(whole.tolist()) == list(range(n))  # every index once
    assert torch.equal(perm[torch.arange(n - 1, -1, -1)], whole.flip(0))  # positions read in any order
    assert torch.equal(perm[1:n:3], whole[1::3]) and torch.equal(RandomPermutation(n, 7)[0:n], whole)
    if n >= 1000:  # another seed (epoch): another order; neighbours are not neighbours
        assert (RandomPermutation(n, 8)[0:n] != whole).float().mean() > 0.99
        assert (whole[1:] - whole[:-1]).abs().double().mean() / n == pytest.approx(1 / 3, abs=0.02)
    with pytest.raises(IndexError):
        perm[torch.tensor([n])]


def test_orders_beyond_in_memory_max_are_computed_and_hold_nothing_per_sample() -> None:
    from torch.utils.data import DistributedSampler

    from lightning_sync.resume import ResumableDistributedSampler
    from lightning_sync.sampling import IN_MEMORY_SHUFFLE_MAX, EpochOrder, ExactEvalBatchSampler, RandomPermutation

    assert isinstance(EpochOrder.of(IN_MEMORY_SHUFFLE_MAX, True, 0).values, torch.Tensor)  # torch's order up to it
    assert isinstance(EpochOrder.of(IN_MEMORY_SHUFFLE_MAX + 1, True, 0).values, RandomPermutation)
    n = 100_000_001  # randperm would hold 400 MB

    class Sized:
        def __len__(self) -> int:
            return n

    with _Peak() as peak:
        batches = iter(ExactEvalBatchSampler(DistributedSampler(Sized(), 2, 1, shuffle=True, seed=3), 8192, 1, 2))  # type: ignore[arg-type]
        first = [next(batches) for _ in range(20)]
        sampler = ResumableDistributedSampler(Sized(), num_replicas=2, rank=0, shuffle=True, seed=3)  # type: ignore[arg-type]
        it = iter(sampler)
        head = [next(it) for _ in range(100_000)]
    assert peak.growth < 16 * 2**20, peak.growth
    assert all(len(b) == 8192 for b in first) and len({i for b in first for i in b}) == 20 * 8192
    assert min(i for b in first for i in b) >= 0 and max(i for b in first for i in b) < n
    order = RandomPermutation(n, 3)  # rank 1's contiguous block starts at position ceil(n / 2); rank 0 every 2nd
    assert first[0] == order[(n + 1) // 2:(n + 1) // 2 + 8192].tolist() and head == order[0:200_000:2].tolist()


def test_training_order_beyond_in_memory_max_resumes_exactly_and_old_states_keep_randperm() -> None:
    from lightning_sync.errors import ResumeError
    from lightning_sync.resume import ResumableDistributedSampler
    from lightning_sync.sampling import IN_MEMORY_SHUFFLE_MAX

    n = IN_MEMORY_SHUFFLE_MAX + 3

    class Sized:
        def __len__(self) -> int:
            return n

    def sampler(rank: int) -> ResumableDistributedSampler:
        s = ResumableDistributedSampler(Sized(), num_replicas=2, rank=rank, seed=5)  # type: ignore[arg-type]
        s.set_epoch(1)
        return s

    for rank in range(2):
        uninterrupted = iter(sampler(rank))
        whole = [next(uninterrupted) for _ in range(3000)]
        stopped = sampler(rank)
        it = iter(stopped)
        head = [next(it) for _ in range(1000)]
        state = stopped.state_dict()
        assert state["order"] == "feistel" and head == whole[:1000]
        resumed = sampler(rank)
        resumed.load_state_dict(state)
        resumed.set_epoch(1)
        rest = iter(resumed)
        assert head + [next(rest) for _ in range(2000)] == whole  # the same positions of the same order

        # a state written before "order" was recorded resumes the order that wrote it: torch's randperm
        old = {k: v for k, v in state.items() if k != "order"}
        resumed = sampler(rank)
        resumed.load_state_dict(old)
        assert resumed.order == "randperm" and isinstance(resumed.epoch_order().values, torch.Tensor)
        with pytest.raises(ResumeError, match="drew its shuffled order as 'sobol'"):
            sampler(rank).load_state_dict({**state, "order": "sobol"})
