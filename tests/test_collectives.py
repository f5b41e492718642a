"""lightning_sync.collectives on real gloo groups of 2 and 3 ranks, against one-process results."""

from __future__ import annotations

import pytest
import torch

import lightning_sync as ls
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
    assert results[-1]["gather_dst"] == [[r] * r for r in range(world)]
    assert all(res["gather_dst"] is None for res in results[:-1])
    assert len({res["seed_fresh"] for res in results}) == 1


# ---------------------------------------------------------------- mismatches raise on every rank


def _mismatch(rank: int, world: int, case: str) -> str:
    try:
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
        elif case == "src":
            C.broadcast_object("x", src=rank)
        elif case == "dst":
            C.gather_objects("x", dst=0 if rank == 0 else None)
        elif case == "dict_keys":
            C.all_gather_uneven_dict({"a": torch.zeros(2), "b": torch.zeros(2)} if rank == 0 else {"a": torch.zeros(1)})
        elif case == "dict_dtype":
            C.all_gather_uneven_dict({"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.int64 if rank else torch.int32)})
        elif case == "dict_rows":
            C.all_gather_uneven_dict({"a": torch.zeros(2), "b": torch.zeros(3 if rank else 2)})
        elif case == "seed_range":
            C.broadcast_seed(-5 if rank == 0 else 3)
    except ls.LightningSyncError as err:
        return f"{type(err).__name__}: {err}"
    except ValueError as err:
        return f"ValueError: {err}"
    return "no error"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("trailing", "RankMismatchError: all_gather_uneven: trailing shape differs across ranks: "
                     "rank 0 (32, 10) float32 on cpu, rank 1 (32,) float32 on cpu"),
        ("dtype", "RankMismatchError: all_gather_uneven: dtype differs across ranks: rank 0 float32, rank 1 int64"),
        ("swapped", "rank 0 (2, 3) float32 on cpu, rank 1 (3, 2) float32 on cpu"),
        ("reduce_shape", "RankMismatchError: all_reduce: tensor differs across ranks: rank 0 (3,) float32 on cpu, "
                         "rank 1 (4,) float32 on cpu"),
        ("reduce_op", "all_reduce: op differs across ranks: rank 0 sum, rank 1 max"),
        ("other_call", "ranks entered different collectives: "
                       "rank 0 all_reduce, rank 1 all_gather_uneven"),
        ("src", "broadcast_object: src differs across ranks: rank 0 0, rank 1 1"),
        ("dst", "gather_objects: dst differs across ranks: rank 0 0, rank 1 None"),
        ("dict_keys", "RankMismatchError: all_gather_uneven_dict: keys differ across ranks: rank 0 ['a', 'b'], "
                      "rank 1 ['a']"),
        ("dict_dtype", "all_gather_uneven_dict: dtype for key 'b' differs across ranks: rank 0 int32, rank 1 int64"),
        ("dict_rows", "ValueError: all_gather_uneven_dict: rank 1: tensors of one rank must have the same number of "
                      "rows; got {'a': 2, 'b': 3}"),
        ("seed_range", "ValueError: broadcast_seed: rank 0's seed is outside [0, 4294967295]"),
    ],
)
def test_mismatch_raises_on_every_rank(case: str, expected: str) -> None:
    messages = run_ranks(_mismatch, world_size=2, args=(case,), timeout=45, pg_timeout=20)
    for msg in messages:
        assert expected in msg, msg
