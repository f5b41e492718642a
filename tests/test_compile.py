"""``torch.compile`` of code that issues ``torch.distributed`` collectives, with the collective guard installed.

Issue 40: Dynamo maps only torch's own collective functions to in-graph collectives, and the guard replaces
them with wrappers. With the guard installed, Dynamo must still see the same graphs, graph breaks and results
as without it; eager collectives must still be recorded. On 2 real gloo ranks (``run_ranks``).

``torch._dynamo.explain`` counts graphs with its own backend (no Inductor); outputs come from
``torch.compile(backend="eager")``, which runs Dynamo's graphs as captured: the graphs are what the guard
could change, not the backend's code generation.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_sync.guard import CollectiveGuard
from lightning_sync.guard.group import WatchedGroup
from tests.distributed import run_ranks

# ------------------------------------------------------------------------------------ compiled functions


def _all_reduce_in_the_middle(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    dist.all_reduce(y)  # in-graph (a functional collective): one graph, no break
    return y + 1


def _all_gather_into_tensor(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.numel() * dist.get_world_size())
    dist.all_gather_into_tensor(out, x * 2)  # deprecated name in torch 2.13, still in-graph
    return out * 3


def _all_gather_single(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.numel() * dist.get_world_size())
    dist.all_gather_single(out, x * 2)  # torch 2.13's name for it
    return out - 1


def _broadcast(x: torch.Tensor) -> torch.Tensor:
    y = x * 3
    dist.broadcast(y, src=0)  # not mapped to an in-graph collective: a graph break, with or without the guard
    return y - 1


def _barrier_between(x: torch.Tensor) -> torch.Tensor:
    y = x + 1
    dist.barrier()  # no tensor argument: Dynamo skips the (wrapper's) frame and runs it eagerly, under compile
    return y * 2


def _several(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    dist.broadcast(y, src=0)
    y = y + 1
    dist.reduce(y, dst=0)
    dist.barrier()
    parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, y)
    y = y + parts[-1]
    half = torch.empty(y.numel() // dist.get_world_size())
    dist.reduce_scatter_tensor(half, y)
    dist.all_reduce(y)
    return y + half.sum()


CASES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "all_reduce": _all_reduce_in_the_middle,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "all_gather_single": _all_gather_single,
    "broadcast": _broadcast,
    "barrier": _barrier_between,
    "several": _several,
}
IN_GRAPH = ("all_reduce", "all_gather_into_tensor", "all_gather_single")  # compile with fullgraph=True too

# ------------------------------------------------------------------------------------------- rank bodies


def _input(rank: int) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32) + 10 * rank


def _explain_and_run(fn: Callable[[torch.Tensor], torch.Tensor], rank: int) -> dict[str, Any]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(_input(rank))
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager")(_input(rank))
    torch._dynamo.reset()
    return {"graphs": explained.graph_count, "breaks": explained.graph_break_count, "out": compiled}


def _compare(rank: int, world: int, case: str) -> dict[str, Any]:
    """The case explained and compiled without the guard, then with it installed."""
    fn = CASES[case]
    eager = fn(_input(rank))
    plain = _explain_and_run(fn, rank)
    with CollectiveGuard(timeout=30) as guard:
        patched = isinstance(dist.group.WORLD, WatchedGroup)  # the guard watches the default group
        guarded = _explain_and_run(fn, rank)
        checks = guard.checks
    return {"eager": eager, "plain": plain, "guarded": guarded, "patched": patched, "checks": checks}


def _fullgraph(rank: int, world: int) -> dict[str, Any]:
    """In-graph collectives under the guard compile with ``fullgraph=True`` (no graph break at all)."""
    expected = {case: CASES[case](_input(rank)) for case in IN_GRAPH}
    out = {}
    with CollectiveGuard(timeout=30) as guard:
        for case in IN_GRAPH:
            torch._dynamo.reset()
            out[case] = torch.compile(CASES[case], backend="eager", fullgraph=True)(_input(rank))
        checks = guard.checks
    torch._dynamo.reset()
    return {"expected": expected, "out": out, "checks": checks}


def _all_reduce_eagerly(y: torch.Tensor) -> None:
    dist.all_reduce(y)


# a torch.compiler.disable region inside compiled code is eager code
_eager_helper: Callable[[torch.Tensor], None] = torch.compiler.disable(  # type: ignore[no-untyped-call]
    _all_reduce_eagerly)


def _compiled_calls_eager_helper(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    _eager_helper(y)
    return y + 1


def _eager_still_recorded(rank: int, world: int) -> dict[str, Any]:
    with CollectiveGuard(timeout=30) as guard:
        before = guard.checks
        dist.all_reduce(torch.ones(2))
        after_eager = guard.checks
        first_history = list(guard.history)
        compiled = torch.compile(_all_reduce_in_the_middle, backend="eager")
        compiled(_input(rank))
        compiled(_input(rank))  # the second call runs the cached graph
        after_compiled = guard.checks
        dist.broadcast(torch.ones(3), src=0)  # eager again after compiled code ran
        after_second_eager = guard.checks
        torch._dynamo.reset()
        out = torch.compile(_compiled_calls_eager_helper, backend="eager")(_input(rank))
        after_disabled = guard.checks
        history = list(guard.history)
    torch._dynamo.reset()
    return {"counts": [before, after_eager, after_compiled, after_second_eager, after_disabled],
            "first_history": first_history, "history": history, "out": out}


# ------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_collectives_match_unguarded(case: str) -> None:
    if case == "all_gather_single" and not hasattr(dist, "all_gather_single"):
        pytest.skip("torch.distributed.all_gather_single is new in torch 2.13")
    for rank, r in enumerate(run_ranks(_compare, 2, args=(case,), timeout=120)):
        assert r["patched"], "the guard was not installed"
        plain, guarded = r["plain"], r["guarded"]
        assert (guarded["graphs"], guarded["breaks"]) == (plain["graphs"], plain["breaks"]), (rank, plain, guarded)
        assert torch.equal(guarded["out"], plain["out"]), (rank, plain["out"], guarded["out"])
        assert torch.equal(plain["out"], r["eager"]), (rank, plain["out"], r["eager"])
    if case in IN_GRAPH:  # what the issue measured: the wrappers had cost graph breaks
        assert (plain["graphs"], plain["breaks"]) == (1, 0)


def test_in_graph_collectives_compile_with_fullgraph_under_the_guard() -> None:
    for r in run_ranks(_fullgraph, 2, timeout=120):
        for case in IN_GRAPH:
            assert torch.equal(r["out"][case], r["expected"][case]), (case, r["out"][case], r["expected"][case])
        assert r["checks"] == len(IN_GRAPH), r["checks"]  # recorded at run time as torch's own (one each)


def test_eager_collectives_are_still_recorded() -> None:
    for rank, r in enumerate(run_ranks(_eager_still_recorded, 2, timeout=120)):
        before, after_eager, after_compiled, after_second_eager, after_disabled = r["counts"]
        assert after_eager == before + 1, r["counts"]
        assert any("all_reduce" in line for line in r["first_history"]), r["first_history"]
        # compiled code's collectives are recorded where the group sees them run, as torch's own calls (no
        # frame of the user's issues them): one per call of the compiled function
        assert after_compiled == after_eager + 2, r["counts"]
        assert after_second_eager == after_compiled + 1, r["counts"]
        assert after_disabled == after_second_eager + 1, r["counts"]  # eager code inside compiled code
        assert "broadcast" in r["history"][-2] and "all_reduce" in r["history"][-1], r["history"]
        x0, x1 = _input(0), _input(1)
        assert torch.equal(r["out"], (x0 * 2 + x1 * 2) + 1), (rank, r["out"])


FIT_SCRIPT = Path(__file__).parent / "scripts" / "compile_in_fit.py"


@pytest.mark.slow
def test_compile_inside_a_ddp_sync_fit_sees_what_it_sees_under_ddp(tmp_path: Path) -> None:
    """Issue 40, point 1, as a user meets it: inside a fit's training step under ``strategy="ddp_sync"`` (the
    default group watched), ``torch._dynamo.explain`` of functions issuing collectives gives the graph and
    graph-break counts it gives under ``strategy="ddp"``, and the compiled functions the same values."""
    reports = {}
    for strategy in ("ddp", "ddp_sync"):
        out = tmp_path / strategy
        out.mkdir()
        proc = subprocess.run(["timeout", "-k", "5", "240", sys.executable, str(FIT_SCRIPT), str(out), strategy],
                              capture_output=True, text=True, timeout=260)
        assert proc.returncode == 0, f"{strategy}: exit {proc.returncode}\n{proc.stderr[-5000:]}"
        reports[strategy] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for plain, synced in zip(reports["ddp"], reports["ddp_sync"]):
        assert synced.pop("watched") == "WatchedGroup" and plain.pop("watched") != "WatchedGroup", (plain, synced)
        assert synced == plain, (plain, synced)
        assert (plain["all_reduce"]["graphs"], plain["all_reduce"]["breaks"]) == (1, 0)  # the function
