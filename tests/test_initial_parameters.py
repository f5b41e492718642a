"""The initial-parameter warning speaks only about differences the DDP wrap leaves in place.

Each scenario builds a model with a per-rank seed (as a model built in ``__init__`` before the process
group exists would be), runs ``warn_if_initial_parameters_differ`` on 2 real gloo ranks, then wraps
the model in DDP with the same arguments and compares every tensor across ranks, so the warning is
checked against what DDP really does.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_ranks


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.bn = nn.BatchNorm1d(2)
        self.bn.running_mean.uniform_()  # a buffer with random initial values


def _scenarios(rank: int, world: int) -> dict[str, tuple[list[str], list[str], list[str]]]:
    return {name: _scenario(rank, world, name) for name in SCENARIOS}  # one group for all: imports dominate


def _scenario(rank: int, world: int, name: str) -> tuple[list[str], list[str], list[str]]:
    from lightning_sync.callbacks.consistency import warn_if_initial_parameters_differ

    torch.manual_seed(0 if name == "same_seed" else 100 + rank)
    model = Net()
    kwargs: dict[str, Any] = {}
    if name == "broadcast_buffers_false":
        kwargs["broadcast_buffers"] = False
    if name == "ignored":
        model._ddp_params_and_buffers_to_ignore = ["lin.bias"]  # type: ignore[assignment]
    wrapped = name != "no_wrap"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        named = warn_if_initial_parameters_differ(model, kwargs, wrapped=wrapped)
    if wrapped:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch 2.13: broadcast_buffers is deprecated
            model = nn.parallel.DistributedDataParallel(model, **kwargs).module
    states = [None] * world
    dist.all_gather_object(states, {k: v.clone() for k, v in model.state_dict().items()})
    still_differ = [k for k in states[0] if not all(torch.equal(states[0][k], s[k]) for s in states)]
    return named, sorted(still_differ), [str(w.message) for w in caught if "initial values" in str(w.message)]


SCENARIOS = {  # name -> tensors the warning must name (exactly those that still differ after the wrap)
    "model_in_init": [],
    "same_seed": [],
    "broadcast_buffers_false": ["bn.running_mean"],
    "ignored": ["lin.bias"],
    "no_wrap": ["bn.running_mean", "lin.bias", "lin.weight"],
}


def test_warns_exactly_about_tensors_that_stay_different() -> None:
    rank0, rank1 = run_ranks(_scenarios, world_size=2, timeout=120)
    for name, expected in SCENARIOS.items():
        (named0, differ0, messages0), (named1, _, _) = rank0[name], rank1[name]
        assert sorted(named0) == sorted(named1) == expected, name
        assert differ0 == expected, name  # what DDP really left different
        if not expected:
            assert not messages0, (name, messages0)
            continue
        (message,) = messages0
        for tensor in expected:
            assert repr(tensor) in message and "rank 0" in message and "rank 1" in message, message
        assert "seeds were not synchronised" in message
