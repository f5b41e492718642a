"""Memory readings the benchmarks share: this process's resident set from ``/proc/self/statm`` (Linux)."""

from __future__ import annotations

import os
import threading

_PAGE = os.sysconf("SC_PAGE_SIZE")


def statm() -> tuple[int, int]:
    """This process's resident bytes and, of them, the shared ones (file-backed pages and shmem)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return int(fields[1]) * _PAGE, int(fields[2]) * _PAGE


def rss() -> int:
    """This process's resident bytes."""
    return statm()[0]


class PeakRSS:
    """This process's peak resident memory while the block runs (``peak``, over ``base`` before it), and the peak of
    its anonymous part (``anon_peak`` over ``anon_base``: resident minus file-backed and shared pages, i.e. without
    the code pages of libraries touched for the first time), sampled every ``interval`` seconds by a thread (torch
    ops release the GIL) and once more at the block's end."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval

    def __enter__(self) -> PeakRSS:
        resident, shared = statm()
        self.base = self.peak = resident
        self.anon_base = self.anon_peak = resident - shared
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        resident, shared = statm()
        self.peak = max(self.peak, resident)
        self.anon_peak = max(self.anon_peak, resident - shared)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
