"""How a survivor left alone after a fault waits for the lost group's next life (tests/test_ft.py's scripts).

A restarted life writes ``OUT/group<g>.back<life>`` (``announce_restart``) before it joins a quorum; the survivor,
at the end of each step it trains alone after a fault, waits for as many such markers as times it was left alone
(``wait_for_restarts``), then paces itself with ``--alone-sleep``: the restarted group has many seconds to join
however long its restart took on a loaded machine, and the run's end is not raced.
"""

from __future__ import annotations

import time
from pathlib import Path


def announce_restart(out: Path, group: int, life: int) -> None:
    (out / f"group{group}.back{life}").touch()


def wait_for_restarts(out: Path, lives: int, limit: float = 120.0) -> None:
    """Until ``lives`` restarted lives have announced themselves, up to ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while len(list(out.glob("group*.back*"))) < lives and time.monotonic() < deadline:
        time.sleep(0.1)


class AlonePacer:
    """The survivor's pace: ``after_step(alone, after_fault)`` at the end of each of its steps. A step it trained
    alone after a fault first waits for the lost group's next life (one more each time it is left alone again);
    every step it trained alone then sleeps ``sleep`` seconds (nothing when ``sleep`` is 0)."""

    def __init__(self, out: Path, sleep: float) -> None:
        self.out, self.sleep = out, sleep
        self.episodes, self.was_alone = 0, False  # times left alone after a fault; the last step's state

    def after_step(self, alone: bool, after_fault: bool) -> None:
        if alone and self.sleep > 0:
            if after_fault:
                self.episodes += not self.was_alone
                wait_for_restarts(self.out, self.episodes)
            time.sleep(self.sleep)
        self.was_alone = alone
