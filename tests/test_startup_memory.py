"""Start-up memory of ddp_sync is ddp's: no whole-model copies before the first step (issue 40).

The guard's initial-parameter check (``warn_if_initial_parameters_differ``, run just before the DDP
wrap) checksums only the tensors the wrap will not overwrite (none, for most models), and
:func:`~lightning_sync.guard.checksums.checksum` streams over a tensor in fixed-size chunks, so its
temporaries are O(chunk), not ~24 bytes per element of the model. The fast tests pin the checksum
(the documented formula, deterministic, layout-independent, permutation-sensitive, O(chunk)
temporaries) and what the initial check computes; the slow one fits a 123M-parameter model on 2 real
ranks under ``ddp`` and ``ddp_sync`` (``bench/bench_startup.py``'s measurement) and compares rank 0's
peak RSS at ``on_train_start``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_sync import collectives
from lightning_sync.callbacks import consistency
from lightning_sync.guard import checksums
from lightning_sync.guard.checksums import checksum
from tests.launch import launch_script

BENCH = Path(__file__).parents[1] / "bench" / "bench_startup.py"


def reference(tensor: torch.Tensor) -> tuple[float, float]:
    """The documented formula on the whole tensor at once (the pre-chunking code), and a rounding scale."""
    flat = tensor.detach().reshape(-1).to(torch.float64)
    if flat.numel() == 0:
        return 0.0, 0.0
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64).remainder_(7919)
    value = float(flat.sum()) + float((flat * weights).sum()) * 1e-3
    return value, float(flat.abs().sum()) + float((flat.abs() * weights).sum()) * 1e-3


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(37, 53, generator=g)
    return {
        "float32": base,
        "float64": base.double(),
        "bfloat16": base.bfloat16(),
        "float16": base.half(),
        "int64": torch.randint(-1000, 1000, (2000,), generator=g),
        "int32": torch.randint(-1000, 1000, (9, 11, 13), generator=g, dtype=torch.int32),
        "uint8": torch.randint(0, 255, (3000,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(17000, generator=g) > 0.5,
        "0-d": torch.tensor(3.5),
        "one": torch.tensor([2.0]),
        "transposed": base.t(),
        "strided": torch.randn(40, 60, generator=g)[::3, 1::2],
        "permuted 3-d": torch.randn(6, 7, 8, generator=g).permute(2, 0, 1),
        "expanded": torch.randn(5, 1, generator=g).expand(5, 900),
        "long row": torch.randn(3, 20000, generator=g),
        "parameter": nn.Parameter(base.clone()),
    }


@pytest.mark.parametrize("chunk", [None, 1000, 7919 * 2, 3])
@pytest.mark.parametrize("name", list(tensors()))
def test_chunked_checksum_is_the_documented_formula(name: str, chunk: int | None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if chunk is not None:  # small chunks: many chunks, boundaries inside rows and off the weights' period
        monkeypatch.setattr(checksums, "_CHUNK", chunk)
    tensor = tensors()[name]
    value, scale = reference(tensor)
    got = checksum(tensor)
    assert isinstance(got, float)
    assert math.isclose(got, value, rel_tol=0, abs_tol=1e-12 * scale + 1e-300), (name, got, value)
    if not tensor.is_floating_point():  # integers: every partial sum is exact in float64
        assert got == value


def test_empty_tensors_give_zero() -> None:
    for empty in (torch.empty(0), torch.empty(0, 5), torch.empty(4, 0, dtype=torch.int64), torch.empty(0).bfloat16()):
        assert checksum(empty) == 0.0


@pytest.mark.parametrize("chunk", [None, 1000, 7])
def test_deterministic_and_independent_of_memory_layout(chunk: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if chunk is not None:
        monkeypatch.setattr(checksums, "_CHUNK", chunk)
    g = torch.Generator().manual_seed(1)
    t = torch.randn(300, 41, generator=g)
    first = checksum(t)
    assert checksum(t) == first and checksum(t.clone()) == first  # bit for bit: replicas compare with ==
    other_layout = t.t().contiguous().t()  # the same values, column-major
    assert not other_layout.is_contiguous() and checksum(other_layout) == first
    assert checksum(t.to(memory_format=torch.contiguous_format)) == first


@pytest.mark.parametrize("chunk", [None, 1000])
def test_permutations_change_the_checksum(chunk: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if chunk is not None:
        monkeypatch.setattr(checksums, "_CHUNK", chunk)
    g = torch.Generator().manual_seed(2)
    t = torch.randn(5000, generator=g)
    first = checksum(t)
    for i, j in ((0, 1), (10, 4000), (999, 1000), (17, 17 + 7919 // 2)):  # neighbours, across chunks
        swapped = t.clone()
        swapped[[i, j]] = swapped[[j, i]]
        assert checksum(swapped) != first, (i, j)
    assert checksum(t.flip(0)) != first
    assert checksum(t.reshape(50, 100).t()) != first  # transposed values: same multiset, other order
    assert checksum(t.sort().values) != first


class _Allocations(TorchDispatchMode):
    """The largest storage any aten op creates (views and in-place results share an input's)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_temporaries_are_one_chunk_not_the_tensor(layout: str, dtype: torch.dtype,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksums, "_CHUNK", 1 << 12)
    tensor = torch.arange(1 << 18).to(dtype).reshape(512, 512)  # 256k elements: 2 MiB of float64
    if layout == "transposed":
        tensor = tensor.t()
    with _Allocations() as allocations:
        value = checksum(tensor)
    assert value == reference(tensor)[0]  # small integers: exact either way
    bound = 8 * ((1 << 12) + 7919) + 4096  # one float64 chunk buffer, the weights (chunk + one period), scalars
    assert allocations.largest <= bound, f"a {allocations.largest}-byte temporary for a {tensor.numel()}-element tensor"


def _dtensor_checksums(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    checksums._CHUNK = 7  # a fresh rank process: many chunks per shard
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(60.0).reshape(10, 6).sin()
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    by_columns = distribute_tensor(full, mesh, [Shard(1)])  # a non-contiguous local shard
    replicated = distribute_tensor(full, mesh, [Replicate()])
    return {"shard": checksum(sharded), "own rows": checksum(full[rank * 5:(rank + 1) * 5]),
            "column shard": checksum(by_columns), "own columns": checksum(full[:, rank * 3:(rank + 1) * 3]),
            "replicated": checksum(replicated), "full": checksum(full)}


def test_dtensor_is_checked_on_its_local_shard() -> None:
    from tests.distributed import run_ranks

    rank0, rank1 = run_ranks(_dtensor_checksums, world_size=2, timeout=120)
    for got in (rank0, rank1):
        assert got["shard"] == got["own rows"] and got["column shard"] == got["own columns"]
        assert got["replicated"] == got["full"]
    assert rank0["shard"] != rank1["shard"] and rank0["replicated"] == rank1["replicated"]


# ----------------------------------------------------------------- what the initial check computes


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.bn = nn.BatchNorm1d(2)


@pytest.mark.parametrize(("kwargs", "ignored", "expected"), [
    ({}, [], []),  # DDP's default init sync overwrites everything: nothing to checksum
    ({"broadcast_buffers": False}, [], ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]),
    ({}, ["lin.bias"], ["lin.bias"]),
    ({"init_sync": False}, [], ["lin.weight", "lin.bias", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var",
                                "bn.num_batches_tracked"]),
])
def test_initial_check_checksums_only_what_the_wrap_keeps(kwargs: dict[str, Any], ignored: list[str],
                                                          expected: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Net()
    if ignored:
        model._ddp_params_and_buffers_to_ignore = ignored  # type: ignore[assignment]
    by_tensor = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    summed: list[str] = []
    gathered: list[Any] = []

    def counting(tensor: torch.Tensor) -> float:
        summed.append(by_tensor[id(tensor)])
        return checksums.checksum(tensor)

    def gather(obj: Any, safe: bool = False) -> list[Any]:
        gathered.append(obj)
        return [obj, obj]  # two ranks with equal values

    monkeypatch.setattr(consistency, "checksum", counting)
    monkeypatch.setattr(collectives, "is_distributed", lambda: True)
    monkeypatch.setattr(collectives, "gather_objects", gather)
    assert consistency.warn_if_initial_parameters_differ(model, kwargs) == []
    assert sorted(summed) == sorted(expected)
    assert len(gathered) == 1 and sorted(n for n, _ in gathered[0]) == sorted(expected)  # the gather always runs


# ----------------------------------------------------------------- a real 2-rank fit


ROWS, DIM = 30000, 4096  # 123M float32 parameters, 491 MB


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_sync_start_up_peak_rss_is_ddps(tmp_path: Path) -> None:
    reports = {}
    for strategy in ("ddp", "ddp_sync"):
        out = tmp_path / strategy
        launch_script(BENCH, out, "--one", "--strategy", strategy, "--rows", str(ROWS), "--dim", str(DIM), "--step",
                      timeout=270)
        reports[strategy] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in range(2):
        assert reports["ddp"][r]["params"] == reports["ddp_sync"][r]["params"] == ROWS * DIM
    ddp, sync = reports["ddp"][0]["peak"], reports["ddp_sync"][0]["peak"]
    assert ddp > ROWS * DIM * 4  # the model is in it
    rank1 = reports["ddp_sync"][1]["peak"], reports["ddp"][1]["peak"]
    assert sync <= 1.1 * ddp, (
        f"rank 0's peak RSS at on_train_start: ddp_sync {sync / 1e6:.0f} MB, ddp {ddp / 1e6:.0f} MB "
        f"({sync / ddp:.2f}x); rank 1: ddp_sync {rank1[0] / 1e6:.0f} MB, ddp {rank1[1] / 1e6:.0f} MB")
