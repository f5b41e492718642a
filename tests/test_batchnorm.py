"""lightning_sync.SyncBatchNorm on real gloo groups of 2 and 3 ranks, against torch's BatchNorm in one
process on the concatenation of every rank's batch."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_sync.batchnorm import (
    SyncBatchNorm,
    convert_sync_batchnorm,
    dedicated_group,
    revert_sync_batchnorm,
    share_running_stats,
    unshare_running_stats,
)
from tests.distributed import run_ranks

C = 3
STEPS = 3
SIZES_3 = (5, 3, 0)  # rank 2's batch is empty: it must still join every collective
SIZES_2 = (2, 5)
SIZES = {3: SIZES_3, 2: SIZES_2}
DDP_VARIANTS = ("world_group", "dedicated", "shared")
TOL = 1e-4

# (name, input dims, affine, track_running_stats, momentum, |mean| / std)
CASES: list[tuple[str, int, bool, bool, float | None, float]] = [
    ("1d", 2, True, True, 0.1, 0.0),
    ("1d_len", 3, True, True, 0.1, 0.0),
    ("2d", 4, True, True, 0.1, 0.0),
    ("3d", 5, True, True, 0.1, 0.0),
    ("2d_mean300", 4, True, True, 0.1, 300.0),
    ("1d_mean300", 2, True, True, 0.1, 300.0),
    ("momentum_none", 4, True, True, None, 0.0),
    ("affine_off", 3, False, True, 0.1, 0.0),
    ("no_running_stats", 4, True, False, 0.1, 0.0),
]
_SPATIAL = {2: (), 3: (4,), 4: (3, 2), 5: (2, 2, 2)}


def _global_batch(step: int, total: int, ndim: int, offset: float, dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch and an upstream gradient for it (loss = sum(y * dy))."""
    g = torch.Generator().manual_seed(1000 * step + ndim)
    shape = (total, C, *_SPATIAL[ndim])
    scale = torch.tensor([1.0, 0.5, 2.0]).view(1, C, *([1] * (ndim - 2)))
    shift = torch.tensor([offset, -offset, 0.5 * offset]).view(1, C, *([1] * (ndim - 2)))
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift * scale).to(dtype)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, dy


def _make(cls: Any, ndim: int, affine: bool, track: bool, momentum: float | None, **kw: Any) -> nn.Module:
    if cls is SyncBatchNorm:
        layer = SyncBatchNorm(C, momentum=momentum, affine=affine, track_running_stats=track, **kw)
    else:
        bn = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[ndim]
        layer = bn(C, momentum=momentum, affine=affine, track_running_stats=track, **kw)
    if affine:  # not the identity, so a wrong weight/bias gradient path shows
        with torch.no_grad():
            layer.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
            layer.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
    return layer


def _run_case(layer: nn.Module, sizes: tuple[int, ...], rank: int | None, ndim: int, offset: float
              ) -> dict[str, Any]:
    """Train-mode steps, then one eval forward; rank None = the one-process reference on all rows."""
    lo = sum(sizes[:rank]) if rank is not None else 0
    hi = lo + sizes[rank] if rank is not None else sum(sizes)
    out: dict[str, Any] = {"y": [], "dx": [], "dw": [], "db": []}
    for step in range(STEPS):
        x_all, dy_all = _global_batch(step, sum(sizes), ndim, offset)
        x = x_all[lo:hi].clone().requires_grad_(True)
        layer.zero_grad()
        y = layer(x)
        (y * dy_all[lo:hi]).sum().backward()
        out["y"].append(y.detach())
        out["dx"].append(x.grad)
        out["dw"].append(None if layer.weight is None else layer.weight.grad.clone())
        out["db"].append(None if layer.bias is None else layer.bias.grad.clone())
    layer.eval()
    x_eval, _ = _global_batch(99, sum(sizes), ndim, offset)
    with torch.no_grad():
        out["eval"] = layer(x_eval[lo:hi])
    out["buffers"] = {k: v.clone() for k, v in layer.named_buffers()}
    return out


def _all_cases(rank: int, world: int, sizes: tuple[int, ...], use_dedicated: bool) -> dict[str, Any]:
    """Every case on one group: the world, or (``use_dedicated``) a group of its own."""
    group = dedicated_group() if use_dedicated else None
    results = {}
    for name, ndim, affine, track, momentum, offset in CASES:
        layer = _make(SyncBatchNorm, ndim, affine, track, momentum, process_group=group)
        results[name] = _run_case(layer, sizes, rank, ndim, offset)
    return results


def _local_eval(rows: torch.Tensor, affine: bool) -> torch.Tensor:
    layer = _make(nn.BatchNorm1d, rows.ndim, affine, False, 0.1).eval()
    with torch.no_grad():
        return layer(rows)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (element-wise relative error is meaningless near zero)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    if b.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


def _check_against_reference(results: list[dict[str, Any]], sizes: tuple[int, ...], case: tuple[Any, ...]) -> None:
    name, ndim, affine, track, momentum, offset = case
    ref = _run_case(_make(nn.BatchNorm1d, ndim, affine, track, momentum), sizes, None, ndim, offset)
    per_rank = [r[name] for r in results]
    errors: dict[str, float] = {}
    for step in range(STEPS):
        for key in ("y", "dx"):
            errors[f"{key}[{step}]"] = _rel(torch.cat([r[key][step] for r in per_rank]), ref[key][step])
        if affine:
            for key in ("dw", "db"):  # per-rank gradients; their sum is the full-batch gradient
                errors[f"{key}[{step}]"] = _rel(sum(r[key][step] for r in per_rank), ref[key][step])
    if track:
        errors["eval"] = _rel(torch.cat([r["eval"] for r in per_rank]), ref["eval"])
    else:  # no running statistics: eval normalises each rank's batch by itself (no collective), as torch does
        x_eval, _ = _global_batch(99, sum(sizes), ndim, offset)
        for rank, (r, rows) in enumerate(zip(per_rank, x_eval.split(list(sizes)))):
            if len(rows):
                errors[f"eval on rank {rank}"] = _rel(r["eval"], _local_eval(rows, affine))
    for buf, value in ref["buffers"].items():
        for rank, r in enumerate(per_rank):
            errors[f"{buf} on rank {rank}"] = _rel(r["buffers"][buf], value)
    assert set(per_rank[0]["buffers"]) == set(ref["buffers"])
    bad = {k: v for k, v in errors.items() if v > TOL}
    assert not bad, f"{name}: relative errors above {TOL}: {bad}"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("world", [3, 2], ids=["3_ranks_5_3_0", "2_ranks_2_5_own_group"])
def test_matches_batchnorm_on_concatenated_batch(world: int, case: tuple[Any, ...]) -> None:
    _check_against_reference([r["cases"] for r in _session(world)], SIZES[world], case)


# ---------------------------------------------------------------- errors, eval, single process


def _one_value_per_channel(rank: int, world: int) -> list[str]:
    messages = []
    layer = SyncBatchNorm(C)
    for sizes in ((1,) + (0,) * (world - 1), (0,) * (world - 1) + (1,)):
        try:
            layer(torch.randn(sizes[rank], C))
        except ValueError as err:
            messages.append(str(err))
    # The group is still usable afterwards: a normal step works.
    layer(torch.randn(2, C)).sum().backward()
    return messages


@pytest.mark.parametrize("world", [2, 3])
def test_global_batch_of_one_raises_on_every_rank(world: int) -> None:
    for rank, messages in enumerate(r["one_value"] for r in _session(world)):
        assert len(messages) == 2, f"rank {rank} raised {len(messages)} of 2 times"
        assert all(m.startswith("Expected more than 1 value per channel when training") for m in messages)
        assert "rank 0 1, rank 1 0" in messages[0] and f"rank {world - 1} 1" in messages[1]


def _bad_inputs(rank: int, world: int) -> dict[str, tuple[str, float]]:
    """One rank (the last) feeds what torch's layer refuses, or a model built differently; every rank
    must raise the same error at once (before: gloo SIGABRT on one rank, garbage statistics or a hang
    on the others). Each case on fresh layers; the group stays usable after each."""
    import time

    from lightning_sync import convert_sync_batchnorm

    bad = rank == world - 1
    cases: dict[str, Any] = {
        # first forward of the layer: the metadata exchange catches it
        "channels_4_vs_8": lambda: SyncBatchNorm(4 if bad else 8)(torch.randn(3, 4 if bad else 8)),
        "input_1d": lambda: SyncBatchNorm(C)(torch.randn(C) if bad else torch.randn(3, C)),
        "input_channels": lambda: SyncBatchNorm(C)(torch.randn(3, C + 1) if bad else torch.randn(3, C)),
        "dtype": lambda: SyncBatchNorm(C, dtype=torch.float64)(torch.randn(3, C, dtype=torch.float64 if bad else
                                                                           torch.float32)),
        "converted_2d_gets_2d": lambda: convert_sync_batchnorm(nn.BatchNorm2d(C))(
            torch.randn(3, C) if bad else torch.randn(3, C, 2, 2)),
        "int_input": lambda: SyncBatchNorm(C)(torch.ones(3, C, dtype=torch.int64) if bad else torch.randn(3, C)),
    }
    out: dict[str, tuple[str, float]] = {}
    for name, call in cases.items():
        start = time.monotonic()
        try:
            call()
            msg = "no error"
        except (ValueError, RuntimeError) as err:
            msg = f"{type(err).__name__}: {err}"
        out[name] = (msg, time.monotonic() - start)
    # a later step of a layer already checked: the flag rides in the statistics exchange
    layer = SyncBatchNorm(C)
    layer(torch.randn(3, C)).sum().backward()
    start = time.monotonic()
    try:
        layer(torch.randn(C) if bad else torch.randn(3, C))
        out["later_step_1d"] = ("no error", 0.0)
    except ValueError as err:
        out["later_step_1d"] = (f"ValueError: {err}", time.monotonic() - start)
    layer(torch.randn(2, C)).sum().backward()  # still usable
    return out


def _eval_only_on_rank_0(rank: int, world: int) -> bool:
    # Rank 0 runs eval forwards while the others run none; a collective inside would block until the
    # process group's timeout and fail the test instead of passing.
    for track in (True, False):
        layer = SyncBatchNorm(C, track_running_stats=track).eval()
        if rank == 0:
            for _ in range(3):
                layer(torch.randn(4, C, 2))
    dist.barrier()
    return True


_BAD_INPUTS = {
    "channels_4_vs_8": "SyncBatchNorm: num_features differs across ranks: rank 0 8, ",
    "input_1d": "rank {bad}: expected at least 2D input (got 1D input)",
    "input_channels": f"rank {{bad}}: expected input with {C} channels (dim 1) for this layer, got {C + 1} "
                      f"(input shape (3, {C + 1}))",
    "dtype": "SyncBatchNorm: input dtype differs across ranks: rank 0 float32, ",
    "converted_2d_gets_2d": "rank {bad}: expected 4D input (got 2D input)",
    "int_input": "rank {bad}: expected a floating point input, got torch.int64",
    "later_step_1d": "rank {bad}: expected at least 2D input (got 1D input)",
}


@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_on_one_rank_raises_on_every_rank(world: int) -> None:
    bad = world - 1
    for rank, res in enumerate(r["bad"] for r in _session(world)):
        for case, words in _BAD_INPUTS.items():
            msg, took = res[case]
            assert words.format(bad=bad) in msg, (rank, case, msg)
            assert msg.startswith("ValueError: SyncBatchNorm: bad input on rank" if "{bad}" in words
                                  else "RankMismatchError: SyncBatchNorm: "), (rank, case, msg)
            assert took < 30, (rank, case, took)
        assert f"rank {bad} 4" in res["channels_4_vs_8"][0]


def test_converted_layer_refuses_what_torch_refuses() -> None:
    from lightning_sync import convert_sync_batchnorm

    for torch_layer, bad_input in ((nn.BatchNorm2d(C), torch.randn(3, C)), (nn.BatchNorm1d(C), torch.randn(3, C, 2, 2)),
                                   (nn.BatchNorm3d(C), torch.randn(3, C, 2))):
        with pytest.raises(ValueError) as want:
            torch_layer(bad_input)
        with pytest.raises(ValueError) as got:
            convert_sync_batchnorm(torch_layer)(bad_input)
        assert str(got.value) == str(want.value)


@pytest.mark.parametrize("world", [2, 3])
def test_eval_mode_runs_no_collective(world: int) -> None:
    assert [r["eval"] for r in _session(world)] == [True] * world


@pytest.mark.parametrize("ndim", [2, 4])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_not_distributed_is_exactly_batchnorm(ndim: int, momentum: float | None) -> None:
    assert not dist.is_initialized()
    sync = _make(SyncBatchNorm, ndim, True, True, momentum)
    ref = _make(nn.BatchNorm1d, ndim, True, True, momentum)
    got, want = _run_case(sync, (6,), 0, ndim, 3.0), _run_case(ref, (6,), 0, ndim, 3.0)
    for key in ("y", "dx", "dw", "db"):
        for a, b in zip(got[key], want[key]):
            assert torch.equal(a, b), key
    assert torch.equal(got["eval"], want["eval"])
    for k, v in want["buffers"].items():
        assert torch.equal(got["buffers"][k], v), k
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        SyncBatchNorm(C)(torch.randn(1, C))
    with pytest.raises(ValueError, match="at least 2D"):
        SyncBatchNorm(C)(torch.randn(C))


# ---------------------------------------------------------------- convert / revert


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.BatchNorm1d(C)
        self.b = nn.Sequential(nn.Conv2d(C, C, 1), nn.BatchNorm2d(C, momentum=None))
        self.c = nn.BatchNorm3d(C, affine=False, dtype=torch.float64)
        self.d = nn.SyncBatchNorm(C, eps=1e-3)
        self.nobias = nn.BatchNorm1d(C, bias=False)
        self.frozen = nn.BatchNorm2d(C).requires_grad_(False)
        self.marked = nn.BatchNorm1d(C)
        self.marked.sync_batchnorm = False  # type: ignore[assignment]
        self.head = nn.Sequential(nn.BatchNorm1d(C))


def _snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "classes": {n: type(m) for n, m in model.named_modules()},
        "tensors": {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def test_convert_and_revert_round_trip_preserve_everything() -> None:
    model = _Net()
    model.a.bias.requires_grad_(False)  # only partly frozen: converted, flag kept
    model.b[1].eval()
    model.a.qconfig = "kept"  # type: ignore[assignment]
    calls: list[str] = []
    model.a.register_forward_hook(lambda *_: calls.append("hook"))
    before = _snapshot(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = convert_sync_batchnorm(model, exclude=["head"])
    assert converted is model
    messages = [str(w.message) for w in caught if "unsynchronised" in str(w.message)]
    assert len(messages) == 1, messages
    assert all(name in messages[0] for name in ("frozen", "marked", "head.0")) and "nobias" not in messages[0]

    for name in ("a", "b.1", "c", "d", "nobias"):
        assert isinstance(model.get_submodule(name), SyncBatchNorm), name
    for name in ("frozen", "marked", "head.0"):
        assert type(model.get_submodule(name)) is before["classes"][name], name
    mid = _snapshot(model)
    assert all(mid["tensors"][n] is t for n, t in before["tensors"].items()), "parameters/buffers must be the same objects"
    assert mid["requires_grad"] == before["requires_grad"]
    assert mid["training"] == before["training"]
    assert model.c.running_mean.dtype == torch.float64
    assert model.d.eps == 1e-3 and model.b[1].momentum is None and model.nobias.bias is None
    assert model.a.qconfig == "kept"
    model.a(torch.randn(4, C))
    assert calls == ["hook"]
    assert mid["state"].keys() == before["state"].keys()

    # A checkpoint of the converted model loads into a fresh plain one (same keys and shapes).
    nn.Module.load_state_dict(_Net(), model.state_dict(), strict=True)
    assert convert_sync_batchnorm(model, exclude=["head"]) is model  # idempotent
    reverted = revert_sync_batchnorm(model)
    after = _snapshot(reverted)
    assert after["classes"] == before["classes"]
    assert all(after["tensors"][n] is t for n, t in before["tensors"].items())
    assert after["requires_grad"] == before["requires_grad"] and after["training"] == before["training"]
    assert not hasattr(reverted.a, "process_group") and reverted.d.process_group is None
    assert not any(k.startswith("_lsync") for m in reverted.modules() for k in vars(m))
    reverted.a(torch.randn(4, C))
    assert calls == ["hook", "hook"] and reverted.a.qconfig == "kept"


def test_convert_single_layer_and_revert_by_seen_dimensionality() -> None:
    layer = nn.BatchNorm2d(C)
    converted = convert_sync_batchnorm(layer)
    assert isinstance(converted, SyncBatchNorm) and converted.weight is layer.weight
    assert type(revert_sync_batchnorm(converted)) is nn.BatchNorm2d
    direct = SyncBatchNorm(C)
    assert type(revert_sync_batchnorm(direct)).__name__ == "_BatchNormXd"  # never saw an input
    direct(torch.randn(2, C, 2, 2, 2))
    assert type(revert_sync_batchnorm(direct)) is nn.BatchNorm3d
    with pytest.raises(ValueError, match="lazy BatchNorm"):
        convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm1d()))


# ---------------------------------------------------------------- inside torch DDP on CPU

SIZES_DDP = (5, 3)


def _ddp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                         nn.ReLU(), nn.Linear(8, 1))


def _ddp_batch(step: int) -> torch.Tensor:
    return torch.randn(sum(SIZES_DDP), 4, generator=torch.Generator().manual_seed(step)) * 3 + 1


def _train_ddp(rank: int, world: int, variant: str) -> dict[str, torch.Tensor]:
    model = convert_sync_batchnorm(_ddp_model(), process_group=dedicated_group() if variant == "dedicated" else None)
    shared: list[str] = []
    if variant == "shared":
        if rank == 1:  # different starting statistics: share_running_stats must make them equal once
            model[1].running_mean.add_(5.0)
        shared = share_running_stats(model)
        assert shared == [f"{i}.{b}" for i in (1, 4) for b in ("running_mean", "running_var", "num_batches_tracked")]
    # The check that fails for torch.nn.SyncBatchNorm on CPU ("only work with GPU modules") passes here.
    ddp = nn.parallel.DistributedDataParallel(model)
    assert set(shared) <= ddp.parameters_to_ignore
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    lo = sum(SIZES_DDP[:rank])
    for step in range(3):
        x = _ddp_batch(step)[lo:lo + SIZES_DDP[rank]]
        opt.zero_grad()
        # Sum over local rows scaled so DDP's gradient average equals the full-batch mean gradient.
        (ddp(x).square().sum() * world / sum(SIZES_DDP)).backward()
        opt.step()
    unshare_running_stats(model, shared)
    assert not hasattr(model, "_ddp_params_and_buffers_to_ignore")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("variant", DDP_VARIANTS)
def test_ddp_on_cpu_trains_like_one_process(variant: str) -> None:
    states = [r["ddp"][variant] for r in _session(2)]
    ref = _ddp_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        ref(_ddp_batch(step)).square().mean().backward()
        opt.step()
    for key, want in ref.state_dict().items():
        for rank, state in enumerate(states):
            err = _rel(state[key], want) if want.is_floating_point() else float(not torch.equal(state[key], want))
            assert err <= TOL, f"{key} on rank {rank}: relative error {err}"
        assert torch.equal(states[0][key], states[1][key]), f"{key} differs across ranks"


# ---------------------------------------------------------------- one gloo group per world size


def _run_session(rank: int, world: int) -> dict[str, Any]:
    """Everything the multi-process tests above check, in one gloo group: starting ranks is the slow
    part on a busy machine. Each test then asserts on its own piece."""
    out: dict[str, Any] = {
        "cases": _all_cases(rank, world, SIZES[world], world == 2),
        "one_value": _one_value_per_channel(rank, world),
        "eval": _eval_only_on_rank_0(rank, world),
        "bad": _bad_inputs(rank, world),
    }
    if world == 2:
        out["ddp"] = {variant: _train_ddp(rank, world, variant) for variant in DDP_VARIANTS}
    return out


_SESSIONS: dict[int, list[dict[str, Any]] | BaseException] = {}


def _session(world: int) -> list[dict[str, Any]]:
    """The session's per-rank results, run once; a failure is kept too, so it is not re-run per test."""
    if world not in _SESSIONS:
        try:
            _SESSIONS[world] = run_ranks(_run_session, world_size=world, timeout=240, pg_timeout=30)
        except BaseException as err:  # noqa: BLE001 - re-raised in every test that needs it
            _SESSIONS[world] = err
    result = _SESSIONS[world]
    if isinstance(result, BaseException):
        raise result
    return result


def _pickle_after_training(rank: int, world: int) -> dict[str, Any]:
    import copy
    import io

    from lightning_sync import convert_sync_batchnorm

    torch.manual_seed(0)
    model = convert_sync_batchnorm(nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1)))
    x = torch.randn(8, 4) + rank
    model(x).sum().backward()  # the first distributed forward compares every rank's input metadata
    buffer = io.BytesIO()
    torch.save(model, buffer)  # as save_hyperparameters' modules are, in every checkpoint
    twin = copy.deepcopy(model)  # as EMA / SWA callbacks copy a model
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    out = [m(x).detach() for m in (model, twin, loaded)]  # the copies train alike (they compare again first)
    return {"same": all(torch.equal(out[0], o) for o in out[1:]),
            "stats": [float(m[1].running_mean.sum()) for m in (model, twin, loaded)]}


def test_converted_model_pickles_and_deep_copies_after_a_distributed_forward() -> None:
    """lightning-hydra-template's checkpoint failed here: the layer held the ProcessGroup it had checked
    its inputs over, and a ProcessGroup cannot be pickled ("cannot pickle ...ProcessGroup object")."""
    for res in run_ranks(_pickle_after_training, 2, timeout=60):
        assert res["same"] and len(set(res["stats"])) == 1, res
