"""Shared fixtures. ``cluster`` / ``cluster_tools``: the two-node test cluster (see tests/cluster.py)."""

from tests.cluster import cluster, cluster_tools  # noqa: F401 - pytest finds fixtures by name
