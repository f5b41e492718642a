"""How a baseline run under one of Lightning's own strategies ends in these scripts.

Lightning's ``ddp`` and ``model_parallel`` leave their gloo process group to interpreter exit, where a
process that ran a backward aborts in some runs ("terminate called without an active exception", exit
-6; FINDINGS.md: 13 of 40 plain runs). A baseline is there to show what Lightning computes, not how it
exits, so it ends as a careful user's script would. Runs under this project's strategies never call this:
their clean exit is under test (tests/test_teardown.py).
"""

from __future__ import annotations

import gc

import torch.distributed as dist


def end_baseline() -> None:
    """Drop what still holds the group's work, then destroy the group on every rank together."""
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
