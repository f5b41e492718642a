"""lightning_sync.collectives on real gloo groups of 2 and 3 ranks, against one-process results."""

from __future__ import annotations

import pytest
import torch

import lightning_sync as ls
from lightning_sync import _pickling as P
from lightning_sync import collectives as C
from tests.distributed import run_ranks

BIG = 2**53 + 1  # not representable in float64: any float detour shows


def _rows(rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uneven per-rank data: rank r has (5 - 2r) rows (rank 2 has 1), values unique per rank."""
    n = max(0, 5 - 2 * rank)
    return (torch.arange(n * 3, dtype=torch.float64).reshape(n, 3) + 100 * rank).to(dtype)


# ---------------------------------------------------------------- no process group


def test_not_distributed_returns_input_unchanged() -> None:
    t = torch.arange(4.0)
    assert C.all_reduce(t, op="mean") is t
    rows, counts = C.all_gather_uneven(t)
    assert rows is t and counts == [4]
    obj = {"a": 1}
    assert C.broadcast_object(obj) is obj
    assert C.gather_objects(obj) == [obj] and C.gather_objects(obj, dst=0) == [obj]
    assert C.broadcast_seed(7) == 7
    assert 0 <= C.broadcast_seed() <= C.MAX_SEED


def test_bad_arguments_raise_early() -> None:
    with pytest.raises(ValueError, match="op must be one of"):
        C.all_reduce(torch.ones(1), op="avg")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed must be an int"):
        C.broadcast_seed(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[0, 4294967295\]"):
        C.broadcast_seed(2**40)
    with pytest.raises(ValueError, match="0-d"):
        C.all_gather_uneven(torch.tensor(1.0))
    with pytest.raises(ValueError, match="0-d"):
        C.gather_uneven(torch.tensor(1.0))
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor; got float 2.5"):
        C.all_reduce(2.5)  # type: ignore[arg-type]


# ---------------------------------------------------------------- happy paths


def _all_cases(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    # all_reduce: every op, float and int64 above 2**53
    base = torch.tensor([1.0 + rank, -2.0 * rank, 3.0])
    for op in ("sum", "mean", "max", "min", "prod"):
        t = base.clone()
        res = C.all_reduce(t, op=op)
        assert res is t
        out[f"reduce_{op}"] = t
    big = torch.tensor([BIG + rank, -BIG], dtype=torch.int64)
    out["reduce_big"] = C.all_reduce(big.clone())
    out["reduce_bool_any"] = C.all_reduce(torch.tensor([rank == 0, False]), op="max")
    out["reduce_bool_all"] = C.all_reduce(torch.tensor([rank == 0, True]), op="min")
    nc = torch.arange(6.0).reshape(2, 3).t() * (rank + 1)  # non-contiguous: reduced through a copy
    C.all_reduce(nc)
    out["reduce_noncontig"] = nc
    # all_gather_uneven: float, int64 above 2**53, bool, empty on one rank, 3-d trailing shape
    out["gather_f32"] = C.all_gather_uneven(_rows(rank))
    out["gather_big"] = C.all_gather_uneven(torch.full((rank + 1,), BIG + rank, dtype=torch.int64))
    out["gather_bool"] = C.all_gather_uneven(torch.tensor([True, False, rank % 2 == 0])[: rank + 1])
    out["gather_empty_here"] = C.all_gather_uneven(_rows(rank)[: 0 if rank == 0 else 2])
    out["gather_all_empty"] = C.all_gather_uneven(torch.empty(0, 4))
    out["gather_3d"] = C.all_gather_uneven(torch.full((rank, 2, 2), float(rank)))
    n = 4 - rank
    out["gather_dict"] = C.all_gather_uneven_dict({
        "x": torch.full((n, 3), float(rank)),
        "idx": torch.arange(n, dtype=torch.int64) + BIG,
        "flag": torch.ones(n, 2, dtype=torch.bool),
    })
    # objects
    out["bcast"] = C.broadcast_object({"rank": rank, "s": "x" * (10 * rank)} if rank == 1 else None, src=1)
    out["gather_all"] = C.gather_objects(("r", rank, "y" * rank))
    out["gather_dst"] = C.gather_objects([rank] * rank, dst=world - 1)
    out["gather_safe"] = C.gather_objects({"r": rank, "t": torch.full((rank,), 1.0)}, safe=True)
    out["bcast_safe"] = C.broadcast_object(("plain", [rank]), src=world - 1, safe=True)
    out["seed_given"] = C.broadcast_seed(1000 + rank)  # only rank 0's counts
    out["seed_fresh"] = C.broadcast_seed(None)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_match_one_process(world: int) -> None:
    results = run_ranks(_all_cases, world_size=world, timeout=90)
    bases = [torch.tensor([1.0 + r, -2.0 * r, 3.0]) for r in range(world)]
    stacked = torch.stack(bases)
    expect = {"sum": stacked.sum(0), "mean": stacked.mean(0), "max": stacked.max(0).values,
              "min": stacked.min(0).values, "prod": stacked.prod(0)}
    for res in results:
        for op, value in expect.items():
            torch.testing.assert_close(res[f"reduce_{op}"], value)
        big = res["reduce_big"]
        assert big.tolist() == [sum(BIG + r for r in range(world)), -BIG * world]
        assert res["reduce_bool_any"].tolist() == [True, False]
        assert res["reduce_bool_all"].tolist() == [False, True]
        assert torch.equal(res["reduce_noncontig"], torch.arange(6.0).reshape(2, 3).t() * sum(range(1, world + 1)))

        rows, counts = res["gather_f32"]
        assert counts == [max(0, 5 - 2 * r) for r in range(world)]
        assert torch.equal(rows, torch.cat([_rows(r) for r in range(world)]))
        rows, counts = res["gather_big"]
        assert rows.dtype == torch.int64 and rows.tolist() == [BIG + r for r in range(world) for _ in range(r + 1)]
        rows, counts = res["gather_bool"]
        assert rows.dtype == torch.bool
        assert rows.tolist() == [v for r in range(world) for v in [True, False, r % 2 == 0][: r + 1]]
        rows, counts = res["gather_empty_here"]
        assert counts[0] == 0 and torch.equal(rows, torch.cat([_rows(r)[: 0 if r == 0 else 2] for r in range(world)]))
        rows, counts = res["gather_all_empty"]
        assert rows.shape == (0, 4) and counts == [0] * world
        rows, counts = res["gather_3d"]
        assert rows.shape == (sum(range(world)), 2, 2) and counts == list(range(world))

        parts, counts = res["gather_dict"]
        assert counts == [4 - r for r in range(world)] and list(parts) == ["x", "idx", "flag"]
        assert torch.equal(parts["x"], torch.cat([torch.full((4 - r, 3), float(r)) for r in range(world)]))
        assert parts["idx"].tolist() == [i + BIG for r in range(world) for i in range(4 - r)]
        assert parts["flag"].shape == (sum(counts), 2) and bool(parts["flag"].all())

        assert res["bcast"] == {"rank": 1, "s": "x" * 10}
        assert res["gather_all"] == [("r", r, "y" * r) for r in range(world)]
        assert res["seed_given"] == 1000
        assert [g["r"] for g in res["gather_safe"]] == list(range(world))
        assert [g["t"].numel() for g in res["gather_safe"]] == list(range(world))
        assert res["bcast_safe"] == ("plain", [world - 1])
    assert results[-1]["gather_dst"] == [[r] * r for r in range(world)]
    assert all(res["gather_dst"] is None for res in results[:-1])
    assert len({res["seed_fresh"] for res in results}) == 1


# ---------------------------------------------------------------- mismatches raise on every rank


_MISMATCHES = {
    "trailing": "RankMismatchError: all_gather_uneven: trailing shape differs across ranks: "
                "rank 0 (32, 10) float32 on cpu, rank 1 (32,) float32 on cpu",
    "dtype": "RankMismatchError: all_gather_uneven: dtype differs across ranks: rank 0 float32, rank 1 int64",
    "swapped": "rank 0 (2, 3) float32 on cpu, rank 1 (3, 2) float32 on cpu",
    "reduce_shape": "RankMismatchError: all_reduce: tensor differs across ranks: rank 0 (3,) float32 on cpu, "
                    "rank 1 (4,) float32 on cpu",
    "reduce_op": "all_reduce: op differs across ranks: rank 0 sum, rank 1 max",
    "other_call": "ranks entered different collectives: rank 0 all_reduce, rank 1 all_gather_uneven",
    "other_call_layout": "ranks entered different collectives: rank 0 check_same_layout, rank 1 all_reduce",
    "src": "broadcast_object: src differs across ranks: rank 0 0, rank 1 1",
    "dst": "gather_objects: dst differs across ranks: rank 0 0, rank 1 None",
    "gather_dst": "gather_uneven: dst differs across ranks: rank 0 0, rank 1 1",
    "dict_keys": "RankMismatchError: all_gather_uneven_dict: keys differ across ranks: rank 0 ['a', 'b'], rank 1 ['a']",
    "dict_dtype": "all_gather_uneven_dict: dtype for key 'b' differs across ranks: rank 0 int32, rank 1 int64",
    "dict_rows": "ValueError: all_gather_uneven_dict: bad argument on rank 1 of 2 (every rank raises this error): "
                 "rank 1: tensors of one rank must have the same number of rows; got {'a': 2, 'b': 3}",
    "seed_range": "ValueError: broadcast_seed: bad argument on rank 0 of 2 (every rank raises this error): "
                  "rank 0: seed must be in [0, 4294967295]; got -5.",
}


def _mismatch(rank: int, world: int, case: str) -> None:
    if case == "trailing":
        C.all_gather_uneven(torch.zeros(32, 10) if rank == 0 else torch.zeros(32))
    elif case == "dtype":
        C.all_gather_uneven(torch.zeros(3, dtype=torch.float32 if rank == 0 else torch.int64))
    elif case == "swapped":  # (2,3) vs (3,2): same numel, silent garbage in plain gloo
        C.all_gather_uneven(torch.zeros(2, 3) if rank == 0 else torch.zeros(3, 2))
    elif case == "reduce_shape":
        C.all_reduce(torch.zeros(3 + rank))
    elif case == "reduce_op":
        C.all_reduce(torch.zeros(3), op="sum" if rank == 0 else "max")
    elif case == "other_call":
        if rank == 0:
            C.all_reduce(torch.zeros(3))
        else:
            C.all_gather_uneven(torch.zeros(3))
    elif case == "other_call_layout":  # the public check opens with the same exchange as the others
        if rank == 0:
            C.check_same_layout(torch.zeros(3))
        else:
            C.all_reduce(torch.zeros(3))
    elif case == "src":
        C.broadcast_object("x", src=rank)
    elif case == "dst":
        C.gather_objects("x", dst=0 if rank == 0 else None)
    elif case == "gather_dst":
        C.gather_uneven(torch.zeros(2), dst=rank)
    elif case == "dict_keys":
        C.all_gather_uneven_dict({"a": torch.zeros(2), "b": torch.zeros(2)} if rank == 0 else {"a": torch.zeros(1)})
    elif case == "dict_dtype":
        C.all_gather_uneven_dict({"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.int64 if rank else torch.int32)})
    elif case == "dict_rows":
        C.all_gather_uneven_dict({"a": torch.zeros(2), "b": torch.zeros(3 if rank else 2)})
    elif case == "seed_range":
        C.broadcast_seed(-5 if rank == 0 else 3)


def _unpicklable() -> object:
    import threading

    return threading.Lock()


class _Custom:
    """Picklable, but not plain data: refused with safe=True."""


def _bad_argument(rank: int, world: int, case: str, bad: int) -> None:
    """One rank (``bad``) passes a bad argument; the others pass good ones."""
    me = rank == bad
    if case == "gather_unpicklable":
        C.gather_objects(_unpicklable() if me else "fine")
    elif case == "gather_unsafe":
        C.gather_objects(_Custom() if me else {"plain": [1, 2.0, "x", torch.ones(2)]}, safe=True)
    elif case == "broadcast_unpicklable":  # on src
        C.broadcast_object(_unpicklable() if me else None, src=bad)
    elif case == "seed_float_src":
        C.broadcast_seed(1.5 if me else 7, src=bad)  # type: ignore[arg-type]
    elif case == "seed_float_other":
        C.broadcast_seed(2.5 if me else 7, src=(bad + 1) % world)  # type: ignore[arg-type]
    elif case == "reduce_op":
        C.all_reduce(torch.ones(2), op="bogus" if me else "sum")  # type: ignore[arg-type]
    elif case == "reduce_float":
        C.all_reduce(2.5 if me else torch.ones(1))  # type: ignore[arg-type]
    elif case == "reduce_bool_sum":
        C.all_reduce(torch.ones(1, dtype=torch.bool) if me else torch.ones(1))
    elif case == "gather_0d":
        C.gather_uneven(torch.tensor(3.0) if me else torch.ones(2))
    elif case == "all_gather_0d":
        C.all_gather_uneven(torch.tensor(3.0) if me else torch.ones(2))
    elif case == "gather_not_tensor":
        C.all_gather_uneven([1.0, 2.0] if me else torch.ones(2))  # type: ignore[arg-type]
    elif case == "dst_not_int":
        C.gather_objects("x", dst="0" if me else 0)  # type: ignore[arg-type]


_BAD_ARGUMENTS = {  # case: (exception, the words every rank's message must hold besides "rank <bad>")
    "gather_unpicklable": ("TypeError", "gather_objects: bad argument on rank {bad} of {world} (every rank raises "
                                        "this error): rank {bad}: cannot pickle lock <unlocked _thread.lock object"),
    "gather_unsafe": ("TypeError", "gather_objects: bad argument on rank {bad} of {world} (every rank raises this "
                                   "error): rank {bad}: safe=True accepts plain data only"),
    "broadcast_unpicklable": ("TypeError", "broadcast_object: bad argument on rank {bad} of {world} (every rank "
                                           "raises this error): rank {bad}: cannot pickle lock"),
    "seed_float_src": ("TypeError", "broadcast_seed: bad argument on rank {bad} of {world} (every rank raises this "
                                    "error): rank {bad}: seed must be an int or None; got float 1.5."),
    "seed_float_other": ("TypeError", "rank {bad}: seed must be an int or None; got float 2.5."),
    "reduce_op": ("ValueError", "all_reduce: bad argument on rank {bad} of {world} (every rank raises this error): "
                                "rank {bad}: op must be one of sum, mean, max, min, prod; got 'bogus'."),
    "reduce_float": ("TypeError", "rank {bad}: tensor must be a torch.Tensor; got float 2.5."),
    "reduce_bool_sum": ("TypeError", "rank {bad}: op='sum' is not defined for bool tensors"),
    "gather_0d": ("ValueError", "gather_uneven: bad argument on rank {bad} of {world} (every rank raises this "
                                "error): rank {bad}: needs a tensor with a row dimension; got a 0-d tensor (3.0)."),
    "all_gather_0d": ("ValueError", "all_gather_uneven: bad argument on rank {bad}"),
    "gather_not_tensor": ("TypeError", "rank {bad}: needs a torch.Tensor with a row dimension; got list [1.0, 2.0]."),
    "dst_not_int": ("TypeError", "rank {bad}: dst must be an int or None (a global rank); got str '0'."),
}


def _run_cases(rank: int, world: int, bad: int) -> dict[str, tuple[str, float]]:
    """Every case in turn on one group (each raises on every rank after the same collectives, so the
    group stays usable); returns each case's error and how long it took."""
    import time

    out: dict[str, tuple[str, float]] = {}
    cases: list[tuple[str, object]] = [(c, lambda c=c: _bad_argument(rank, world, c, bad)) for c in _BAD_ARGUMENTS]
    if world == 2:
        cases += [(f"mismatch_{c}", lambda c=c: _mismatch(rank, world, c)) for c in _MISMATCHES]
    for name, call in cases:
        start = time.monotonic()
        try:
            call()  # type: ignore[operator]
            msg = "no error"
        except (ls.LightningSyncError, TypeError, ValueError) as err:
            msg = f"{type(err).__name__}: {err}"
        out[name] = (msg, time.monotonic() - start)
    # the group still works, and a non-src rank's unpicklable object is ignored as documented
    out["after"] = (str(C.all_reduce(torch.ones(1))[0].item()), 0.0)
    out["ignored"] = (str(C.broadcast_object(_unpicklable() if rank else "from 0", src=0)), 0.0)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "bad"), [(2, 1), (3, 2)])
def test_bad_argument_on_one_rank_raises_on_every_rank(world: int, bad: int) -> None:
    results = run_ranks(_run_cases, world_size=world, args=(bad,), timeout=100, pg_timeout=60)
    for rank, res in enumerate(results):
        for case, (kind, words) in _BAD_ARGUMENTS.items():
            msg, took = res[case]
            assert msg.startswith(f"{kind}: "), (rank, case, msg)
            assert words.format(bad=bad, world=world) in msg, (rank, case, msg)
            assert took < 10, (rank, case, took)
        for case, words in (_MISMATCHES.items() if world == 2 else ()):
            msg, took = res[f"mismatch_{case}"]
            assert words in msg, (rank, case, msg)
            assert took < 10, (rank, case, took)
        assert res["after"][0] == f"{float(world)}"
        assert res["ignored"][0] == "from 0"


def test_safe_unpickler_refuses_code() -> None:
    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            import os

            return (os.system, ("echo pwned",))

    import pickle

    evil = torch.frombuffer(bytearray(pickle.dumps(Evil())), dtype=torch.uint8)
    with pytest.raises(pickle.UnpicklingError):
        P.from_bytes(evil, safe=True)
    plain = {"a": [1, 2.5, "x", (None, True)], "t": torch.arange(3), "dtype": torch.bfloat16, "s": {1, 2},
             "empty": torch.zeros(0, 4), "bf": torch.randn(2, 3).to(torch.bfloat16), "scalar": torch.tensor(2.5),
             "w": torch.ones(2, requires_grad=True), "view": torch.arange(10)[::3]}
    back = P.from_bytes(P.to_bytes(plain), safe=True)
    assert back["a"] == plain["a"] and back["dtype"] is torch.bfloat16 and back["s"] == {1, 2}
    for key in ("t", "empty", "bf", "scalar", "w", "view"):
        assert back[key].dtype == plain[key].dtype and torch.equal(back[key], plain[key].detach()), key
    assert back["w"].requires_grad and not back["t"].requires_grad
    assert pickle.loads(pickle.dumps(plain["t"])) is not None  # (control: a plain pickle of a tensor works too)


def test_object_payloads_never_call_torch_save(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks that write no file call no torch.save (Lightning's own tests count its calls)."""
    calls: list[object] = []
    monkeypatch.setattr(torch, "save", lambda *a, **k: calls.append(a))
    state = {"torch": torch.get_rng_state(), "keys": torch.arange(624, dtype=torch.int64), "n": 3}
    for safe in (False, True):
        back = P.from_bytes(P.to_bytes(state), safe=safe)
        assert torch.equal(back["torch"], state["torch"]) and torch.equal(back["keys"], state["keys"])
    assert calls == []


def _mixed_group(rank: int, world: int, init_file: str) -> dict:
    """A group with one backend per device type, as `init_process_group("cpu:gloo,cuda:nccl")` makes; this machine
    has no CUDA, so the CUDA slot holds a backend registered under another name (a gloo one underneath)."""
    import datetime

    import torch.distributed as dist

    from lightning_sync.guard.intercept import runs_on_gloo
    from lightning_sync.parts.mixin import _all_reduce

    dist.Backend.register_backend("lsync_cuda_slot", lambda store, r, size, timeout: dist.ProcessGroupGloo(
        store, r, size, timeout), devices=["cuda"])
    dist.init_process_group("cpu:gloo,cuda:lsync_cuda_slot", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        mean = _all_reduce(torch.tensor([float(rank + 1)]), None, "mean")  # gloo has no AVG: a sum, then / world
        plain = dist.new_group(backend="gloo")
        # gloo connects a new group's pairs in the background of `new_group`: a rank that returns and tears down
        # first closes the socket its peer is still handshaking on ("connectFullMesh failed ... closed by peer").
        dist.barrier(group=plain)
        return {"spec": dist.get_backend(), "cpu": C.backend_for(None, "cpu"), "cuda": C.backend_for(None, "cuda"),
                "cuda0": C.backend_for(None, torch.device("cuda", 0)), "other": C.backend_for(None, "meta"),
                "plain": C.backend_for(plain, "cuda"),
                "cpu_call_on_gloo": runs_on_gloo("all_reduce", (torch.ones(1),), {}), "mean": mean.item()}
    finally:
        dist.destroy_process_group()


def test_backend_for_resolves_a_mixed_group_per_device(tmp_path) -> None:
    """Issue 40, point 3: one resolver answers "gloo or NCCL?" for a group and a tensor's device; a mixed group
    sends CPU tensors to its CPU backend (here Lightning's sync_dist mean on CPU took AVG, which gloo refuses,
    where the group's name was compared with "gloo" as a whole)."""
    results = run_ranks(_mixed_group, world_size=2, args=(str(tmp_path / "rendezvous"),), timeout=60, init=False)
    for r in results:
        assert r == {"spec": "cpu:gloo,cuda:lsync_cuda_slot", "cpu": "gloo", "cuda": "lsync_cuda_slot",
                     "cuda0": "lsync_cuda_slot", "other": "gloo", "plain": "gloo", "cpu_call_on_gloo": True,
                     "mean": 1.5}


def test_a_backend_string_is_resolved_per_device_before_any_group_exists() -> None:
    """The guard turns NCCL's flight recorder on before the process group exists, from the strategy's backend
    string: a mixed "cpu:gloo,cuda:nccl" group carries its CUDA tensors on NCCL, so it needs the recorder too
    (comparing the whole string with "nccl" left it off)."""
    resolve = C._backend_in_spec
    assert resolve("nccl", "cuda") == "nccl" and resolve("GLOO", "cpu") == "gloo"
    assert resolve("cpu:gloo,cuda:nccl", "cuda") == "nccl" and resolve("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert resolve("cpu:gloo,cuda:nccl", torch.device("cuda", 1)) == "nccl"
    assert resolve("cpu:gloo", "cuda") == "gloo"  # no backend for the device's type: the first one
