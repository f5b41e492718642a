"""A direct channel between the ranks of one host: small exchanges without gloo's round trip.

Why: on CPU a gloo collective of a few kilobytes costs 100-500 us and, inside a training step, about
a millisecond (measured here: 2 ranks, 2 cores): gloo hands the work to its own thread, which wakes,
sends, waits and wakes the caller again, and every hop can wait for a core. The same bytes between
two processes over a Unix socket, sent and received by the calling thread itself, take ~10 us. Where a
step makes several blocking collectives of a few kilobytes (:class:`~lightning_sync.SyncBatchNorm`:
two per layer and step), that difference is most of the layer's cost.

:func:`channel` sets up, once per process group, a full mesh of Unix-domain stream sockets between
the group's ranks (abstract addresses, so no file and no TCP port; a connecting rank proves it knows
a secret that rank 0 drew and sent over the group) and :meth:`DirectChannel.all_gather` exchanges one
block per rank over it. It applies only where every rank of the group runs on the same host in the
same network namespace (the same Linux boot id and network namespace), on a gloo group; anywhere else
:func:`channel` returns ``None`` on every rank and callers use the process group as before. Setting
the environment variable ``LIGHTNING_SYNC_DIRECT=0`` on any rank turns it off for the whole group.

Every message carries a 64-byte header (its length, a checksum of what the caller says it is, and
that description), so ranks at different exchanges get the same :class:`~lightning_sync.CollectiveMismatchError`
naming each rank's exchange instead of pairing mismatched bytes, and a rank whose peer died or closed
its end gets an error naming that rank instead of waiting forever. While it waits, the calling thread
asks the registered waiter (the collective guard, see :func:`register_waiter`) every 0.1 s whether
the run has failed elsewhere, so the guard can end a wait here as it ends one in gloo.

This module imports torch only (no Lightning), like :mod:`lightning_sync.collectives`.
"""

from __future__ import annotations

import hashlib
import os
import select
import socket
import struct
import sys
import time
import weakref
import zlib
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sync._compat.torch_api import all_gather_single
from lightning_sync.errors import CollectiveMismatchError, LightningSyncError, format_ranks

__all__ = ["DirectChannel", "Waiter", "all_gather_rows", "any_broken", "channel", "existing", "register_waiter",
           "reset", "unregister_waiter"]

#: The environment variable that turns the channel off (``0``) on every rank of a group.
ENV = "LIGHTNING_SYNC_DIRECT"
#: Blocks larger than this go through the process group: the channel is for latency-bound exchanges, and a
#: block this size always fits in the sockets' buffers, so a rank that stops reading a mismatched peer never
#: leaves that peer stuck sending (SyncBatchNorm's record: up to 4095 channels).
MAX_BYTES = 1 << 16
# length (int64), checksum of the description (uint32), the description (utf-8, zero-padded)
_HEADER = struct.Struct("<qI52s")
_SECRET = 16
_SLICE = 0.1  # seconds between two looks at the waiter while blocked
_SETUP_TIMEOUT = 30.0


class Waiter(Protocol):
    """What a collective guard offers a blocked exchange (see :func:`register_waiter`)."""

    def enter(self) -> Any:
        """This rank is now blocked in a collective; returns a token for :meth:`leave`."""

    def poll(self) -> None:
        """Raise the failure that ends the wait, if there is one."""

    def leave(self, token: Any) -> None:
        """The wait is over."""

    def explain(self, err: BaseException) -> BaseException:
        """The error to raise for ``err`` (a peer closed its end, or the ranks met at different exchanges):
        a better one where the waiter knows more (the failure a peer posted, which rank died, the call sites)."""


_waiter: Waiter | None = None


def register_waiter(waiter: Waiter) -> None:
    """Let ``waiter`` (the collective guard) see and end this module's blocked exchanges. One at a time."""
    global _waiter
    _waiter = waiter


def unregister_waiter(waiter: Waiter) -> None:
    """Undo :func:`register_waiter` (only if ``waiter`` is the registered one)."""
    global _waiter
    if _waiter is waiter:
        _waiter = None


class DirectChannel:
    """Connected sockets to every other rank of one process group (see the module docstring).

    Args:
        rank: this process's rank in the group.
        world: the group's size.
        peers: group rank -> connected socket, for every other rank.
        ranks: the group's ranks as global ranks (for messages).
        timeout: seconds an exchange may wait for a peer before it fails.
    """

    def __init__(self, rank: int, world: int, peers: dict[int, socket.socket], ranks: list[int],
                 timeout: float) -> None:
        self.rank = rank
        self.world = world
        self.ranks = ranks
        self.timeout = timeout
        self._peers = peers
        self._order = sorted(peers)
        self._broken: str | None = None
        self._headers: dict[tuple[int, str], bytes] = {}
        for sock in peers.values():
            sock.setblocking(False)
        _open.add(self)
        weakref.finalize(self, _close_sockets, list(peers.values()))

    @property
    def broken(self) -> bool:
        """An exchange failed (a mismatch, a lost peer, the guard's failure): the channel is unusable."""
        return self._broken is not None

    def close(self) -> None:
        """Close every socket (the peers then see this rank's end closed)."""
        self._broken = self._broken or "the channel was closed"
        _close_sockets(list(self._peers.values()))
        _open.discard(self)

    def all_gather(self, tensor: Tensor, what: str) -> Tensor:
        """Every rank's ``tensor``, stacked in rank order: ``[world, *tensor.shape]``, on the CPU.

        Every rank of the group must call it, with a tensor of the same dtype and shape and the same
        ``what`` (a short description, shown in errors); it blocks until every rank's block arrived.

        Raises:
            CollectiveMismatchError: on every rank, when the ranks' blocks differ in size or description
                (they reached different exchanges).
            LightningSyncError: a peer closed its end (it died, or tore down), or ``timeout`` passed.
        """
        src = tensor.detach()
        if src.device.type != "cpu":
            src = src.cpu()
        src = src.contiguous().reshape(-1)
        nbytes = src.numel() * src.element_size()
        out = torch.empty((self.world, nbytes), dtype=torch.uint8)
        out[self.rank] = src.view(torch.uint8)
        self._exchange(out, what)
        if nbytes == 0:
            return torch.empty((self.world, *tensor.shape), dtype=src.dtype)
        return out.view(src.dtype).reshape(self.world, *tensor.shape)

    # ---------------------------------------------------------------- the exchange

    def _exchange(self, out: Tensor, what: str) -> None:
        if self._broken is not None:
            raise LightningSyncError(f"rank {self.ranks[self.rank]}: the direct channel between the ranks is "
                                     f"unusable ({self._broken}); the run cannot continue.")
        nbytes = out.shape[1]
        header = self._headers.get((nbytes, what))
        if header is None:
            label = what.encode()[:_HEADER.size - 12]
            header = self._headers[(nbytes, what)] = _HEADER.pack(nbytes, zlib.crc32(label), label)
        rows = out.numpy()
        mine = memoryview(rows[self.rank])
        sending = {peer: [memoryview(header), mine][:2 if nbytes else 1] for peer in self._order}
        # what each peer's next bytes go into: its header, then its row of ``out``
        heads = {peer: bytearray(_HEADER.size) for peer in self._order}
        sinks = {peer: [memoryview(heads[peer]), memoryview(rows[peer])][:2 if nbytes else 1] for peer in self._order}
        foreign: dict[int, tuple[int, str]] = {}  # peers whose block is not this rank's kind
        waiting, token, deadline, grace = False, None, 0.0, 0.0
        try:
            while True:
                progress = False
                for peer in list(sending):
                    progress |= self._send(peer, sending)
                for peer in list(sinks):
                    progress |= self._receive(peer, header, heads[peer], sinks, foreign)
                if not sending and not sinks:
                    break
                if foreign and not sending:
                    # A mismatch: wait a moment for the other ranks' headers, to name what each one was at.
                    grace = grace or time.monotonic() + 1.0
                    if time.monotonic() > grace or all(sinks[p][0].obj is not heads[p] for p in sinks):
                        break
                if progress:
                    continue
                if not waiting:
                    waiting, deadline = True, time.monotonic() + self.timeout
                    token = _waiter.enter() if _waiter is not None else None
                self._wait(sending, sinks, grace or deadline)
                if not grace and time.monotonic() > deadline:
                    raise LightningSyncError(
                        f"rank {self.ranks[self.rank]} waited {self.timeout:.0f} s in the direct-channel exchange "
                        f"{what!r} for ranks that never sent their block; every rank of the group must make the "
                        "same exchanges (the same synchronised layers in training mode, in the same order).")
        except BaseException as err:
            # Left halfway (the guard's failure, a lost peer, an interrupt): this rank's block may sit unread
            # at its peers and theirs here, so the streams no longer line up. Never used again.
            self._broken = self._broken or f"{type(err).__name__} during {what!r}"
            raise
        finally:
            if waiting and _waiter is not None:
                _waiter.leave(token)
        if foreign:
            # Every rank sent its block before raising, so the peers see the mismatch too. The channel's
            # streams are no longer aligned: it stays unusable.
            self._broken = "ranks exchanged different blocks"
            kinds = {self.ranks[self.rank]: f"{what} ({nbytes} bytes)"}
            for peer in self._order:
                if peer in foreign:
                    kinds[self.ranks[peer]] = "{} ({} bytes)".format(*reversed(foreign[peer]))
                elif peer not in sinks or sinks[peer][0].obj is not heads[peer]:  # its header arrived: this kind
                    kinds[self.ranks[peer]] = f"{what} ({nbytes} bytes)"
                else:
                    kinds[self.ranks[peer]] = "(its block had not arrived)"
            error = CollectiveMismatchError(
                f"direct channel: the ranks reached different exchanges: {format_ranks(kinds)}. Every rank must "
                "run the same synchronised layers and collectives in the same order (a rank-dependent branch, "
                "a layer in eval mode on one rank only, or different models).", kinds)
            # The guard knows more: every rank's last collectives and their call sites.
            raise _waiter.explain(error) if _waiter is not None else error

    def _send(self, peer: int, sending: dict[int, list[memoryview]]) -> bool:
        parts = sending[peer]
        try:
            sent = self._peers[peer].sendmsg(parts)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as err:
            raise self._lost(peer, err) from err
        _advance(parts, sent)
        if not parts:
            del sending[peer]
        return True

    def _receive(self, peer: int, header: bytes, head: bytearray, sinks: dict[int, list[memoryview]],
                 foreign: dict[int, tuple[int, str]]) -> bool:
        parts = sinks[peer]
        head_open = parts[0].obj is head
        try:
            n = self._peers[peer].recvmsg_into(parts)[0]
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as err:
            raise self._lost(peer, err) from err
        if n == 0:
            raise self._lost(peer, None)
        _advance(parts, n)
        if head_open and (not parts or parts[0].obj is not head) and head != header:
            size, _, label = _HEADER.unpack(bytes(head))
            foreign[peer] = (size, label.rstrip(b"\0").decode(errors="replace"))
            parts.clear()  # its bytes are not this exchange's: read no further (the channel breaks)
        if not parts:
            del sinks[peer]
        return True

    def _wait(self, sending: dict[int, list[memoryview]], sinks: dict[int, list[memoryview]], until: float) -> None:
        """Until a socket is ready or ``until`` passes; asks the waiter every slice."""
        poller = select.poll()
        for peer, sock in self._peers.items():
            events = (select.POLLIN if peer in sinks else 0) | (select.POLLOUT if peer in sending else 0)
            if events:
                poller.register(sock, events)
        while True:
            left = until - time.monotonic()
            if left <= 0 or poller.poll(max(1, min(_SLICE, left) * 1000)):
                return
            if _waiter is not None:
                _waiter.poll()

    def _lost(self, peer: int, err: OSError | None) -> BaseException:
        why = f" ({err})" if err is not None else ""
        error = LightningSyncError(
            f"rank {self.ranks[peer]} closed its direct connection to rank {self.ranks[self.rank]}{why}: that process "
            "ended (a crash, a signal, out of memory) or tore its process group down while this rank was still "
            f"synchronising with it. Look for rank {self.ranks[peer]}'s own error above.")
        # A peer that left because its run failed posted why to the guard: that, the cause, beats the
        # connection's end; and the guard can tell a dead process from one that raised.
        return _waiter.explain(error) if _waiter is not None else error


def _advance(parts: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of the buffers ``parts`` (a scatter/gather list), in place."""
    while n and parts:
        if n >= len(parts[0]):
            n -= len(parts[0])
            parts.pop(0)
        else:
            parts[0] = parts[0][n:]
            n = 0


# ------------------------------------------------------------------------------------ set-up

# group -> its channel, or None where none applies (decided once, alike on every rank). Weak: it goes
# with its group, and a new group after destroy_process_group gets its own.
_channels: weakref.WeakKeyDictionary[Any, DirectChannel | None] = weakref.WeakKeyDictionary()
_open: weakref.WeakSet[DirectChannel] = weakref.WeakSet()


def channel(group: dist.ProcessGroup | None = None, timeout: float = 1800.0) -> DirectChannel | None:
    """The direct channel of ``group`` (``None``: the default group), or ``None`` where none applies.

    The first call on a group sets it up: a collective, so every rank of the group must make that first
    call at the same point (three small collectives on the group, once). Every rank gets the same
    answer. ``None``: torch.distributed is not initialised, the group has one rank, is not a gloo group,
    spans several hosts or network namespaces, or some rank set ``LIGHTNING_SYNC_DIRECT=0``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg = group if group is not None else dist.group.WORLD
    try:
        return _channels[pg]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: no cache, no channel
        return None
    made = _setup(pg, timeout)
    _channels[pg] = made
    return made


def all_gather_rows(record: Tensor, group: dist.ProcessGroup | None, what: str, set_up: bool = True) -> Tensor:
    """Every rank's ``record`` (1-D, the same size on every rank), ``[world, n]`` in rank order, on
    ``record``'s device: over the group's channel where there is one, else one ``all_gather`` on the group.
    Every rank of the group must call it, and every rank takes the same path.

    Args:
        set_up: the group's first exchange may set its channel up (a collective, see :func:`channel`);
            ``False``: only a channel set up before is used (see :func:`existing`).
    """
    small = record.numel() * record.element_size() <= MAX_BYTES
    ch = (channel(group) if set_up else existing(group)) if small else None
    if ch is not None:
        return ch.all_gather(record, what).to(record.device)
    world = dist.get_world_size(group)
    gathered = torch.empty(world * record.numel(), dtype=record.dtype, device=record.device)
    all_gather_single(gathered, record, group=group)
    return gathered.view(world, -1)


def existing(group: dist.ProcessGroup | None = None) -> DirectChannel | None:
    """The channel :func:`channel` set up on ``group`` before, or ``None``; never a collective.

    For callers that must not set one up where they stand (a check that may run on one rank only when
    the program is wrong). Every rank of a group sets its channel up at the same call, so every rank
    gets the same answer here."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return _channels.get(group if group is not None else dist.group.WORLD)
    except TypeError:
        return None


def any_broken() -> bool:
    """Whether an exchange on any of this process's channels failed (see :func:`reset`)."""
    return any(ch.broken for ch in list(_open))


def reset() -> None:
    """Close and forget every channel of this process: the next :func:`channel` on a group sets one up
    anew. Every rank must call it at the same point (after a failure that may have left a channel's
    streams misaligned, on any group)."""
    for ch in list(_open):
        ch.close()
    _channels.clear()


def _host_key() -> bytes | None:
    """What two processes share exactly when they can reach each other's abstract Unix sockets."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net")
    except OSError:
        return None
    return hashlib.blake2b(boot + f"/{netns.st_dev}/{netns.st_ino}".encode(), digest_size=16).digest()


def _address(secret: bytes, rank: int) -> bytes:
    # Abstract namespace (leading NUL): no file to clean up, gone with the socket. The name is derived from
    # the secret but does not reveal it (/proc/net/unix lists the names).
    return b"\0lightning_sync/" + hashlib.blake2b(secret + rank.to_bytes(4, "little"), digest_size=12).hexdigest().encode()


def _agreed(flag: bool, group: Any) -> bool:
    both = torch.tensor([0 if flag else 1], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return int(both.item()) == 0


def _setup(group: Any, timeout: float) -> DirectChannel | None:
    if dist.get_world_size(group) <= 1 or "gloo" not in str(dist.get_backend(group)).lower():
        return None
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    key = _host_key()
    wanted = os.environ.get(ENV, "1").strip() != "0" and key is not None
    block = torch.zeros(1 + 16 + _SECRET, dtype=torch.uint8)
    block[0] = int(wanted)
    if key is not None:
        block[1:17] = torch.frombuffer(bytearray(key), dtype=torch.uint8)
    block[17:] = torch.frombuffer(bytearray(os.urandom(_SECRET)), dtype=torch.uint8)
    every = torch.empty(world * block.numel(), dtype=torch.uint8)
    all_gather_single(every, block, group=group)
    rows = every.view(world, -1)
    if not bool(rows[:, 0].all()) or not bool((rows[:, 1:17] == rows[0, 1:17]).all()):
        return None
    secret = bytes(rows[0, 17:].tolist())
    ranks = dist.get_process_group_ranks(group)

    listener: socket.socket | None = None
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(_address(secret, rank))
        listener.listen(world)
        listener.settimeout(_SETUP_TIMEOUT)
    except OSError:
        if listener is not None:
            listener.close()
        listener = None
    try:
        listening = _agreed(listener is not None, group)
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    if not listening or listener is None:
        if listener is not None:
            listener.close()
        return None
    peers: dict[int, socket.socket] = {}
    ok = True
    try:
        for peer in range(rank):  # connect to every lower rank; they are listening (agreed above)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peers[peer] = sock
            sock.settimeout(_SETUP_TIMEOUT)
            sock.connect(_address(secret, peer))
            sock.sendall(secret + rank.to_bytes(4, "little"))
        deadline = time.monotonic() + _SETUP_TIMEOUT
        while len(peers) < world - 1:  # accept every higher rank; drop anyone who does not know the secret
            listener.settimeout(max(deadline - time.monotonic(), 0.001))
            sock, _ = listener.accept()
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                hello = _read_exactly(sock, _SECRET + 4)
            except OSError:
                sock.close()
                raise
            peer = int.from_bytes(hello[_SECRET:], "little")
            if hello[:_SECRET] != secret or not rank < peer < world or peer in peers:
                sock.close()
                continue
            peers[peer] = sock
    except OSError:
        ok = False
    finally:
        listener.close()
    try:
        connected = _agreed(ok, group)
    except BaseException:
        _close_sockets(list(peers.values()))
        raise
    if not connected:
        _close_sockets(list(peers.values()))
        return None
    for sock in peers.values():
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 21)
    return DirectChannel(rank, world, peers, ranks, timeout)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        buf += chunk
    return buf


def _close_sockets(socks: list[socket.socket]) -> None:
    for sock in socks:
        try:
            sock.close()
        except OSError:
            pass


def _drop_in_child() -> None:
    # A forked child (a data-loader worker) must not keep the rank's connections open: a peer would then
    # not see this rank's end close when the rank dies. close() drops the child's descriptors only.
    for ch in list(_open):
        _close_sockets(list(ch._peers.values()))
        ch._broken = "this process is a fork of the rank that set the channel up"
    _open.clear()
    _channels.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_in_child)
