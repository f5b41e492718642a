"""Hydra glue for ``lsync-train``: OmegaConf resolvers that keep every rank of a job in one
directory, and the fail-fast checks run before any process is spawned (and, through the Hydra
callback :class:`CheckConfig`, before Hydra creates the run directory).

Resolvers (registered on import):
    ``${lsync_rank:}``        this process's global rank, from the launcher's environment.
    ``${lsync_rank_zero:X}``  X on global rank 0, None elsewhere (``hydra.output_subdir``: one
                              ``.hydra/`` per job, written by rank 0).
    ``${lsync_stamp:}``       a run name every rank computes alike: the SLURM job/step or the torchrun
                              run id when ranks are started externally, else the local time.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from lightning_sync.ranks import announced_global_rank

__all__ = ["CheckConfig", "ConfigError", "check_config", "global_rank", "run_stamp"]

_STARTED = time.localtime()  # one stamp per process: rank > 0 never needs it (it is handed the run dir)


class ConfigError(ValueError):
    """A config value that cannot work; raised before any process is spawned."""


def global_rank() -> int:
    """This process's global rank as the launchers announce it (0 in a process nobody launched)."""
    return announced_global_rank()


def run_stamp() -> str:
    """A directory name that is equal on every rank of one launch (see the module docstring)."""
    if "SLURM_JOB_ID" in os.environ and "SLURM_STEP_ID" in os.environ:
        return f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return f"torchrun-{run_id}"
    if "TORCHELASTIC_RUN_ID" in os.environ:  # static rendezvous: ranks share only the master address
        return f"torchrun-{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}"
    return time.strftime("%Y-%m-%d/%H-%M-%S", _STARTED)


def _register_resolvers() -> None:
    OmegaConf.register_new_resolver("lsync_rank", global_rank, replace=True)
    OmegaConf.register_new_resolver("lsync_rank_zero", lambda value: value if global_rank() == 0 else None,
                                    replace=True)
    # Cached in the config object, so a config pickled to another process (submitit) keeps its stamp.
    OmegaConf.register_new_resolver("lsync_stamp", run_stamp, replace=True, use_cache=True)


_register_resolvers()
# conf/hydra/launcher/*.yaml spell out every field of the plugins' schemas of the same name on purpose.
warnings.filterwarnings("ignore", message=r"(?s).*is validated against ConfigStore schema with the same name")


# ---------------------------------------------------------------------------------------- checks

def _fail(key: str, value: Any, why: str, fix: str) -> None:
    raise ConfigError(f"{key}={value}: {why}. Fix: {fix}")


def check_config(cfg: DictConfig, *, this_machine: bool = True) -> None:
    """Checks what would otherwise fail late, after processes are spawned, or hang: every value
    against the schema (``lightning_sync.app.schema``: types from the constructors the config builds,
    ranges from the job's dataclasses), then the devices and the launcher's environment.

    ``this_machine=False`` (a sweep whose launcher runs the jobs elsewhere, e.g. submitit_slurm)
    skips what depends on the machine that checks: its GPUs and its launcher environment. Each job
    checks those again where it starts.

    Raises:
        ConfigError: naming the key, the bad value and the fix.
    """
    from lightning_sync.app.schema import problems

    t = cfg.trainer
    devices, num_nodes, accel = t.get("devices", 1), t.get("num_nodes", 1), str(t.get("accelerator", "auto"))
    if isinstance(devices, int) and not isinstance(devices, bool) and devices < 1:
        _fail("trainer.devices", devices, "the number of processes per node must be >= 1",
              "trainer.devices=2 (2 processes; on GPUs trainer.devices=auto takes every GPU of the node)")
    for problem in problems(cfg):
        raise ConfigError(str(problem))
    on_cpu = accel == "cpu" or (accel == "auto" and not torch.cuda.is_available())
    strategy = t.get("strategy", "auto")
    ddp = not isinstance(strategy, str) or strategy.startswith("ddp")
    if devices == "auto" and on_cpu and ddp:
        _fail("trainer.devices", devices, "on CPU Lightning resolves auto to 1 process, so this DDP run would "
              "train on one rank (world size 1) without saying so",
              "trainer.devices=N for N processes on this machine (trainer.devices=2 is the default), or "
              "trainer=cpu for one process without DDP")
    if not isinstance(num_nodes, int) or num_nodes < 1:
        _fail("trainer.num_nodes", num_nodes, "must be an integer >= 1", "trainer.num_nodes=1")
    if bool(t.get("sync_batchnorm", False)) and on_cpu and ddp and not _portable_syncbn(strategy):
        shown = strategy if isinstance(strategy, str) else strategy.get("_target_")
        _fail("trainer.strategy", shown, "with trainer.sync_batchnorm=true on CPU this strategy converts BatchNorm to "
              "torch.nn.SyncBatchNorm, which runs on CUDA only (both processes would start, then fail with "
              "'SyncBatchNorm layers only work with GPU modules')",
              "trainer.strategy=ddp_sync (its SyncBatchNorm runs on gloo), or trainer.sync_batchnorm=false")
    if not this_machine:
        return
    if accel in ("gpu", "cuda") and not torch.cuda.is_available():
        _fail("trainer.accelerator", accel,
              f"this machine has no usable GPU (torch {torch.__version__}, torch.cuda.is_available() is False)",
              "trainer=cpu_ddp (2 processes on CPU) or trainer=cpu, or install a CUDA build of torch")
    if isinstance(devices, int) and accel in ("gpu", "cuda") and devices > torch.cuda.device_count():
        _fail("trainer.devices", devices, f"only {torch.cuda.device_count()} GPU(s) visible on this node",
              f"trainer.devices={torch.cuda.device_count()} or set CUDA_VISIBLE_DEVICES")
    _check_cluster(cfg, devices, num_nodes)


class CheckConfig(Callback):
    """Hydra callback (``hydra.callbacks`` in conf/train.yaml): runs :func:`check_config` on the
    composed config before Hydra creates the run directory, so a refused run leaves nothing behind.

    A sweep (``-m``) is checked once with its base config; each job's own values are checked again
    when the job starts (``lsync-train``'s task function), where a refused job's directory gets a
    ``CONFIG_ERROR.txt``.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_or_exit(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from lightning_sync.app.schema import import_problem

        launcher = OmegaConf.select(config, "hydra.launcher._target_", default=None)
        problem = import_problem("hydra/launcher", str(launcher)) if launcher else None
        if problem is not None:  # hydra/launcher=submitit_* without the plugin installed
            raise SystemExit(f"lsync-train: config error: {problem}")
        # submitit_slurm runs the jobs on the cluster's nodes, not here: their GPUs and SLURM
        # environment are checked when each job starts.
        this_machine = not str(launcher).endswith("SlurmLauncher")
        _check_or_exit(config, this_machine=this_machine)
        _check_sweep(config, this_machine)


#: A sweep of more jobs than this is checked for its first ones only (composing a config takes ~10 ms).
SWEEP_CHECK_LIMIT = 1000


def _check_sweep(config: DictConfig, this_machine: bool) -> None:
    """Every job of a basic-sweeper multirun composed and checked before the first one runs: a bad value in the
    sweep's last job (``model.lr=0.01,abc``) stops the sweep at once, naming the job, instead of after the
    jobs before it have trained. Other sweepers (Optuna, Ax) choose their values as they go: their jobs are
    checked as each starts."""
    from hydra import compose

    from lightning_sync._compat.omegaconf_api import sweep_jobs

    sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_", default="") or "")
    if not sweeper.endswith("BasicSweeper"):
        return
    task = [str(o) for o in (OmegaConf.select(config, "hydra.overrides.task", default=None) or [])]
    try:
        jobs = sweep_jobs(task)
    except Exception:  # noqa: BLE001 - an override Hydra's sweeper will judge with its own message
        return
    if len(jobs) < 2:
        return
    for number, job in enumerate(jobs[:SWEEP_CHECK_LIMIT]):
        try:
            check_config(compose(config_name="train", overrides=job), this_machine=this_machine)
        except ConfigError as err:
            raise SystemExit(f"lsync-train: config error: sweep job #{number} of {len(jobs)} ({' '.join(job)}), "
                             f"before any job ran: {err}") from None


def _portable_syncbn(strategy: Any) -> bool:
    """Whether the strategy converts BatchNorm to lightning_sync's portable SyncBatchNorm (CPU/gloo too)."""
    if isinstance(strategy, str):
        return strategy.startswith("ddp_sync")
    return str(strategy.get("_target_", "")).endswith("SyncDDPStrategy")


def unknown_override(args: list[str]) -> str | None:
    """The first command-line override ``a.b=value`` whose key the composed config lacks, as a config error
    with the nearest existing key (None: every key exists, or the command is one Hydra should judge).

    Hydra's own message for such a typo ("Key 'lrr' is not in struct ... To append to your config use
    +model.lrr=...") suggests adding the key, which is never the fix here.
    """
    import difflib

    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in args):
        return None  # --help, --cfg, --config-name ...: Hydra's
    conf = Path(__file__).parents[1] / "conf"
    overrides = [a for a in args if "=" in a and not a.startswith(("+", "~", "hydra", "-"))]
    is_group = [(conf / a.split("=", 1)[0]).is_dir() for a in overrides]
    for arg, group in zip(overrides, is_group):
        if group:
            problem = _unknown_choice(conf, *arg.split("=", 1))
            if problem is not None:
                return problem
    groups = [a.split(",", 1)[0] for a, g in zip(overrides, is_group) if g]  # a sweep: its first choice
    try:
        with initialize_config_module("lightning_sync.conf", version_base="1.3"):
            cfg = compose("train", overrides=groups)
    except Exception:  # noqa: BLE001 - a bad group choice: Hydra's error lists the options
        return None
    for arg, group in zip(overrides, is_group):
        key = arg.split("=", 1)[0]
        if group or "/" in key:
            continue
        prefix, _, last = key.rpartition(".")
        parent = OmegaConf.select(cfg, prefix) if prefix else cfg
        if not isinstance(parent, DictConfig) or last in parent:
            continue
        options = [str(k) for k in parent.keys()]
        near = difflib.get_close_matches(last, options, n=1)
        where = f"{prefix}." if prefix else ""
        hint = (f"did you mean {where}{near[0]}? Fix: {where}{near[0]}={arg.split('=', 1)[1]}" if near else
                f"the keys there are {', '.join(sorted(options))}")
        return f"{key}: no such key in the config ({hint}). `lsync-train --cfg job` prints the composed config."
    return None


def _unknown_choice(conf: Path, group: str, value: str) -> str | None:
    """A config-group override naming an option the group lacks (every choice of a sweep ``a,b`` checked), with the
    nearest option and the list of options a user may choose: the group's shared parts (``_base``, ``_ddp``) are
    not among them, as Hydra's own message would list them."""
    import difflib

    options = sorted(p.stem for p in (conf / group).glob("*.yaml") if not p.stem.startswith("_"))
    for choice in (c.strip() for c in value.split(",")):
        if not choice or choice in options or choice == "null" or "(" in choice or "/" in choice:
            continue  # (null, and Hydra's sweep functions such as choice(...) / nested paths: Hydra judges them)
        near = difflib.get_close_matches(choice, options, n=1)
        hint = f"did you mean {near[0]}? Fix: {group}={near[0]}; " if near else ""
        return (f"{group}={choice}: no such option in config group {group!r} ({hint}the options are "
                f"{', '.join(options)}).")
    return None


def _check_or_exit(config: DictConfig, this_machine: bool = True) -> None:
    try:
        check_config(config, this_machine=this_machine)
    except ConfigError as err:  # one clear line, no traceback (SystemExit passes Hydra's error handler)
        raise SystemExit(f"lsync-train: config error: {err}") from None


def _detected_cluster() -> str:
    from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
    from lightning.fabric.plugins.environments.torchelastic import TorchElasticEnvironment

    if TorchElasticEnvironment.detect():
        return "TorchElasticEnvironment"
    return "SLURMEnvironment" if SLURMEnvironment.detect() else "LightningEnvironment"


def _check_cluster(cfg: DictConfig, devices: Any, num_nodes: int) -> None:
    # cluster=auto (null): check against what Lightning will detect
    target = str(OmegaConf.select(cfg, "cluster._target_", default=None) or _detected_cluster())
    env = os.environ
    if target.endswith("TorchElasticEnvironment"):
        if "LOCAL_WORLD_SIZE" not in env:
            _fail("cluster", "torchrun", "no torchrun environment (LOCAL_WORLD_SIZE, RANK, ... are unset)",
                  "start with `torchrun --nproc-per-node=N -m lightning_sync.train cluster=torchrun ...`,"
                  " or use cluster=local")
        world, local = int(env.get("WORLD_SIZE", "0")), int(env["LOCAL_WORLD_SIZE"])
        if isinstance(devices, int) and local != devices:
            _fail("trainer.devices", devices, f"torchrun started {local} processes per node (--nproc-per-node)",
                  f"trainer.devices={local}")
        if world != num_nodes * local:
            _fail("trainer.num_nodes", num_nodes,
                  f"num_nodes({num_nodes}) * nproc_per_node({local}) != WORLD_SIZE({world})",
                  f"trainer.num_nodes={world // max(local, 1)}")
    elif target.endswith("SLURMEnvironment"):
        if "SLURM_NTASKS" not in env:
            _fail("cluster", "slurm", "not inside a SLURM allocation (SLURM_NTASKS is unset)",
                  "run under `srun --ntasks-per-node=N` / sbatch, or use cluster=local")
        nnodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))
        if nnodes != num_nodes:
            _fail("trainer.num_nodes", num_nodes, f"the SLURM allocation has {nnodes} node(s) (SLURM_JOB_NUM_NODES)",
                  f"trainer.num_nodes={nnodes}")
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        if per_node.isdigit() and isinstance(devices, int) and int(per_node) != devices:
            _fail("trainer.devices", devices, f"SLURM starts {per_node} tasks per node (--ntasks-per-node)",
                  f"trainer.devices={per_node}")
    elif num_nodes > 1 and "NODE_RANK" not in env and "LOCAL_RANK" not in env:
        _fail("trainer.num_nodes", num_nodes,
              "cluster=local starts processes on this machine only and NODE_RANK is unset, so the other"
              " nodes would never join (the run would hang in rendezvous)",
              "cluster=torchrun or cluster=slurm, or set MASTER_ADDR, MASTER_PORT and NODE_RANK on every node")
