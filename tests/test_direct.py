"""lightning_sync.direct: the ranks' direct channel, on real gloo groups of 2 and 3 processes."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks


def _gather_everything(rank: int, world: int) -> dict[str, Any]:
    from lightning_sync import direct

    ch = direct.channel()
    assert ch is not None and direct.channel() is ch  # set up once per group
    out: dict[str, Any] = {"rank": ch.rank, "world": ch.world}
    for dtype in (torch.float64, torch.float32, torch.int64, torch.bool, torch.bfloat16):
        block = (torch.arange(6).reshape(2, 3) * (rank + 1)).to(dtype)
        out[str(dtype)] = ch.all_gather(block, f"test {dtype}")
    out["empty"] = ch.all_gather(torch.empty(0, 4), "empty")
    big = torch.full((200_000,), float(rank), dtype=torch.float64)  # 1.6 MB: past the socket buffers
    gathered = ch.all_gather(big[: direct.MAX_BYTES // 8], "large")
    out["large"] = [float(row.min()) == float(row.max()) == r for r, row in enumerate(gathered)]
    # a subgroup gets a channel of its own, with ranks numbered inside it; outsiders get none
    sub = dist.new_group([0, world - 1])
    sub_ch = direct.channel(sub) if rank in (0, world - 1) else "outside"
    if sub_ch != "outside":
        assert sub_ch is not None and sub_ch is not ch
        out["sub"] = sub_ch.all_gather(torch.tensor([rank]), "sub").tolist()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_returns_every_ranks_block_in_rank_order(world: int) -> None:
    results = run_ranks(_gather_everything, world_size=world, timeout=60)
    for rank, res in enumerate(results):
        assert (res["rank"], res["world"]) == (rank, world)
        for dtype in (torch.float64, torch.float32, torch.int64, torch.bool, torch.bfloat16):
            want = torch.stack([(torch.arange(6).reshape(2, 3) * (r + 1)).to(dtype) for r in range(world)])
            got = res[str(dtype)]
            assert got.dtype == dtype and torch.equal(got, want), (rank, dtype, got)
        assert res["empty"].shape == (world, 0, 4)
        assert res["large"] == [True] * world
        if rank in (0, world - 1):
            assert res["sub"] == [[0], [world - 1]]


def _different_exchanges(rank: int, world: int) -> list[str]:
    from lightning_sync import direct

    ch = direct.channel()
    assert ch is not None
    messages = []
    started = time.monotonic()
    try:  # the last rank is at another exchange, with a block of another size
        if rank == world - 1:
            ch.all_gather(torch.zeros(3), "SyncBatchNorm(3) gradient sums")
        else:
            ch.all_gather(torch.zeros(7, dtype=torch.float64), "SyncBatchNorm(3) statistics")
    except Exception as err:  # noqa: BLE001 - the test asserts on it
        messages.append(f"{type(err).__name__}: {err}")
    try:  # the channel stays broken: the next exchange refuses at once instead of pairing stale bytes
        ch.all_gather(torch.zeros(1), "after")
    except Exception as err:  # noqa: BLE001
        messages.append(f"{type(err).__name__}: {err}")
    messages.append(f"{time.monotonic() - started:.1f}")
    return messages


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_at_different_exchanges_raise_the_same_error_on_every_rank(world: int) -> None:
    last = world - 1
    for rank, (first, second, took) in enumerate(run_ranks(_different_exchanges, world_size=world, timeout=60)):
        assert first.startswith("CollectiveMismatchError: direct channel: the ranks reached different exchanges: "), first
        assert f"rank {last} SyncBatchNorm(3) gradient sums (12 bytes)" in first, (rank, first)
        assert "rank 0 SyncBatchNorm(3) statistics (56 bytes)" in first, (rank, first)
        assert second.startswith("LightningSyncError: ") and "unusable" in second, (rank, second)
        assert float(took) < 10, (rank, took)


def _peer_dies(rank: int, world: int) -> str:
    from lightning_sync import direct

    ch = direct.channel()
    assert ch is not None
    ch.all_gather(torch.zeros(2), "warm-up")
    if rank == 1:
        # A forked child (as a data-loader worker is) keeps no copy of the connection open, so the peers
        # see this rank's end close the moment the rank dies, not when the child does.
        child = os.fork()
        if child == 0:
            time.sleep(30)
            os._exit(0)
        os._exit(3)
    started = time.monotonic()
    try:
        ch.all_gather(torch.zeros(2), "after the death")
        return "no error"
    except Exception as err:  # noqa: BLE001 - the test asserts on it
        return f"{time.monotonic() - started:.1f} {type(err).__name__}: {err}"


def test_a_peer_that_dies_is_named_at_once() -> None:
    outcomes = run_ranks(_peer_dies, world_size=2, timeout=60, expect_failure=True)
    ok, message = outcomes[0]
    assert ok, message
    took, text = message.split(" ", 1)
    assert text.startswith("LightningSyncError: rank 1 closed its direct connection to rank 0"), text
    assert float(took) < 5, message
    assert not outcomes[1][0]  # rank 1 exited with code 3


def _switched_off_on_one_rank(rank: int, world: int) -> list[bool]:
    from lightning_sync import direct

    if rank == world - 1:
        os.environ[direct.ENV] = "0"
    try:
        return [direct.channel() is None, direct.channel() is None]  # decided once per group
    finally:
        os.environ.pop(direct.ENV, None)


def test_turned_off_on_one_rank_is_off_for_the_whole_group() -> None:
    assert run_ranks(_switched_off_on_one_rank, world_size=3, timeout=60) == [[True, True]] * 3


def _one_rank_skips_an_exchange(rank: int, world: int, then: str) -> str:
    from lightning_sync import CollectiveGuard, direct

    guard = CollectiveGuard(timeout=3)
    guard.install()
    started = time.monotonic()
    try:
        ch = direct.channel()
        assert ch is not None
        if rank == 0:  # rank 1 skipped this (a layer in eval mode on one rank, say) and went on
            ch.all_gather(torch.zeros(3), "SyncBatchNorm(1) statistics")
        if then == "barrier":
            dist.barrier()
        else:  # a same-shape collective: the guard compares the ranks' shapes first, over the channel
            dist.all_reduce(torch.zeros(1))
        return "no error"
    except Exception as err:  # noqa: BLE001 - the test asserts on it
        return f"{time.monotonic() - started:.1f} {type(err).__name__}: {err}"
    finally:
        guard.uninstall(failed=True)


@pytest.mark.parametrize("then", ["barrier", "all_reduce"])
def test_a_rank_that_skips_an_exchange_is_named_not_waited_for(then: str) -> None:
    # Without the guard both ranks would wait for each other: rank 0 in the channel, rank 1 in gloo.
    results = run_ranks(_one_rank_skips_an_exchange, world_size=2, args=(then,), timeout=90, pg_timeout=60)
    for rank, message in enumerate(results):
        took, text = message.split(" ", 1)
        if then == "barrier":  # rank 1 waits in gloo: the guard's timeout (3 s) names rank 0
            assert "CollectiveMismatchError: rank(s) 0 did not reach guarded collective #0" in text, (rank, message)
            assert float(took) < 30, (rank, message)
        else:  # rank 1's shape check meets rank 0's exchange on the channel: both know at once
            assert "MismatchError: direct channel: the ranks reached different exchanges: " in text, (rank, message)
            assert "rank 0 SyncBatchNorm(1) statistics (12 bytes)" in text, (rank, message)
            assert float(took) < 5, (rank, message)


# ---------------------------------------------------------------- the guard with and without the channel


def _guard_uses_the_channel(rank: int, world: int) -> dict[str, Any]:
    from lightning_sync import CollectiveGuard, direct

    with CollectiveGuard(timeout=10) as guard:
        ch = guard._channel
        flags = torch.tensor([rank + 1, 7 * rank])
        guard.own_broadcast("step flags broadcast", "int64[2] src=0", flags)
        dist.all_reduce(torch.ones(2))  # its shape comparison goes over the channel
    return {"channel": ch is not None and ch is direct.existing(), "flags": flags.tolist(), "broken": ch.broken}


def test_the_guards_exchanges_use_the_channel_set_up_at_install() -> None:
    for r in run_ranks(_guard_uses_the_channel, 3, timeout=60):
        assert r == {"channel": True, "flags": [1, 0], "broken": False}


def _channel_off(rank: int, world: int, name: str, *args: Any) -> Any:
    from lightning_sync import direct
    from tests import test_guard

    os.environ[direct.ENV] = "0"
    return getattr(test_guard, name)(rank, world, *args)


def test_the_guard_without_the_channel_checks_as_before() -> None:
    """Ranks on several hosts (or LIGHTNING_SYNC_DIRECT=0): shapes through a gloo all-reduce, the closing line
    through the store, confirmations and the step flags on the guard's own gloo groups."""
    from tests.test_guard import _errors

    for text in _errors(run_ranks(_channel_off, 2, args=("_mismatched_shapes", "all_reduce"), timeout=60,
                                  expect_failure=True)):
        assert text.startswith("CollectiveMismatchError") and "rank 0 (3, 2) float32 on cpu, rank 1 (4, 2)" in text
    for text in _errors(run_ranks(_channel_off, 2, args=("_subgroup_other_line_last",), timeout=60,
                                  expect_failure=True)):
        assert "CollectiveMismatchError" in text and "call sites differ" in text, text
    for r in run_ranks(_channel_off, 2, args=("_one_exchange",), timeout=90):
        assert r["differ"] == [] and r["flags"] == [1, 0], r
    r0, r1 = run_ranks(_channel_off, 2, args=("_correct_program",), timeout=60)
    assert r0["agreed"] and r1["agreed"] and r0["checks"] == r1["checks"] == 24


def _exchange_cut_short_then_a_new_guard(rank: int, world: int) -> dict[str, Any]:
    from lightning_sync import CollectiveGuard, LightningSyncError, direct

    sub, spare = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    guard = CollectiveGuard(timeout=2)
    guard.install()
    old = direct.channel(sub)
    assert old is not None
    try:
        if rank == 1:  # its block reaches rank 0, which never reads it: rank 0 waits elsewhere instead
            old.all_gather(torch.tensor([111]), "SyncBatchNorm(1) statistics")
        else:  # on a group of its own: a gloo collective given up stays pending in its group for good
            dist.barrier(group=spare)
        raised = "nothing"
    except LightningSyncError as err:
        raised = type(err).__name__
    finally:
        guard.uninstall(failed=True)
    guard = CollectiveGuard(timeout=10)
    guard.install()  # agrees that a run failed: every channel, the subgroup's too, is made anew
    try:
        new = direct.channel(sub)
        assert new is not None
        got = new.all_gather(torch.tensor([rank]), "SyncBatchNorm(1) statistics").tolist()
    finally:
        guard.uninstall()
    return {"raised": raised, "old_closed": old.broken, "fresh": new is not old, "got": got}


def test_a_channel_left_mid_exchange_is_made_anew_by_the_next_guard() -> None:
    # rank 0 holds rank 1's unread block from the failed run: reused, the next exchange would read it
    for r in run_ranks(_exchange_cut_short_then_a_new_guard, 2, timeout=90, pg_timeout=60):
        assert r == {"raised": "CollectiveMismatchError", "old_closed": True, "fresh": True, "got": [[0], [1]]}, r
