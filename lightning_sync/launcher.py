"""``HydraDDPLauncher``: Lightning's subprocess launcher, made safe for Hydra runs and multiruns.

Lightning's own launcher re-runs ``sys.argv`` for ranks > 0. Under ``-m`` that child re-runs the
whole sweep, the next job spawns nothing (``LOCAL_RANK`` is left in the environment) and reuses the
old process group, and rank 1 writes to another directory (docs/multinode.md). Here, per Hydra job:

- rank > 0 replays only this job's overrides (``hydra.overrides.task``) in RUN mode, with
  ``hydra.run.dir`` set to the job's resolved output directory: every rank writes there, and
  ``${now:...}`` in the directory name is resolved once, by rank 0;
- ``hydra.output_subdir=null`` for rank > 0: ``.hydra/`` is written once;
- each job gets a free ``MASTER_PORT`` and a fresh process group (the strategy destroys it at teardown);
- :func:`finish_job` (called by ``lsync-train`` at the end of its task, and by the next launch as a
  safety net) reaps the job's ranks and restores the environment, so no process outlives its job.

Ranks started externally (torchrun, srun, submitit on SLURM) are left alone, as in Lightning.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from typing_extensions import override

from lightning_sync._compat import lightning_api as _compat
from lightning_sync._compat.torch_api import raise_group_count

__all__ = ["ENTRY_MODULE_ENV", "HydraDDPLauncher", "finish_job", "hydra_active", "mark_job_failed", "rank_command"]

log = logging.getLogger(__name__)

#: Names the module to run for rank > 0 (``python -m MODULE``). ``lsync-train`` sets it, so ranks are
#: started right even where ``__main__`` is someone else's (submitit's job runner).
ENTRY_MODULE_ENV = "LSYNC_HYDRA_MODULE"
# What Lightning's launch writes into os.environ; restored when the job ends.
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "LSYNC_GLOBAL_RANK")
# Hydra overrides a RUN-mode replay must not inherit from the sweep (or sets itself).
_NOT_REPLAYED = ("hydra.mode", "hydra.run.dir", "hydra.output_subdir", "hydra.sweep.", "hydra/launcher",
                 "hydra.launcher.", "hydra/sweeper", "hydra.sweeper.", "hydra.job.num", "hydra.job.id")


def hydra_active() -> bool:
    """True inside a Hydra job that ``@hydra.main`` (or a Hydra launcher) started: the only kind whose
    command line the other ranks can replay. A config set by Hydra's compose API
    (``HydraConfig().set_config(cfg)`` in a test or a notebook) has no job directory
    (``hydra.runtime.output_dir`` is missing): Lightning's own launcher runs it, as under ``ddp``."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf
    except ImportError:
        return False
    if not HydraConfig.initialized():
        return False
    runtime: Any = getattr(HydraConfig.get(), "runtime", None)
    return runtime is not None and not OmegaConf.is_missing(runtime, "output_dir") and bool(runtime.output_dir)


def _quote(value: str) -> str:
    # Hydra's override grammar: a double-quoted string takes any path; escape what would end it.
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def rank_command(local_rank: int) -> tuple[list[str], str, str]:
    """The command, working directory and output directory that replay the current Hydra job for
    ``local_rank``."""
    from hydra.core.hydra_config import HydraConfig

    import __main__

    hc = HydraConfig.get()
    module = os.environ.get(ENTRY_MODULE_ENV)
    if module:
        command = [sys.executable, "-m", module]
    elif getattr(__main__, "__spec__", None) is not None:
        command = [sys.executable, "-m", __main__.__spec__.name]  # type: ignore[union-attr]
    else:
        command = [sys.executable, os.path.join(hc.runtime.cwd, sys.argv[0])]
    output_dir = str(hc.runtime.output_dir)
    replayed = [o for o in hc.overrides.hydra if not str(o).startswith(_NOT_REPLAYED)]
    command += [*hc.overrides.task, *replayed, f"hydra.run.dir={_quote(output_dir)}", "hydra.output_subdir=null"]
    return command, str(hc.runtime.cwd), output_dir


@dataclass
class _Job:
    output_dir: str
    procs: list[subprocess.Popen[bytes]]
    saved_env: dict[str, str | None] = field(default_factory=dict)
    #: the list Lightning's process observer watches (the launcher's ``procs``): emptied before the ranks
    #: are reaped here, or the observer would SIGKILL this process, and the rest of a sweep with it
    observed: list[subprocess.Popen[bytes]] = field(default_factory=list)
    failed: bool = False  #: rank 0 raised in this job (mark_job_failed)


_active: _Job | None = None  # the job whose ranks this process started and has not reaped yet


def mark_job_failed() -> None:
    """Rank 0's trainer call raised: when the job's ranks are reaped (``finish_job``, or the next job's launch)
    they get 10 s, then are killed, and the sweep goes on with its next job (as under Lightning's ``ddp``)."""
    if _active is not None:
        _active.failed = True


def finish_job(timeout: float = 120.0, failed: bool = False) -> None:
    """Waits for the ranks this process started for the current job, then restores the environment.

    Call it on rank 0 when the job's work is done (every rank may call it; it is a no-op where
    nothing was started). With ``failed=True`` the ranks get 10 s, then are killed.

    Raises:
        RuntimeError: a rank exited non-zero or had to be killed.
    """
    global _active
    job, _active = _active, None
    if job is None:
        return
    failed = failed or job.failed
    job.observed.clear()  # this process reaps the ranks now: Lightning's observer stops at its next turn
    problems = []
    try:
        for rank, proc in enumerate(job.procs, start=1):
            try:
                rc = proc.wait(timeout=10 if failed else timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
                problems.append(f"local rank {rank} (pid {proc.pid}) did not exit and was killed")
                continue
            if rc != 0:
                problems.append(f"local rank {rank} (pid {proc.pid}) exited with {rc}")
    finally:
        for key, value in job.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if problems and not failed:
        raise RuntimeError(f"job {job.output_dir}: " + "; ".join(problems))


class HydraDDPLauncher(_compat.SubprocessScriptLauncher):
    """Starts ranks > 0 of the current Hydra job (see the module docstring)."""

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        global _active
        if _active is not None and _active.output_dir != _current_output_dir():
            finish_job()  # a job that ended without finish_job(): reap it before starting the next (after a
            # failure on rank 0, mark_job_failed: its ranks are killed after 10 s and nothing is raised)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if self.cluster_environment.creates_processes_externally:
            if "LSYNC_GLOBAL_RANK" not in os.environ:  # ranks of torchrun/srun, not ours
                _number_process_groups_on()
        else:
            saved = {key: os.environ.get(key) for key in _LAUNCH_ENV}
            self._call_children_scripts()
            _active = _Job(_current_output_dir(), list(self.procs), saved, observed=self.procs)
            _compat.launch_process_observer(self.procs)
        _compat.set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    @override
    def _call_children_scripts(self) -> None:  # compat: the base class's hook (_compat.TOUCH_POINTS)
        _compat.check_can_spawn_children(self)
        self.procs = []
        env = self.cluster_environment
        node_rank = env.node_rank()
        os.environ.update(MASTER_ADDR=env.main_address, MASTER_PORT=str(env.main_port), NODE_RANK=str(node_rank),
                          LOCAL_RANK=str(env.local_rank()), WORLD_SIZE=str(self.num_processes * self.num_nodes),
                          LSYNC_GLOBAL_RANK=str(node_rank * self.num_processes))
        for local_rank in range(1, self.num_processes):
            command, cwd, output_dir = rank_command(local_rank)
            child_env = dict(os.environ, LOCAL_RANK=str(local_rank),
                             LSYNC_GLOBAL_RANK=str(node_rank * self.num_processes + local_rank))
            if os.environ.get("PL_GLOBAL_SEED") is None:
                child_env.pop("PL_GLOBAL_SEED", None)
            log.debug("starting local rank %d in %s: %s", local_rank, output_dir, command)
            self.procs.append(subprocess.Popen(command, env=child_env, cwd=cwd, preexec_fn=_die_with_parent))


def _die_with_parent() -> None:
    # Runs in the child before exec: if rank 0 is killed (timeout, OOM, SIGKILL from Lightning's
    # observer), its ranks go too instead of waiting 30 min in a collective. Linux only.
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


_launches = 0


def _number_process_groups_on() -> None:
    # torchrun's workers rendezvous through the agent's store on every init, and
    # destroy_process_group() resets torch's group counter: the next job's default group would reuse
    # the previous one's store keys and dial dead peers ("Gloo connectFullMesh failed ... Connection
    # refused"). Every rank launches the same jobs in the same order, so a per-process count agrees.
    # (Ranks started by HydraDDPLauncher get a fresh store from rank 0 on every init: not needed there.)
    global _launches
    _launches += 1
    import torch.distributed as dist

    if not dist.is_initialized():
        raise_group_count(1000 * _launches)


def _current_output_dir() -> str:
    from hydra.core.hydra_config import HydraConfig

    return str(HydraConfig.get().runtime.output_dir)


