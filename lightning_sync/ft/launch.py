"""``lsync-ft-run``: torchft's lighthouse, R replica groups, and a restart for a group that dies.

    lsync-ft-run --replicas R [--min-replicas M] [--max-restarts K] [--nproc-per-replica P]
                 [--lighthouse HOST:PORT] [--host ADDR] [--group G] [--stopped-timeout S] -- CMD ...

Without ``--lighthouse`` a lighthouse is started in this process, bound to ``--host`` (127.0.0.1 by default:
one machine); with it, the groups join that one (a lighthouse shared by several machines). ``--group G`` (with
``--lighthouse``) starts group ``G`` of the ``R`` only: one ``lsync-ft-run`` per machine, e.g. one SLURM step per
group (``recipes/launch_slurm_ft.sbatch``). Each group runs
``CMD`` (``P > 1``: under ``torchrun --nproc-per-node P``) in a session of its own with ``REPLICA_GROUP_ID``,
``NUM_REPLICA_GROUPS``, ``TORCHFT_LIGHTHOUSE``, ``LSYNC_FT_RESTART`` (0 in its first life, then 1, 2, ...),
``LSYNC_FT_HOST``, a ``MASTER_ADDR``/``MASTER_PORT`` of its own, and (unless set) ``OMP_NUM_THREADS``: the
machine's cores divided among the processes started here, as Lightning's launcher divides them among its ranks. A group that exits non-zero (or is
killed) is started again, up to ``K`` times, while the others go on training; torchft's quorum lets it back in
and heals it from a live peer. A group frozen by SIGSTOP (a process of it stopped for ``S`` seconds,
60 by default) is ended and started again the same way: the others dropped it from their quorum long before
(torchft's timeout and the lighthouse's heartbeat timeout), and it would otherwise keep the run from ending. The command exits 0 when every group finished with 0, else 1 naming each group
that failed for good and its last cause. SIGINT/SIGTERM end every group (its whole session) and the lighthouse.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from lightning_sync.guard.report import first_line

__all__ = ["main"]

POLL_S = 0.2


@dataclass
class _Group:
    index: int
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    causes: list[str] = field(default_factory=list)
    done: bool = False
    failed: bool = False
    fatal: str = ""  # the set-up error it reported, if any
    stopped_since: float | None = None  # when a process of it was first seen stopped (SIGSTOP)
    frozen: str = ""  # why lsync-ft-run ended it, if it did (frozen)
    life: _Life | None = None  # its current life's standard error, as read so far
    reader: threading.Thread | None = None  # copies that standard error to ours


@dataclass
class _Life:
    """One life of a group: the last exception line it printed, and under torchrun each rank's and the rank whose
    failure torchrun observed first (only the group's own reader thread writes here)."""

    last_error: str = ""
    rank_errors: dict[int, str] = field(default_factory=dict)
    unprefixed_error: str = ""  # the last one without torchrun's ``[rankN]:`` (raised before the process group)
    first_failure: tuple[int, int] | None = None  # torchrun's root cause: (rank, exit code; negative: a signal)
    _root: dict[str, int] | None = None  # torchrun's root-cause block, as it is read (None: not in one)

    def cause(self) -> str:
        """What ended this life, as read from its standard error ("" where nothing was): the failure torchrun
        observed first (a rank killed by a signal, or that rank's own exception), else the last exception line."""
        if self.first_failure is None:
            return self.last_error
        rank, code = self.first_failure
        if code < 0:
            return f"its rank {rank} was {_cause(code)} first"
        own = self.rank_errors.get(rank) or self.unprefixed_error
        return f"its rank {rank} failed first ({_cause(code)}{': ' + own if own else ''})"

    def read(self, line: str) -> None:
        """Take one line of the group's standard error."""
        match = _ERROR_LINE.match(line)
        if match and not any(name in match.group(2) for name in _NOT_A_CAUSE):
            self.last_error = first_line(match.group(2), limit=300)  # (cut at a word, marked)
            if match.group(1) is not None:
                self.rank_errors[int(match.group(1))] = self.last_error
            else:
                self.unprefixed_error = self.last_error
        if "Root Cause (first observed failure)" in line:
            self._root = {}
            return
        found = _ROOT_FIELD.match(line)
        if found is not None and self._root is not None and self.first_failure is None:
            self._root[found.group(1)] = int(found.group(2))
            if "exitcode" in self._root and "rank" in self._root:
                self.first_failure = (self._root["rank"], self._root["exitcode"])


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _fatal(directory: str, group: int) -> str:
    """The set-up error group ``group`` reported before it ended (``lightning_sync.ft.report_fatal``), or ''."""
    try:
        with open(os.path.join(directory, f"group{group}")) as f:
            return f.read().strip()
    except OSError:
        return ""


def _cause(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lsync-ft-run", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--replicas", type=int, required=True, help="replica groups to start (R)")
    p.add_argument("--min-replicas", type=int, default=1, help="the fewest live groups a step may commit with")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts of each group before it counts as failed")
    p.add_argument("--nproc-per-replica", type=int, default=1, help="processes of each group (P > 1: torchrun)")
    p.add_argument("--lighthouse", default=None, help="HOST:PORT of a running lighthouse (default: start one)")
    p.add_argument("--host", default="127.0.0.1", help="address the lighthouse and the groups' servers bind to")
    p.add_argument("--group", type=int, default=None,
                   help="start only replica group G of the R (with --lighthouse): one lsync-ft-run per machine")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5000,
                   help="lighthouse: a group silent this long is out of the quorum")
    p.add_argument("--join-timeout-ms", type=int, default=10000,
                   help="lighthouse: how long a quorum waits for groups still sending heartbeats")
    p.add_argument("--stopped-timeout", type=float, default=60.0,
                   help="seconds a group's process may stay stopped (SIGSTOP) before the group is ended and "
                        "restarted (0: never; Linux only)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...: the training command of every group")
    return p


def _start_lighthouse(args: argparse.Namespace) -> tuple[Any, str]:
    from lightning_sync.ft import require_torchft

    require_torchft()
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"{args.host}:0", min_replicas=args.min_replicas,
                              join_timeout_ms=args.join_timeout_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    port = str(server.address()).rstrip("/").rsplit(":", 1)[-1]  # address() names the hostname: use our host
    return server, f"http://{args.host}:{port}"


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _spawn(group: _Group, args: argparse.Namespace, lighthouse: str) -> None:
    port = _free_port(args.host)
    env = dict(os.environ, REPLICA_GROUP_ID=str(group.index), NUM_REPLICA_GROUPS=str(args.replicas),
               TORCHFT_LIGHTHOUSE=lighthouse, LSYNC_FT_RESTART=str(group.restarts), LSYNC_FT_HOST=args.host,
               LSYNC_FT_MIN_REPLICAS=str(args.min_replicas), MASTER_ADDR=args.host, MASTER_PORT=str(port),
               LSYNC_FT_FATAL=os.path.join(args.fatal_dir, f"group{group.index}"),
               LSYNC_FT_FINISHED=args.finished)
    if "OMP_NUM_THREADS" not in env:
        # the machine's cores shared by the processes started here, as Lightning's launcher shares them between
        # the ranks it starts (and as a one-machine ddp run of the same ranks computes: same threads, same sums)
        env["OMP_NUM_THREADS"] = str(max(1, _cpus() // args.local_processes))
    if args.host in ("127.0.0.1", "localhost") and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's pairs on loopback, whatever the hostname resolves to
    command = list(args.command)
    if args.nproc_per_replica > 1:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc_per_replica}",
                   "--rdzv-backend=static", f"--master-addr={args.host}", f"--master-port={port}", "--node-rank=0",
                   "--nnodes=1", "--no-python", *command]  # (CMD is a command: python train.py, not a script)
    group.process = subprocess.Popen(command, env=env, start_new_session=True, stderr=subprocess.PIPE)
    group.life = _Life()
    reader = threading.Thread(target=_pass_stderr, args=(group.life, group.process.stderr), daemon=True,
                              name=f"lsync-ft-run group {group.index} stderr")
    reader.start()
    group.reader = reader


def _end_life(group: _Group) -> None:
    """After a group's process ended: end what is left of that life (its DataLoader workers, ranks it started in
    its process group) and read its standard error to the end."""
    if group.process is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group.process.pid, signal.SIGKILL)
    if group.reader is not None:
        group.reader.join(timeout=5)


#: the last line of a Python traceback: ``Type: message`` (behind torchrun's ``[rankN]:`` prefix)
_ERROR_LINE = re.compile(r"^(?:\[rank(\d+)\]: (?=\S))?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)"
                         r"(?::.*)?)$")


#: exception lines that are not a group's cause: torchrun's summary of a rank's failure (the rank's own error came
#: before it), a write to a pipe closed meanwhile
_NOT_A_CAUSE = ("ChildFailedError", "BrokenPipeError")
#: a field of torchrun's summary of a failed rank (``rank      : 1 (local_rank: 1)``, ``exitcode  : -9 (pid: 42)``)
_ROOT_FIELD = re.compile(r"^\s*(rank|exitcode)\s*:\s*(-?\d+)\b")


def _pass_stderr(life: _Life, stream: Any) -> None:
    """Copy a group's standard error to ours as it comes, keeping its last exception line (``Type: message``) for
    the summary: a group's cause is then its error, not only its exit code. Our own standard error failing (a
    closed pipe, the interpreter's shutdown) does not stop the copy: the group's pipe is drained to its end, so
    the group never blocks writing to it."""
    out = getattr(sys.stderr, "buffer", None)
    for raw in iter(stream.readline, b""):
        try:
            if out is not None:
                out.write(raw)
                out.flush()
            else:
                sys.stderr.write(raw.decode("utf-8", "replace"))
                sys.stderr.flush()
        except (OSError, ValueError):
            pass
        life.read(raw.decode("utf-8", "replace").rstrip())
    stream.close()


def _process_table() -> dict[int, tuple[int, bytes]] | None:
    """Every process's ``pid: (parent pid, state)`` (one read of ``/proc``), or None without ``/proc`` (not Linux)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    table: dict[int, tuple[int, bytes]] = {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # ended meanwhile
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        if len(fields) > 1:
            table[int(entry)] = (int(fields[1]), fields[0])
    return table


def _tree(root: int, table: dict[int, tuple[int, bytes]]) -> list[int]:
    """``root`` and its descendants (torchrun starts each rank in a session of its own: by parent, not session)."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            tree.append(pid)
            todo.extend(children.get(pid, ()))
    return tree


def _watch_frozen(groups: list[_Group], args: argparse.Namespace) -> None:
    """End a group of which a process stayed stopped ``--stopped-timeout`` seconds (SIGSTOP, SIGTSTP: ``T`` in
    ``/proc``; not ``t``, a debugger's tracing stop), with every process of it (SIGKILL ends a stopped process);
    the loop then sees it ended and restarts it as after any failure. One read of ``/proc`` for every group."""
    running = [g for g in groups if g.process is not None and not (g.frozen or g.done or g.failed)
               and g.process.poll() is None]
    table = _process_table() if args.stopped_timeout > 0 and running else None
    if table is None:
        return
    for group in running:
        assert group.process is not None
        tree = _tree(group.process.pid, table)
        _frozen_or_not(group, args, next((pid for pid in tree if table[pid][1] == b"T"), None), tree)


def _frozen_or_not(group: _Group, args: argparse.Namespace, pid: int | None, tree: list[int]) -> None:
    assert group.process is not None
    now = time.monotonic()
    if pid is None:
        if group.stopped_since is not None:
            print(f"lsync-ft-run: replica group {group.index} continues", file=sys.stderr, flush=True)
        group.stopped_since = None
        return
    if group.stopped_since is None:
        group.stopped_since = now
        print(f"lsync-ft-run: replica group {group.index} is stopped (process {pid}, SIGSTOP); the others wait for "
              "it up to torchft's timeout in a collective they share with it, then train without it; it is ended "
              f"and restarted in {args.stopped_timeout:g} s unless it continues (--stopped-timeout)",
              file=sys.stderr, flush=True)
    elif now - group.stopped_since >= args.stopped_timeout:
        group.frozen = f"stopped (SIGSTOP) for {now - group.stopped_since:.0f} s, ended by lsync-ft-run"
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group.process.pid, signal.SIGKILL)
        for other in tree:  # (torchrun's ranks, in sessions of their own)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(other, signal.SIGKILL)


def _end_below_min_replicas(groups: list[_Group], args: argparse.Namespace) -> None:
    """Where this lsync-ft-run starts every group: once fewer groups than ``--min-replicas`` are left (those that
    failed for good are out), no step can commit again; end the others instead of letting them wait for a quorum
    (three ``quorum_timeout`` s, then an error)."""
    left = [g for g in groups if not (g.failed or g.done)]
    if args.group is not None or not left or any(g.done for g in groups) or len(left) >= args.min_replicas:
        return
    print(f"lsync-ft-run: {len(left)} replica group(s) left, fewer than --min-replicas {args.min_replicas}: no step "
          "can commit any more; ending the run", file=sys.stderr, flush=True)
    for g in left:
        g.failed = True
        g.causes.append(f"ended by lsync-ft-run: fewer than --min-replicas {args.min_replicas} groups left")

def _stop(groups: list[_Group]) -> None:
    for group in groups:
        if group.process is not None and group.process.poll() is None:
            try:
                os.killpg(group.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    for group in groups:
        if group.process is None:
            continue
        try:
            group.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(group.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            group.process.wait()


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("give the training command after --, e.g. lsync-ft-run --replicas 2 -- python train.py")
    for name in ("replicas", "nproc_per_replica", "min_replicas"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}.")
    if args.min_replicas > args.replicas:
        parser.error(f"--min-replicas {args.min_replicas} is more than --replicas {args.replicas}: no step could "
                     "ever commit.")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0; got {args.max_restarts}.")
    if args.group is not None and not 0 <= args.group < args.replicas:
        parser.error(f"--group {args.group}: a replica group is 0 .. {args.replicas - 1} (--replicas {args.replicas}).")
    if args.group is not None and not args.lighthouse:
        parser.error(f"--group {args.group} starts one group of {args.replicas}: give the lighthouse the others join "
                     "too, --lighthouse HOST:PORT (torchft_lighthouse --bind HOST:PORT on one machine).")
    # torchft's Rust side (the lighthouse here, each group's manager) logs every quorum at INFO: about 25 lines a
    # step for 3 groups. Its warnings and errors only, unless the user asks for more (RUST_LOG=info).
    os.environ.setdefault("RUST_LOG", "warn")
    if not args.lighthouse:
        # the run's key, the same in every group (each refuses to write where another group of the run writes);
        # with --lighthouse (one lsync-ft-run per machine) the key is the lighthouse's address, which they share
        os.environ.setdefault("LSYNC_FT_RUN_ID", uuid.uuid4().hex)
    server = None
    if args.lighthouse:
        lighthouse = args.lighthouse if "://" in args.lighthouse else f"http://{args.lighthouse}"
    else:
        server, lighthouse = _start_lighthouse(args)
    indices = range(args.replicas) if args.group is None else [args.group]
    which = f"{args.replicas} replica groups" if args.group is None else f"replica group {args.group} of {args.replicas}"
    print(f"lsync-ft-run: lighthouse {lighthouse}; {which} of {args.nproc_per_replica} "
          f"process(es), up to {args.max_restarts} restarts each", file=sys.stderr, flush=True)
    groups = [_Group(i) for i in indices]
    args.local_processes = len(groups) * args.nproc_per_replica
    args.fatal_dir = tempfile.mkdtemp(prefix="lsync_ft_")  # a group's set-up error, written by report_fatal
    args.finished = os.path.join(args.fatal_dir, "finished")  # created once a group finished (ft.run_finished)
    stopping: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        stopping.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for group in groups:
            _spawn(group, args, lighthouse)
        looked = time.monotonic()
        while not stopping and not all(g.done or g.failed for g in groups):
            time.sleep(POLL_S)
            if time.monotonic() - looked >= 1.0:  # (a look at /proc a second: a few ms)
                looked = time.monotonic()
                _watch_frozen(groups, args)
            for group in groups:
                if group.done or group.failed or group.process is None:
                    continue
                code = group.process.poll()
                if code is None:
                    continue
                if code == 0:
                    if group.reader is not None:
                        group.reader.join(timeout=5)  # its last lines, before the summary
                    group.done = True
                    # a restarted group waiting for a live one to recover from stops waiting (ft.run_finished)
                    with open(args.finished, "w"):
                        pass
                    continue
                _end_life(group)  # its leftovers ended, its last lines read before its cause is named
                fatal = _fatal(args.fatal_dir, group.index)  # (a set-up error: quoted whole in the summary)
                cause = group.frozen or _cause(code)
                last_error = group.life.cause() if group.life is not None else ""
                if last_error and not (group.frozen or fatal):
                    cause += f": {last_error}"
                group.causes.append(cause)
                group.frozen, group.stopped_since = "", None
                finished = [g.index for g in groups if g.done]
                if fatal:  # a set-up error: every life would meet it again, and the others would train without it
                    group.failed, group.fatal = True, fatal
                    group.causes[-1] += " (a set-up error)"
                    print(f"lsync-ft-run: replica group {group.index} stopped for a set-up error, not restarted; "
                          f"ending the run: {fatal}", file=sys.stderr, flush=True)
                    for other in groups:  # (ended below, with every group, once the loop sees all of them over)
                        if not (other.done or other.failed):
                            other.failed = True
                            other.causes.append("ended by lsync-ft-run after another group's set-up error")
                elif finished:  # the run is over in those groups: a restart would have no live peer to heal from
                    group.failed = True
                    print(f"lsync-ft-run: replica group {group.index} ended ({group.causes[-1]}) after group "
                          f"{finished[0]} finished the run (its training is complete there); not restarted (no live "
                          "peer to heal from)", file=sys.stderr, flush=True)
                elif group.restarts < args.max_restarts:
                    group.restarts += 1
                    print(f"lsync-ft-run: replica group {group.index} ended ({group.causes[-1]}); restarting it "
                          f"(restart {group.restarts} of {args.max_restarts}); the others go on",
                          file=sys.stderr, flush=True)
                    _spawn(group, args, lighthouse)
                else:
                    group.failed = True
                    print(f"lsync-ft-run: replica group {group.index} ended ({group.causes[-1]}) with no restart "
                          f"left ({args.max_restarts} used); the others go on", file=sys.stderr, flush=True)
                    _end_below_min_replicas(groups, args)
    finally:
        _stop(groups)
        for group in groups:
            if group.reader is not None:
                group.reader.join(timeout=2)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if server is not None:
            server.shutdown()
        shutil.rmtree(args.fatal_dir, ignore_errors=True)
    if stopping:
        print(f"lsync-ft-run: stopped by {signal.Signals(stopping[0]).name}; every group ended", file=sys.stderr)
        return 128 + stopping[0]
    failed = [g for g in groups if g.failed]
    if failed:
        for g in failed:
            print(f"lsync-ft-run: replica group {g.index} failed: {g.causes[-1]} after {g.restarts} restart(s) "
                  f"(causes in order: {', '.join(g.causes)})" + (f": {g.fatal}" if g.fatal else ""), file=sys.stderr)
        return 1
    restarted = [g for g in groups if g.restarts]
    print(f"lsync-ft-run: all {len(groups)} replica group{'s' if len(groups) > 1 else ''} finished"
          + (f"; restarted: {', '.join(f'group {g.index} x{g.restarts}' for g in restarted)}" if restarted else ""),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
