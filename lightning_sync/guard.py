"""Collective guard: no silent hangs.

While a :class:`CollectiveGuard` is installed (``strategy="ddp_sync"`` installs one by default),
every collective issued

* through ``torch.distributed.<op>`` by user code, Lightning or torchmetrics (the functions in the
  ``torch.distributed`` namespace are replaced for the guard's lifetime and restored afterwards),
* through :mod:`lightning_sync.collectives`, and
* through the strategy (``strategy.reduce``, which ``self.log(..., sync_dist=True)`` uses),

is first announced by every rank on a side channel (the rendezvous store, with its own short
timeout): operation, dtype and shape where they must match, and the user's call site
(``file:line function``, found by skipping frames inside torch, Lightning, torchmetrics and
lightning_sync). Ranks that announce different collectives, or a rank that does not announce one
within ``timeout`` seconds, make every rank that can still act raise
:class:`~lightning_sync.CollectiveMismatchError` naming each rank's collective and call site,
instead of hanging until the process group's 30-minute timeout.

Collectives issued by torch itself are not intercepted: DDP's gradient all-reduce runs in C++
through the process group, and torch-internal Python calls (``broadcast_object_list`` calling
``broadcast``, DDP's join hooks) are recognised by their caller's file and passed through.

A watchdog thread per rank writes the rank's Python stack (``faulthandler``) and its last
collectives to ``stream`` when a guarded collective has not finished after ``hang_timeout`` seconds,
or when another rank has raised a guard error (this rank may be stuck where Python cannot reach,
e.g. in DDP's backward all-reduce).

Only ``torch.distributed`` is imported here, never Lightning.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import sys
import sysconfig
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, MutableMapping
from datetime import timedelta
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sync import collectives
from lightning_sync.errors import CollectiveMismatchError, LightningSyncError

__all__ = [
    "CollectiveGuard",
    "configure_nccl_flight_recorder",
    "parameter_checksums",
]

#: Collectives of the torch.distributed namespace that the guard intercepts. Point-to-point calls
#: (send/recv) are left alone: their pairing legitimately differs by rank.
GUARDED_OPS = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "broadcast", "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single",
)
# For each op: (position, keyword) of the tensor whose dtype and shape must match on every rank,
# and (position, keyword) of the argument that must match (reduce op, src or dst). None: nothing.
_MATCH: dict[str, tuple[tuple[int, str] | None, tuple[int, str] | None]] = {
    "all_reduce": ((0, "tensor"), (1, "op")),
    "all_gather": ((1, "tensor"), None),
    "all_gather_into_tensor": ((1, "input_tensor"), None),
    "all_gather_single": ((1, "input_tensor"), None),
    "broadcast": ((0, "tensor"), (1, "src")),
    "broadcast_object_list": (None, (1, "src")),
    "reduce": ((0, "tensor"), (1, "dst")),
    "reduce_scatter": ((0, "output"), (2, "op")),
    "reduce_scatter_tensor": ((0, "output"), (2, "op")),
    "gather": ((0, "tensor"), (2, "dst")),
    "gather_object": (None, (2, "dst")),
    "scatter": ((0, "tensor"), (2, "src")),
    "scatter_object_list": (None, (2, "src")),
}
_SEP = "\x1f"
_CLOSING = "end of guarded block"
_RS = "\x1e"  # separates the sequence number from the record in sampled mode
_generation = 0  # rank 0's count of installs (see install): keeps store keys apart


def _library_dirs() -> tuple[str, ...]:
    """Directories whose frames are not the user's call site."""
    dirs = {os.path.dirname(os.path.abspath(__file__))}
    for name in ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities",
                 "torchmetrics", "typing_extensions"):
        mod = sys.modules.get(name)
        path = getattr(mod, "__file__", None) if mod is not None else None
        if path:
            dirs.add(os.path.dirname(os.path.abspath(path)))
    for key in ("stdlib", "platstdlib"):  # contextlib, functools, threading wrappers
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.add(os.path.abspath(path))
    return tuple(d + os.sep for d in sorted(dirs))


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# The package's own training entry point is the user's code as far as call sites go: its ranks may
# start differently (rank 0 as the `lsync-train` console script, the others as `python -m`), so the
# frames outside it differ while its own lines are the same on every rank.
_ENTRY_POINTS = frozenset({os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")})
_COLLECTIVES_FILE = os.path.abspath(collectives.__file__)
# Callers whose collectives pass unchecked: lightning_sync.collectives checks each public call once
# through its hook; the portable SyncBatchNorm's per-layer all-reduces are symmetric by construction
# (every rank runs every layer, empty batches included) and sit on the hot path.
_TRUSTED_FILES = frozenset({_COLLECTIVES_FILE, os.path.join(os.path.dirname(_COLLECTIVES_FILE), "batchnorm.py")})


def _describe_tensor(t: Any) -> str:
    if isinstance(t, Tensor):
        return f"{str(t.dtype).removeprefix('torch.')}[{', '.join(str(d) for d in t.shape)}]"
    if isinstance(t, (list, tuple)):
        return f"{len(t)} x " + (_describe_tensor(t[0]) if t else "[]")
    return type(t).__name__


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], where: tuple[int, str] | None) -> Any:
    if where is None:
        return None
    pos, name = where
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else None


def _op_name(op: Any) -> str:
    return str(op).rsplit(".", 1)[-1].lower() if op is not None else "sum"


class _Guarded:
    """Context manager for one guarded collective: announce, agree, then run the body."""

    __slots__ = ("_guard", "_op", "_match", "_group")

    def __init__(self, guard: CollectiveGuard, op: str, match: str, group: Any) -> None:
        self._guard, self._op, self._match, self._group = guard, op, match, group

    def __enter__(self) -> None:
        guard = self._guard
        if guard._depth == 0:
            guard.check(self._op, self._match, self._group, _skip=2)
        guard._depth += 1
        guard._busy_since = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        guard = self._guard
        guard._depth -= 1
        if guard._depth == 0:
            guard._busy_since = None


class _Nothing:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NOTHING = _Nothing()


class CollectiveGuard:
    """Makes every rank agree on each collective before entering it; reports hangs with stacks.

    ``strategy="ddp_sync"`` installs one after the process group is created and removes it at
    teardown; pass ``SyncDDPStrategy(guard=False)`` to turn it off, ``guard_timeout=...`` to change
    the timeout, or ``guard=CollectiveGuard(...)`` for the other settings. Without Lightning::

        dist.init_process_group(...)
        with CollectiveGuard(timeout=30):
            ...  # every torch.distributed / lightning_sync collective is checked

    Args:
        timeout: seconds a rank waits for the other ranks to announce the same collective before
            raising. It must exceed the longest stretch one rank legitimately works alone between
            two collectives (e.g. rank 0 writing a large checkpoint while the others wait in the
            barrier that follows).
        hang_timeout: seconds after which a guarded collective that has not finished makes the rank
            dump its stack and last collectives to ``stream`` (default: ``timeout``).
        match_call_sites: also require the same call site on every rank. Catches two different
            collectives with identical shapes pairing up silently (the values of one metric summed
            with another's); turn it off for programs that issue the same collective from different
            lines on different ranks on purpose.
        stream: where the watchdog writes (default: the rank's stderr).
        history: how many of this rank's last collectives to keep for reports.
        check_every: ``1`` (default): every rank waits for the others' announcement before each
            collective, so a mismatch raises before anything runs. ``k > 1`` (sampled, for hot
            loops): ranks announce every collective without waiting and verify the last ``k``
            announcements together on every ``k``-th collective and on every barrier; a mismatch
            raises there, naming the first differing collective (results since then are
            unreliable). A collective that hangs meanwhile is diagnosed by the watchdog after
            ``timeout``: it writes the same report, the stacks, and ends the process (exit code
            70), since Python cannot raise inside a blocked collective.
    """

    def __init__(self, timeout: float = 120.0, hang_timeout: float | None = None, match_call_sites: bool = True,
                 stream: IO[str] | None = None, history: int = 8, check_every: int = 1) -> None:
        if not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"CollectiveGuard(check_every={check_every!r}): must be a positive int.")
        self.check_every = check_every
        self._ring = max(8, 4 * check_every)
        self._pending: dict[str, list[tuple[int, str]]] = {}
        self._current: tuple[str, int, str, list[int]] | None = None
        if not timeout > 0:
            raise ValueError(f"CollectiveGuard(timeout={timeout!r}): the timeout must be a positive number of seconds.")
        if hang_timeout is not None and not hang_timeout > 0:
            raise ValueError(f"CollectiveGuard(hang_timeout={hang_timeout!r}): must be positive seconds or None.")
        self.timeout = float(timeout)
        self.hang_timeout = float(hang_timeout) if hang_timeout is not None else float(timeout)
        self.match_call_sites = match_call_sites
        self.stream = stream
        self.history: deque[str] = deque(maxlen=history)
        self.context: Callable[[], str | None] | None = None
        self._store: Any = None
        self._own_timeout = False
        self._watch_store: Any = None
        self._rank = 0
        self._seq: dict[str, int] = {}
        self._depth = 0
        self._busy_since: float | None = None
        self._originals: dict[str, Callable[..., Any]] = {}
        self._lib_dirs: tuple[str, ...] = ()
        self._code_is_lib: dict[Any, bool] = {}
        self._module: weakref.ref[torch.nn.Module] | None = None
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()
        self._reported_abort = False
        self._dumped_for: float | None = None
        self.checks = 0  # guarded collectives so far (for tests and the benchmark)

    # ------------------------------------------------------------------ life cycle

    def __getstate__(self) -> dict[str, Any]:
        # The strategy travels to spawned ranks pickled: send the settings, not the live state.
        return {"timeout": self.timeout, "hang_timeout": self.hang_timeout, "match_call_sites": self.match_call_sites,
                "history": self.history.maxlen, "check_every": self.check_every}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]


    @property
    def active(self) -> bool:
        """True between :meth:`install` and :meth:`uninstall`."""
        return self._store is not None

    def __enter__(self) -> CollectiveGuard:
        self.install()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            if exc_type is None and dist.is_initialized():
                # A closing check: a rank that skipped a collective the others made is reported here,
                # as a mismatch with call sites, rather than by a timeout somewhere else.
                self.check(_CLOSING, "", None, _skip=1)
        finally:
            self.uninstall()

    def install(self, context: Callable[[], str | None] | None = None) -> None:
        """Start guarding: needs an initialised default process group; every rank must call it.

        Args:
            context: returns a label for where the program is (the strategy passes the current
                Lightning hook, e.g. ``"training_step"``), shown beside call sites.
        """
        global _generation
        if self.active:
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("CollectiveGuard.install: torch.distributed is not initialised; call "
                               "dist.init_process_group first.")
        # Every install needs fresh store keys (torchrun's store outlives a process group), and every
        # rank must use the same ones: a Hydra sweep's rank 0 has installed once per job, its other
        # ranks are new processes each job. So rank 0's count wins (one unguarded broadcast).
        generation = torch.tensor([_generation + 1], dtype=torch.int64, device=collectives._comm_device(None))
        dist.broadcast(generation, src=0)
        _generation = int(generation.item())
        self.context = context
        self._rank = dist.get_rank()
        self._seq = {}
        self._pending = {}
        self._current = None
        self._depth = 0
        self._reported_abort = False
        self._lib_dirs = _library_dirs()
        self._code_is_lib = {}
        # torchrun's store also outlives a restart of the worker group: the attempt keeps keys apart
        prefix = f"lightning_sync/guard/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_generation}/"
        self._store, self._own_timeout = self._side_store(prefix)
        self._watch_store = self._side_store(prefix)[0] if self._own_timeout else self._store
        for name in GUARDED_OPS:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._originals[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        collectives._guard_hook = self._collectives_hook
        self._stop.clear()
        self._watchdog = threading.Thread(target=self._watch, name="lightning_sync-guard-watchdog", daemon=True)
        self._watchdog.start()

    def uninstall(self) -> None:
        """Stop guarding and restore ``torch.distributed`` (idempotent)."""
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals = {}
        if collectives._guard_hook == self._collectives_hook:
            collectives._guard_hook = None
        self._stop.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=5)
        self._watchdog = None
        self._store = self._watch_store = None

    def watch_module(self, module: torch.nn.Module) -> None:
        """Reject ``all_reduce`` calls on ``module``'s parameters or gradients (DDP already syncs them)."""
        self._module = weakref.ref(getattr(module, "module", module))  # names as the user knows them

    def _side_store(self, prefix: str) -> tuple[Any, bool]:
        # torch.distributed exports the store classes without declaring them (mypy): go through Any
        c10d: Any = dist
        base = dist.distributed_c10d._get_default_store()
        inner = base
        while isinstance(inner, c10d.PrefixStore):
            inner = inner.underlying_store
        if isinstance(inner, c10d.TCPStore):
            # Our own connection to the rendezvous server, with our own timeout: a blocking get then
            # waits at most `timeout` (the shared store waits as long as the process group does).
            client = c10d.TCPStore(inner.host, inner.port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=self.timeout))
            return c10d.PrefixStore(prefix, client), True
        return c10d.PrefixStore(prefix, base), False

    # ------------------------------------------------------------------ interception

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        tensor_at, arg_at = _MATCH.get(name, (None, None))
        guard = self

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            # torch's own Python-level calls (broadcast_object_list -> broadcast, DDP join hooks) and
            # lightning_sync.collectives' payload transfers (already checked as one collective) pass.
            if guard._depth or caller.startswith(_TORCH_DIR) or caller in _TRUSTED_FILES:
                return fn(*args, **kwargs)
            group = kwargs.get("group")
            tensor = _arg(args, kwargs, tensor_at)
            if name == "all_reduce" and guard._module is not None and isinstance(tensor, Tensor):
                guard._reject_managed(tensor)
            match = _describe_tensor(tensor) if tensor_at is not None else ""
            if arg_at is not None:
                value = _arg(args, kwargs, arg_at)
                match += f" {arg_at[1]}={_op_name(value) if arg_at[1] == 'op' else (0 if value is None else value)}"
            with _Guarded(guard, name, match.strip(), group):
                return fn(*args, **kwargs)

        guarded.__lightning_sync_guarded__ = True  # type: ignore[attr-defined]
        return guarded

    def guarded(self, op: str, match: str = "", group: Any = None) -> Any:
        """Context manager: check ``op`` across ranks, then run the block (nested collectives pass).

        Args:
            op: the collective's name as shown in errors.
            match: what must be identical on every rank (dtype, shape, reduce op ...).
            group: the process group the collective runs on (``None``: the world).
        """
        if not self.active or self._depth:
            return _NOTHING
        return _Guarded(self, op, match, group)

    def _collectives_hook(self, name: str, group: Any) -> None:
        if self._depth == 0:
            self.check(name, "", group, _skip=3)

    def _reject_managed(self, tensor: Tensor) -> None:
        module = self._module() if self._module is not None else None
        if module is None:
            return
        ptr = tensor.untyped_storage().data_ptr()
        for pname, param in module.named_parameters():
            if param.untyped_storage().data_ptr() == ptr:
                what = (f"parameter {pname!r}", "DDP broadcast rank 0's parameters when it wrapped the model and keeps "
                        "replicas identical by averaging gradients, so an all_reduce(SUM) of the weights multiplies "
                        f"them by the world size ({dist.get_world_size()})")
            elif param.grad is not None and param.grad.untyped_storage().data_ptr() == ptr:
                what = (f"the gradient of {pname!r}", "DDP already averaged it across ranks during backward, so an "
                        f"all_reduce(SUM) makes it {dist.get_world_size()} x the average gradient")
            else:
                continue
            error = LightningSyncError(
                f"rank {self._rank} at {self._site(2)}: dist.all_reduce of {what[0]}, which DistributedDataParallel "
                f"manages: {what[1]}. Remove the all_reduce (DDP does the synchronisation), or, if the tensor is "
                "meant to be synchronised by hand, exclude it from DDP (_ddp_params_and_buffers_to_ignore).")
            self._post_abort(str(error))
            raise error

    # ------------------------------------------------------------------ the check

    def _site(self, skip: int) -> str:
        """``file:line function`` of the innermost frame outside the libraries (+ Lightning hook)."""
        frame: Any = sys._getframe(skip + 1)
        lib = self._code_is_lib
        metric = None
        site = "?"
        while frame is not None:
            code = frame.f_code
            is_lib = lib.get(code)
            if is_lib is None:
                is_lib = lib[code] = (code.co_filename.startswith(self._lib_dirs)
                                      and code.co_filename not in _ENTRY_POINTS)
            if not is_lib:
                filename = code.co_filename
                if filename.startswith("<"):  # code rebuilt by cloudpickle (submitit): its module still knows
                    filename = str(frame.f_globals.get("__file__") or filename)
                site = f"{os.path.basename(filename)}:{frame.f_lineno} {code.co_name}"
                break
            if metric is None and code.co_name == "compute" and code.co_filename.endswith("result.py"):
                # Lightning syncing a logged metric: its name is what tells two epoch-end reductions apart
                meta = getattr(frame.f_locals.get("self"), "meta", None)
                metric = getattr(meta, "name", None)
            frame = frame.f_back
        hook = self.context() if self.context is not None else None
        if hook and not site.endswith(" " + hook):
            site += f" [{hook}]"
        if metric:
            site += f" (metric {metric!r})"
        return site

    def check(self, op: str, match: str = "", group: Any = None, _skip: int = 1) -> None:
        """Announce ``op`` and wait until every rank of ``group`` announced the same one.

        Every rank of ``group`` must call it; it blocks for at most ``timeout`` seconds.

        Raises:
            CollectiveMismatchError: on every rank, when ranks announced different collectives or
                call sites, or when a rank did not announce one within ``timeout``.
        """
        if group is None or group is dist.GroupMember.WORLD:
            key, ranks = "w", None
        else:
            if dist.distributed_c10d._rank_not_in_group(group):
                return
            ranks = dist.get_process_group_ranks(group)
            key = "g" + "_".join(map(str, ranks))
        store = self._store
        if store is None:
            return
        n = self._seq.get(key, 0)
        self._seq[key] = n + 1
        self.checks += 1
        site = self._site(_skip)
        record = f"{op}{_SEP}{match}{_SEP}{site}"
        rank = self._rank
        world = ranks if ranks is not None else range(dist.get_world_size())
        peers = [r for r in world if r != rank]
        if self.check_every > 1:
            self._check_sampled(key, n, record, peers, verify=op in ("barrier", _CLOSING))
            return
        store.set(f"{key}/{n}/{rank}", record)
        self.history.append(f"#{n} {op} {match} at {site}".replace("  ", " "))
        keys = [f"{key}/{n}/{r}" for r in peers]
        self._busy_since = time.monotonic()
        try:
            if not self._own_timeout:
                store.wait(keys, timedelta(seconds=self.timeout))
            values = store.multi_get(keys)
        except (RuntimeError, dist.DistError) as err:
            self._busy_since = None
            self._raise_missing(key, n, record, peers, err)
            values = store.multi_get(keys)  # every peer arrived just after the deadline
        if self._depth == 0:
            self._busy_since = None
        if n:
            store.delete_key(f"{key}/{n - 1}/{rank}")  # every peer has read it: they all posted round n
        records = {rank: record}
        records.update({r: v.decode() for r, v in zip(peers, values)})
        mine = record if self.match_call_sites else record.rsplit(_SEP, 1)[0]
        for r in peers:
            theirs = records[r] if self.match_call_sites else records[r].rsplit(_SEP, 1)[0]
            if theirs != mine:
                self._raise_mismatch(n, records)

    def _check_sampled(self, key: str, n: int, record: str, peers: list[int], verify: bool) -> None:
        store = self._store
        rank = self._rank
        # A ring of slots instead of one key per collective: nothing to delete (a round trip saved);
        # the value carries its sequence number, so a stale slot is recognised.
        store.set(f"{key}/s{n % self._ring}/{rank}", f"{n}{_RS}{record}")
        self.history.append(f"#{n} {record.replace(_SEP, ' ')}")
        self._current = (key, n, record, peers)
        pending = self._pending.setdefault(key, [])
        pending.append((n, record))
        if len(pending) < self.check_every and not verify:
            return
        self._pending[key] = []
        keys = [f"{key}/s{m % self._ring}/{r}" for m, _ in pending for r in peers]
        deadline = time.monotonic() + self.timeout
        pause = 5e-5
        self._busy_since = time.monotonic()
        try:
            while True:
                try:
                    if not self._own_timeout:
                        store.wait(keys, timedelta(seconds=max(0.001, deadline - time.monotonic())))
                    raw = store.multi_get(keys)
                except (RuntimeError, dist.DistError):
                    raw = None
                if raw is not None:
                    got = [v.decode().split(_RS, 1) for v in raw]
                    if all(int(seq) >= m for (seq, _), (m, _) in zip(got, [p for p in pending for _ in peers])):
                        break
                if time.monotonic() > deadline:
                    raise self._sampled_error(key, n, record, peers)
                time.sleep(pause)  # a peer is not there yet: poll, backing off to 2 ms
                pause = min(pause * 2, 2e-3)
        finally:
            if self._depth == 0:
                self._busy_since = None
        for i, (m, mine) in enumerate(pending):
            records = {rank: mine}
            for j, r in enumerate(peers):
                seq, theirs = got[i * len(peers) + j]
                records[r] = theirs if int(seq) == m else f"?{_SEP}{_SEP}(overwritten: rank is {int(seq) - m} ahead)"
            if any(self._comparable(v) != self._comparable(mine) for v in records.values()):
                late = f" (checked {n - m} collective(s) later: the results of the collectives since are unreliable)"
                self._raise_mismatch(m, records, note=late if n != m else "")

    def _comparable(self, record: str) -> str:
        return record if self.match_call_sites else record.rsplit(_SEP, 1)[0]

    def _sampled_error(self, key: str, n: int, record: str, peers: list[int]) -> CollectiveMismatchError:
        """Diagnose round ``n`` from the ring: who is missing, who announced something else."""
        store = self._watch_store if threading.current_thread() is self._watchdog else self._store
        records: dict[int, str] = {self._rank: record}
        missing = []
        for r in peers:
            slot = f"{key}/s{n % self._ring}/{r}"
            try:
                seq, theirs = (store.get(slot).decode().split(_RS, 1) if store.check([slot]) else ("-1", ""))
            except (RuntimeError, dist.DistError):
                seq, theirs = "-1", ""
            if int(seq) == n:
                records[r] = theirs
            else:
                missing.append(r)
        described = {r: self._format(v) for r, v in sorted(records.items())}
        if missing:
            described.update({r: "missing" for r in missing})
            text = (f"rank(s) {', '.join(map(str, missing))} did not reach collective #{n} within {self.timeout:g} s: "
                    + "; ".join(f"rank {r} {v}" for r, v in sorted(described.items()))
                    + ". Make every rank issue the same collectives (see each rank's stack on its stderr).")
        else:
            text = (f"ranks entered different collectives (collective #{n}): "
                    + "; ".join(f"rank {r} {v}" for r, v in sorted(described.items()))
                    + ". Every rank must issue the same collectives in the same order; look for a collective inside a "
                    "rank-dependent branch or a loop whose length differs across ranks.")
        return CollectiveMismatchError(text, described)

    @staticmethod
    def _format(record: str) -> str:
        op, match, site = record.split(_SEP)
        return f"at {site}: {op}{' ' + match if match else ''}"

    def _raise_mismatch(self, n: int, records: dict[int, str], note: str = "") -> None:
        described = {r: self._format(rec) for r, rec in sorted(records.items())}
        detail = "; ".join(f"rank {r} {text}" for r, text in described.items())
        same_op = len({rec.split(_SEP)[:2][0] for rec in records.values()}) == 1
        message = (
            f"ranks entered different collectives (guarded collective #{n}{note}): {detail}. "
            + ("The operation matches but the call sites differ: the ranks are at different points of the program, "
               "and the collective would combine unrelated values (e.g. different metrics logged with sync_dist=True). "
               if same_op else "")
            + "Every rank must issue the same collectives in the same order: look for a collective, "
            "self.log(..., sync_dist=True), trainer.save_checkpoint or strategy.barrier inside a rank-dependent branch "
            "(`if self.global_rank == 0:`, `if trainer.is_global_zero:`) or in a loop whose length differs across "
            "ranks, and move it where every rank runs it (log with rank_zero_only=True instead of sync_dist inside "
            "such branches). If different lines on purpose issue the same collective, use "
            "CollectiveGuard(match_call_sites=False)."
        )
        error = CollectiveMismatchError(message, described)
        self._post_abort(str(error))
        raise error

    def _raise_missing(self, key: str, n: int, record: str, peers: list[int], err: BaseException) -> None:
        store = self._store
        missing, arrived = [], {}
        for r in peers:
            try:
                if store.check([f"{key}/{n}/{r}"]):
                    arrived[r] = store.get(f"{key}/{n}/{r}").decode()
                    continue
            except (RuntimeError, dist.DistError):
                pass
            missing.append(r)
        if not missing:  # everyone arrived just after the deadline: carry on
            late = {self._rank: record, **arrived}
            if len({v if self.match_call_sites else v.rsplit(_SEP, 1)[0] for v in late.values()}) > 1:
                self._raise_mismatch(n, late)
            return
        parts = [f"rank {self._rank} {self._format(record)} (waited {self.timeout:g} s)"]
        parts += [f"rank {r} {self._format(v)}" for r, v in sorted(arrived.items())]
        values: dict[int, str] = {self._rank: self._format(record), **{r: self._format(v) for r, v in arrived.items()}}
        for r in missing:
            last = None
            try:
                if n and store.check([f"{key}/{n - 1}/{r}"]):
                    last = store.get(f"{key}/{n - 1}/{r}").decode()
            except (RuntimeError, dist.DistError):
                pass
            status = (f"never reached it; its last collective was #{n - 1} {self._format(last)} (which every rank "
                      "completed)") if last else ("never reached it and has issued no guarded collective yet" if n == 0
                                                  else "never reached it")
            parts.append(f"rank {r} {status}")
            values[r] = "missing"
        message = (
            f"rank(s) {', '.join(map(str, missing))} did not reach guarded collective #{n} within {self.timeout:g} s: "
            + "; ".join(parts)
            + ". The missing rank is either in a collective the others never enter (e.g. DDP's gradient all-reduce "
            "in backward while this rank runs a collective inside an `if rank == 0:` branch), finished early (fewer "
            "batches than the others), or working alone longer than the guard timeout. Make every rank issue the "
            "same collectives (see its stack on its stderr), or raise guard_timeout if one rank legitimately works "
            "alone that long."
        )
        error = CollectiveMismatchError(message, values)
        self._post_abort(str(error))
        raise error from err

    # ------------------------------------------------------------------ watchdog

    def _post_abort(self, message: str) -> None:
        store = self._store
        if store is None:
            return
        try:
            store.set(f"abort/{self._rank}", message)
        except (RuntimeError, dist.DistError):
            pass
        self._reported_abort = True  # this rank raises; it need not also dump on the others' behalf

    def _write(self, text: str, stack: bool) -> None:
        stream = self.stream or sys.stderr
        try:
            stream.write(text)
            if self.history:
                stream.write(f"[lightning_sync guard] rank {self._rank}: its last collectives:\n  "
                             + "\n  ".join(self.history) + "\n")
            if stack:
                stream.write(f"[lightning_sync guard] rank {self._rank}: Python stacks of every thread:\n")
                stream.flush()
                faulthandler.dump_traceback(file=stream, all_threads=True)
            stream.flush()
        except (OSError, ValueError):
            pass

    def _watch(self) -> None:
        store = self._watch_store
        abort_keys = [f"abort/{r}" for r in range(dist.get_world_size()) if r != self._rank]
        while not self._stop.wait(1.0):
            busy = self._busy_since
            if (self.check_every > 1 and busy is not None and self._current is not None
                    and time.monotonic() - busy > self.timeout):
                key, n, record, peers = self._current
                try:
                    error = self._sampled_error(key, n, record, peers)
                except Exception:  # noqa: BLE001 - the store may be gone; nothing to diagnose with
                    error = None
                if error is not None and "missing" not in error.values.values() and "different" not in str(error):
                    error = None  # everyone is in this collective: slow, not mismatched
                if error is not None:
                    self._post_abort(str(error))
                    self._write(f"[lightning_sync guard] rank {self._rank}: CollectiveMismatchError: {error}\n"
                                "[lightning_sync guard] this rank is blocked inside the collective, where Python "
                                "cannot raise; ending the process (exit code 70).\n", stack=True)
                    os._exit(70)
            if busy is not None and time.monotonic() - busy > self.hang_timeout and self._dumped_for != busy:
                self._dumped_for = busy
                self._write(f"[lightning_sync guard] rank {self._rank}: a collective has not finished after "
                            f"{self.hang_timeout:g} s: {self.history[-1] if self.history else '?'}\n", stack=True)
            if self._reported_abort or store is None:
                continue
            try:
                for key in abort_keys:
                    if store.check([key]):
                        message = store.get(key).decode()
                        self._reported_abort = True
                        self._write(f"[lightning_sync guard] rank {self._rank}: {key.split('/')[1] and 'rank ' + key.split('/')[1]} "
                                    f"raised CollectiveMismatchError: {message}\n[lightning_sync guard] rank "
                                    f"{self._rank} stands here:\n", stack=True)
                        break
            except (RuntimeError, dist.DistError):
                return  # the store is gone (process group destroyed): nothing left to watch


def configure_nccl_flight_recorder(env: MutableMapping[str, str] | None = None,
                                   directory: str | None = None) -> dict[str, str]:
    """Turn on torch's NCCL flight recorder so a collective timeout leaves a per-rank dump.

    Must run before the NCCL process group is created. Values already set by the user are kept.
    The dumps go to ``directory``, by default a fresh private directory (``tempfile.mkdtemp``, mode
    0700, ``$TMPDIR/lightning_sync_nccl_*``): a predictable name in a shared ``/tmp`` would let
    another user pre-create or link the dump files.

    Returns:
        The variables it set.
    """
    if env is None:
        env = os.environ
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # entries per rank: the last collectives and their state
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env:  # create the private directory only when it is used
        directory = directory or tempfile.mkdtemp(prefix="lightning_sync_nccl_")
        wanted["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = os.path.join(directory, "nccl_trace_rank_")
    done = {}
    for name, value in wanted.items():
        if name not in env:
            env[name] = value
            done[name] = value
    return done


def parameter_checksums(module: torch.nn.Module, buffers: bool = True,
                        skip: set[str] | None = None) -> Iterator[tuple[str, float]]:
    """``(name, checksum)`` per parameter (and buffer): the float64 sum plus an index-weighted sum.

    The weighted term makes permutations of the same values visible; both are exact for identical
    tensors, so replicas must agree bit for bit.
    """
    named: list[tuple[str, Tensor]] = list(module.named_parameters())
    if buffers:
        named += list(module.named_buffers())
    for name, tensor in named:
        if skip and name in skip:
            continue
        flat = tensor.detach().reshape(-1).to(torch.float64)
        if flat.numel() == 0:
            yield name, 0.0
            continue
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device).remainder_(7919)
        yield name, float(flat.sum()) + float((flat * weights).sum()) * 1e-3
