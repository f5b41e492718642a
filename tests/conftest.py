"""Shared fixtures. ``cluster`` / ``cluster_tools``: the two-node test cluster (see tests/cluster.py).

Under pytest-xdist (``scripts/test.sh`` runs two workers: a 2-rank Lightning run leaves a core idle
while one rank imports), a test marked ``alone`` or ``cluster`` runs with nothing else running:
all of them go to one worker (``xdist_group``), and each holds a session-wide lock exclusively that
every other test holds shared. A turnstile lock keeps an exclusive waiter from being starved by the
other worker's next shared test. A test's "setup" time in ``--durations`` includes its wait for the lock.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator

import pytest

from tests.cluster import cluster, cluster_tools  # noqa: F401 - pytest finds fixtures by name

_ALONE = ("alone", "cluster")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):  # (gpu_check.sh's venv runs pytest without it)
        return
    for item in items:
        if any(item.get_closest_marker(name) for name in _ALONE):
            item.add_marker(pytest.mark.xdist_group("alone"))


@pytest.fixture(autouse=True)
def _alone_or_shared(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent  # the session's directory, above each worker's
    alone = any(request.node.get_closest_marker(name) for name in _ALONE)
    with open(shared / "alone.turnstile", "a") as turnstile, open(shared / "alone.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
