"""Run a function on N real gloo ranks, in separate processes, with a hard timeout.

    results = run_ranks(fn, world_size=2, args=(...))   # fn(rank, world_size, *args) -> picklable

Each rank is a fresh process, forked from a forkserver that has imported torch and lightning_sync
(with Lightning and torchmetrics) once: ~0.1 s a rank instead of the ~6 s of CPU a fresh import takes
here, which made most of the fast tier's time. Each rank then joins a gloo group through a
``file://`` rendezvous, runs ``fn`` and returns its result. A rank that raises has its traceback
shown in the parent's error; a rank that does not finish within ``timeout`` seconds is killed, and
the error says which ranks were still running.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "lightning_sync"])
    return _CTX


class RankFailure(AssertionError):
    """One or more ranks raised or timed out; the message holds their tracebacks."""

    def __init__(self, message: str, errors: dict[int, str]) -> None:
        super().__init__(message)
        self.errors = errors


def _stacks_file(tmp: str, rank: int) -> str:
    return os.path.join(tmp, f"rank{rank}.stacks")


def _entry(fn: Callable[..., Any], rank: int, world_size: int, init_file: str, args: Sequence[Any],
           pg_timeout: float, queue: Any, init: bool, backend: str = "gloo", stacks_after: float = 0.0) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if stacks_after > 0:  # a rank still running just before the parent kills it shows where it stood
        import faulthandler

        stacks = open(_stacks_file(os.path.dirname(init_file), rank), "w")  # noqa: SIM115 - open until exit
        faulthandler.dump_traceback_later(stacks_after, file=stacks)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if init:
            kwargs: dict[str, Any] = {}
            if backend == "nccl":  # one GPU per rank (NCCL refuses two ranks on one GPU)
                device = torch.device("cuda", rank % torch.cuda.device_count())
                torch.cuda.set_device(device)
                kwargs["device_id"] = device
            dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout), **kwargs)
        try:
            result = fn(rank, world_size, *args)
        finally:
            if init and dist.is_initialized():
                dist.destroy_process_group()
        # plain pickle: torch's queue reducers would share tensor memory with a process about to exit
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException as err:  # noqa: BLE001 - everything must reach the parent
        queue.put((rank, False, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


def run_ranks(fn: Callable[..., Any], world_size: int = 2, args: Sequence[Any] = (), timeout: float = 60.0,
              pg_timeout: float = 30.0, init: bool = True, expect_failure: bool = False, failure_grace: float = 5.0,
              backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results in rank order.

    Args:
        fn: a module-level function (it is pickled by reference).
        timeout: hard limit in seconds for the whole group; ranks still running are killed.
        pg_timeout: the process group's own timeout.
        init: join a process group before calling ``fn`` (and destroy it after).
        backend: that group's backend; ``"nccl"`` puts rank ``r`` on GPU ``r % device_count``.
        expect_failure: return the per-rank outcomes ``(ok, result_or_traceback)`` instead of raising.
        failure_grace: once a rank has failed (and failure is not expected), how long the others
            get before they are killed.

    Raises:
        RankFailure: a rank raised, died or timed out (unless ``expect_failure``).
    """
    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        stacks_after = max(1.0, timeout - 2.0)
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, init_file, args, pg_timeout, queue, init, backend,
                                                  stacks_after), daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        outcomes: dict[int, tuple[bool, Any]] = {}
        import queue as queue_mod
        import time

        deadline = time.monotonic() + timeout
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 0.5))
                outcomes[rank] = (ok, payload)
                if not ok and not expect_failure:  # peers are likely stuck in a collective now
                    deadline = min(deadline, time.monotonic() + failure_grace)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    time.sleep(0.2)
                    if queue.empty():
                        break
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())) if len(outcomes) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join(5)
        for r, p in enumerate(procs):
            if r not in outcomes:
                reason = (f"timed out after {timeout:.0f} s (killed)" if p.exitcode in (None, -9)
                          and time.monotonic() >= deadline else f"died with exit code {p.exitcode}")
                try:
                    with open(_stacks_file(tmp, r)) as f:
                        stacks = f.read().strip()
                except OSError:
                    stacks = ""
                if stacks:
                    reason += f"; its Python stacks {stacks_after:.0f} s in:\n{stacks}"
                outcomes[r] = (False, reason)
    outcomes = {r: (ok, pickle.loads(payload) if ok else payload) for r, (ok, payload) in outcomes.items()}
    if expect_failure:
        return [outcomes[r] for r in range(world_size)]
    errors = {r: payload for r, (ok, payload) in outcomes.items() if not ok}
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items()))
        raise RankFailure(f"{len(errors)} of {world_size} ranks failed:\n{text}", errors)
    return [outcomes[r][1] for r in range(world_size)]
