"""Shared fixtures. ``cluster`` / ``cluster_tools``: the two-node test cluster (see tests/cluster.py).

Under pytest-xdist (``scripts/test.sh`` runs two workers: a 2-rank Lightning run leaves a core idle
while one rank imports), the tests marked ``alone``, ``cluster`` or ``serial`` all go to one worker
(``xdist_group("serial")``), one after the other. One marked ``alone`` runs with nothing beside it: it
holds a session-wide lock exclusively that every other test holds shared. A turnstile lock keeps an
exclusive waiter from being starved by the other worker's next shared test. One marked ``serial`` or
``cluster`` runs beside the other worker's tests, never beside another of them (the fault-tolerance runs
and the two-node cluster: their own timing is loose enough for a loaded machine, not for two of them at
once; most of their time is spent waiting, which the other worker fills). A test's "setup" time in
``--durations`` includes its wait for the lock.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator

import pytest

from tests.cluster import cluster, cluster_tools  # noqa: F401 - pytest finds fixtures by name

_ALONE = ("alone",)
# the two-node cluster tests wait on slurmd, torchrun's rendezvous and their own network namespaces more than they
# use the cores: one at a time, beside the other worker's tests (their time bounds are 60-100 s, for runs of 15-25 s)
_SERIAL = (*_ALONE, "cluster", "serial")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the group into the test's id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):  # (gpu_check.sh's venv runs pytest without it)
        return
    for item in items:
        if any(item.get_closest_marker(name) for name in _SERIAL):
            item.add_marker(pytest.mark.xdist_group("serial"))


@pytest.fixture(autouse=True)
def _alone_or_shared(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent  # the session's directory, above each worker's
    alone = any(request.node.get_closest_marker(name) for name in _ALONE)
    serial = any(request.node.get_closest_marker(name) for name in _SERIAL)
    with open(shared / "alone.turnstile", "a") as turnstile, open(shared / "alone.lock", "a") as lock, \
            open(shared / "serial.lock", "a") as one_serial:
        if serial:  # (one at a time whatever the scheduler: the xdist group already keeps them on one worker)
            fcntl.flock(one_serial, fcntl.LOCK_EX)
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
