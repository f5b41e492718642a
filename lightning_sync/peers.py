"""Who runs where, so that a failed collective can name the peer it lost.

When a rank on another node dies (SIGKILL, OOM killer, node reboot), the survivors get a gloo error
such as ``Connection closed by peer [10.200.0.2]:45229``: an address, no rank. :func:`gather_peers`
records every rank's host and address once at set-up; :func:`lost_peer_message` turns such an
error into ``rank 0 (host n0) lost contact with rank 2 or 3 (host n1, 10.200.0.2)``. gloo reports
the address of the pair's socket, so a host with several ranks can only be narrowed to its ranks.
"""

from __future__ import annotations

import os
import re
import socket

import torch.distributed as dist

__all__ = ["Peer", "gather_peers", "lost_peer_message"]

Peer = tuple[str, str]  # (hostname, IPv4 address this rank reaches MASTER_ADDR from)

# gloo's transport errors that carry the remote address: "Connection closed by peer [ADDR]:PORT",
# "Read error [ADDR]:PORT: Connection reset by peer", "Write error [ADDR]:PORT: Broken pipe".
_LOST = re.compile(r"(?:closed by peer|reset by peer|Broken pipe|Read error|Write error)")
_ADDR = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")


def local_address(master_addr: str | None = None) -> str:
    """The local IPv4 address that routes to ``master_addr`` (no packet is sent); ``"?"`` if unknown.

    Also what ``lsync-doctor`` reports as the route to MASTER_ADDR (``doctor.route_interface``).
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1"), 9))
            return str(sock.getsockname()[0])
    except OSError:
        return "?"


def gather_peers() -> list[Peer]:
    """Every rank's (hostname, address), by rank: one small collective, call it on every rank."""
    me: Peer = (socket.gethostname(), local_address())
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [me]
    from lightning_sync import collectives  # plain data only (safe=True): a peer's bytes cannot run code here

    peers = collectives.gather_objects(me, safe=True) or []
    return [(str(p[0]), str(p[1])) if isinstance(p, (tuple, list)) and len(p) == 2 else ("?", "?") for p in peers]


def lost_peer_message(exception: BaseException, peers: list[Peer], rank: int) -> str | None:
    """A line naming the rank(s) behind a gloo connection error, or ``None`` if it is not one."""
    text = str(exception)
    if not _LOST.search(text):
        return None
    found = _ADDR.search(text)
    if found is None or not peers:
        return None
    addr = found.group(1)
    ranks = [r for r, (_, a) in enumerate(peers) if a == addr and r != rank]
    if not ranks and addr.startswith("127."):  # loopback: a rank on this host
        ranks = [r for r, (h, _) in enumerate(peers) if h == peers[rank][0] and r != rank]
    me = f"rank {rank} (host {peers[rank][0]})" if rank < len(peers) else f"rank {rank}"
    if not ranks:
        return f"{me} lost contact with the rank at {addr} (a process there died or its node went away)"
    hosts = sorted({peers[r][0] for r in ranks})
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "rank " + ", ".join(map(str, ranks[:-1])) + f" or {ranks[-1]}"
    return (f"{me} lost contact with {who} (host {', '.join(hosts)}, {addr}): that process died or its node "
            f"went away; the launcher's log on {', '.join(hosts)} names the rank that failed first")
