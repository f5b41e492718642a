"""lsync-train and lightning_sync/conf: every config composes; the main job, a multirun (basic and
submitit_local launchers) and torchrun on 2 CPU ranks; bad configs fail before anything is spawned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.utils import get_class, instantiate

import lightning_sync as ls
from lightning_sync.config import ConfigError, check_config

# conf/hydra/launcher/*.yaml shadow the plugins' schemas of the same name on purpose (see config.py)
pytestmark = pytest.mark.filterwarnings("ignore:.*is validated against ConfigStore schema")

CONF = Path(ls.__file__).parent / "conf"
GROUPS = ("trainer", "cluster", "model", "data", "callbacks", "logger", "experiment", "debug", "hydra/launcher")
# 1 epoch of 2 batches: what every subprocess run uses
TINY = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "callbacks=minimal",
        "trainer.enable_checkpointing=false"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml") if not p.stem.startswith("_"))  # _base: shared parts


def lsync_train(*args: str, cwd: Path, timeout: int = 240, env: dict[str, str] | None = None,
                exe: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [*(exe or [sys.executable, "-m", "lightning_sync.train"]), *args]
    return subprocess.run(["timeout", "-k", "5", str(timeout), *command], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout + 20, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def leftovers(marker: str) -> list[str]:
    """Processes (other than ps itself) whose command line mentions ``marker``."""
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in ps if marker in line and " ps -eo" not in line]


# ------------------------------------------------------------------------------ in-process

def test_conf_ships_in_the_package_and_repo_conf_points_to_it() -> None:
    repo_conf = Path(__file__).parents[1] / "conf"
    assert repo_conf.resolve() == CONF.resolve()
    for group in GROUPS:
        assert options(group), group


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_composes_and_instantiates(group: str, tmp_path: Path) -> None:
    with initialize_config_module("lightning_sync.conf", version_base="1.3"):
        for option in options(group):
            cfg = compose("train", overrides=[f"{group}={option}", f"run_dir={tmp_path}"],
                          return_hydra_config=group.startswith("hydra"))
            if group.startswith("hydra"):
                launcher = cfg.hydra.launcher
                assert get_class(launcher._target_).__name__.endswith("Launcher"), option
                continue
            instantiate(cfg.model), instantiate(cfg.data)
            if cfg.cluster is not None:  # cluster=auto: None, Lightning detects
                instantiate(cfg.cluster)
            [instantiate(c) for c in cfg.callbacks.values() if c is not None]
            [instantiate(c) for c in cfg.logger.values() if c is not None]
            if cfg.trainer.accelerator == "gpu" and not _cuda():
                with pytest.raises(ConfigError, match="trainer.accelerator=gpu: this machine has no usable GPU"):
                    check_config(cfg)
                if not isinstance(cfg.trainer.strategy, str):
                    assert isinstance(instantiate(cfg.trainer.strategy), ls.SyncDDPStrategy)
                continue
            if group == "cluster" and option not in ("auto", "local"):
                continue  # torchrun/slurm: the Trainer reads their launcher's environment (tested below)
            check_config(cfg)
            trainer = instantiate(cfg.trainer, logger=False)
            assert trainer.num_devices == cfg.trainer.devices, option


def test_default_config_is_the_main_job() -> None:
    with initialize_config_module("lightning_sync.conf", version_base="1.3"):
        cfg = compose("train", overrides=["run_dir=/tmp/x", "seed=7", "model.lr=0.03"])
    assert cfg.trainer.devices == 2 and cfg.trainer.accelerator == "cpu"
    assert cfg.trainer.strategy._target_ == "lightning_sync.SyncDDPStrategy" and cfg.trainer.strategy.seed == 7
    model = instantiate(cfg.model)
    assert model.hparams.lr == 0.03
    assert any(isinstance(m, __import__("torch").nn.BatchNorm2d) for m in model.modules())


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------------------ subprocess runs

@pytest.mark.slow
def test_main_job_two_ranks(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = ok(lsync_train(*TINY, "seed=11", f"hydra.run.dir={run}", cwd=tmp_path))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["seed"] == 11 and summary["world_size"] == 2 and summary["run_dir"] == str(run)
    assert summary["val_size"] == 2 * 64 and 0.0 <= summary["val_acc"] <= 1.0  # 1 batch of 64 per rank, gathered
    assert f"lsync-train: root seed 11 | world size 2 | val acc {summary['val_acc']:.4f}" in out
    assert sorted(p.name for p in run.glob("rank*.log")) == ["rank0.log", "rank1.log"]
    assert "rank 1/2 done" in (run / "rank1.log").read_text()
    assert len(list(tmp_path.rglob("config.resolved.yaml"))) == 1 and len(list(tmp_path.rglob(".hydra"))) == 1
    assert (run / "csv" / "version_0" / "metrics.csv").exists()


@pytest.mark.slow
def test_run_until_max_time_with_a_clean_log(tmp_path: Path) -> None:
    """max_epochs=-1 + max_time trains and stops; stdout is a pipe: plain progress lines, each
    warning once (rank 0; rank 1's copies go to rank1.log), no product tip, nothing said twice."""
    run = tmp_path / "run"
    out = ok(lsync_train("trainer.max_epochs=-1", "trainer.max_time=00:00:00:08", "trainer.limit_train_batches=6",
                         "trainer.limit_val_batches=1", "callbacks.checkpoint=null", "trainer.enable_checkpointing=false",
                         "callbacks.progress_bar.every_n_steps=3", f"hydra.run.dir={run}", cwd=tmp_path, timeout=300))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["epochs"] >= 1, summary
    assert "Time limit reached" in out and "\r" not in out and "Tip:" not in out, out[-3000:]
    assert "epoch 0 step 3/6 | train/loss=" in out and "epoch 0 done in " in out, out[-3000:]
    lines = [line.split("] - ", 1)[-1].strip() for line in out.splitlines() if line.strip()]
    repeated = {line for line in lines if lines.count(line) > 1 and not set(line) <= set("-")}
    assert not repeated, f"printed twice (rank 1 repeating rank 0?): {repeated}\n{out[-3000:]}"
    assert "rank 1: pid" not in out and "GLOBAL_RANK: 1" not in out, out[-3000:]  # rank 1's info: its log only
    rank1 = (run / "rank1.log").read_text()
    assert "rank 1/2 done" in rank1
    if "[py.warnings]" in out:  # the third-party warnings both ranks hit: shown by rank 0, kept in rank1.log
        assert "[py.warnings]" in rank1, rank1


def _check_sweep(sweep: Path, lrs: list[float]) -> None:
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [j.name for j in jobs] == [str(i) for i in range(len(lrs))]
    rank1_pids, ports = set(), set()
    for job, lr in zip(jobs, lrs):
        summary = json.loads((job / "summary.json").read_text())
        assert summary["lr"] == lr and summary["world_size"] == 2 and summary["run_dir"] == str(job)
        assert sorted(p.name for p in job.glob("rank*.log")) == ["rank0.log", "rank1.log"]
        assert len(list(job.rglob("config.resolved.yaml"))) == 1 and len(list(job.rglob(".hydra/config.yaml"))) == 1
        rank1 = (job / "rank1.log").read_text()
        assert f"rank 1/2 done: lr={lr} " in rank1, rank1  # rank 1 ran this job's overrides, in this dir
        rank1_pids.add(rank1.split("pid ")[1].split(",")[0])
        ports.add(rank1.split("master port ")[1].split()[0])
    assert len(rank1_pids) == len(lrs), "a rank process was reused across jobs"
    assert len(ports) == len(lrs), "jobs shared a master port"


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["basic", "submitit_local"])
def test_multirun_two_jobs_two_ranks(launcher: str, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    ok(lsync_train("-m", "model.lr=0.05,0.1", *TINY, f"hydra/launcher={launcher}", f"hydra.sweep.dir={sweep}",
                   cwd=tmp_path, timeout=300))
    _check_sweep(sweep, [0.05, 0.1])
    assert not leftovers(str(tmp_path)), leftovers(str(tmp_path))


@pytest.mark.slow
def test_multirun_under_torchrun(tmp_path: Path) -> None:
    """Ranks from torchrun: nothing is spawned; both ranks walk the sweep and share each job's dir."""
    # cluster=auto (the default): Lightning detects torchrun
    proc = lsync_train("-m", "model.lr=0.05,0.1", *TINY, cwd=tmp_path, timeout=240,
                       exe=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            "-m", "lightning_sync.train"])
    ok(proc)
    (sweep,) = (tmp_path / "multirun").iterdir()
    assert sweep.name.startswith("torchrun-")
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [j.name for j in jobs] == ["0", "1"]
    for job, lr in zip(jobs, [0.05, 0.1]):
        assert f"rank 1/2 done: lr={lr} " in (job / "rank1.log").read_text()
        assert len(list(job.rglob(".hydra/config.yaml"))) == 1
    assert not leftovers(str(tmp_path)), leftovers(str(tmp_path))


BAD = {
    "devices0": (["trainer.devices=0"], {}, "trainer.devices=0: the number of processes per node must be >= 1"),
    "unknown_option": (["trainer=tpu_pod"], {}, "trainer=tpu_pod: no such option in config group 'trainer' (the "
                                               "options are cpu, cpu_ddp, gpu, gpu_ddp)"),
    "gpu_without_gpu": (["trainer=gpu_ddp"], {}, "trainer.accelerator=gpu: this machine has no usable GPU"),
    # issue 45: a strategy option outside its choices, refused before a run directory (was: inside instantiate)
    "uneven_typo": (["trainer.strategy.uneven_batches=joinn"], {},
                    "trainer.strategy.uneven_batches=joinn: must be 'error' or 'stop_together' or 'join'"),
    # issue 45: a sweep's bad value in its last job stops the sweep before its first job trains
    "sweep_value": (["-m", "trainer=cpu", "model.lr=0.01,abc"], {},
                    "sweep job #1 of 2 (trainer=cpu model.lr=abc), before any job ran: model.lr=abc: must be float"),
}
# The same checks against a launcher's environment, in-process (the CLI path is the one above).
BAD_IN_ENV = {
    "local_num_nodes": (["trainer.num_nodes=2"], {}, "trainer.num_nodes=2: cluster=local starts processes on"),
    "torchrun_num_nodes": (["cluster=torchrun", "trainer.num_nodes=2"],
                           {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},
                           "trainer.num_nodes=2: num_nodes(2) * nproc_per_node(2) != WORLD_SIZE(2)"),
    "torchrun_devices": (["cluster=torchrun"], {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4"},
                         "trainer.devices=2: torchrun started 4 processes per node"),
    "torchrun_missing": (["cluster=torchrun"], {}, "cluster=torchrun: no torchrun environment"),
    "auto_under_torchrun": ([], {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"},
                            "trainer.devices=2: torchrun started 4 processes per node"),
    "slurm_num_nodes": (["cluster=slurm", "trainer.num_nodes=2"],
                        {"SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS_PER_NODE": "2"},
                        "trainer.num_nodes=2: the SLURM allocation has 1 node(s)"),
    "slurm_devices": (["cluster=slurm"], {"SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "1",
                                          "SLURM_NTASKS_PER_NODE": "4"}, "SLURM starts 4 tasks per node"),
    "slurm_missing": (["cluster=slurm"], {}, "cluster=slurm: not inside a SLURM allocation"),
}


@pytest.mark.parametrize("name", BAD_IN_ENV)
def test_cluster_mismatch_is_a_config_error(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    overrides, env, message = BAD_IN_ENV[name]
    for key in ("TORCHELASTIC_RUN_ID", "NODE_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "SLURM_NTASKS", "SLURM_JOB_NUM_NODES", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with initialize_config_module("lightning_sync.conf", version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, "run_dir=/tmp/x"])
    with pytest.raises(ConfigError, match="Fix: ") as err:
        check_config(cfg)
    assert message in str(err.value)
# Every value against the schema (lightning_sync/app/schema.py), in-process: key, value, why and fix.
BAD_VALUES = {
    "model.lr=abc": "model.lr=abc: must be float (the type of DigitsCNN's argument lr). Fix: model.lr=0.1",
    "model.lr=-0.1": "model.lr=-0.1: must be > 0. Fix: model.lr=0.1",
    "+model.lrr=0.1": "model.lrr=0.1: DigitsCNN has no argument 'lrr'. Fix: remove it (~model.lrr) or use one of: ",
    "seed=abc": "seed=abc: must be int. Fix: seed=1234",
    "seed=-1": "seed=-1: must be in [0, 4294967295]",
    "trainer.max_epochs=-2": "trainer.max_epochs=-2: must be >= 1, or -1 to train until max_steps/max_time",
    "trainer.max_time=20s": "trainer.max_time=20s: must be DD:HH:MM:SS",
    "trainer.devices=auto": "trainer.devices=auto: on CPU Lightning resolves auto to 1 process",
    "trainer.precision=33": "trainer.precision=33: must be 64 or 32 or 16",
    "trainer.strategy.seed=x": "trainer.strategy.seed=x: must be int or None",
    "trainer.limit_train_batches=1.5": "trainer.limit_train_batches=1.5: must be a fraction in [0, 1] or a count",
    "data.batch_size=0": "data.batch_size=0: must be >= 1. Fix: data.batch_size=32",
    "data.val_fraction=1.0": "data.val_fraction=1.0: must be in (0, 1)",
    "callbacks.checkpoint._target_=lightning.pytorch.callbacks.NoSuchCheckpoint":
        "callbacks.checkpoint._target_=lightning.pytorch.callbacks.NoSuchCheckpoint: cannot import it",
    "+callbacks.validation_gather.prog_barr=true": "ValidationGather has no argument 'prog_barr'",
}


@pytest.mark.parametrize("override", BAD_VALUES)
def test_every_value_is_checked_against_the_schema(override: str) -> None:
    with initialize_config_module("lightning_sync.conf", version_base="1.3"):
        cfg = compose("train", overrides=[override, "run_dir=/tmp/x"])
    with pytest.raises(ConfigError, match="Fix: ") as err:
        check_config(cfg)
    assert BAD_VALUES[override] in str(err.value)


def test_schema_dataclasses_match_the_constructors() -> None:
    """The job's dataclasses cannot drift from the classes they describe (names and defaults)."""
    import dataclasses
    import inspect

    from lightning_sync import data, models, schema

    for cls, config in ((models.DigitsCNN, schema.DigitsCNNConfig), (data.DigitsDataModule, schema.DigitsDataConfig)):
        params = {n: p.default for n, p in inspect.signature(cls).parameters.items()}
        assert params == {f.name: f.default for f in dataclasses.fields(config)}, cls
    trainer = inspect.signature(__import__("lightning").Trainer).parameters
    assert {f.name for f in dataclasses.fields(schema.TrainerConfig)} <= set(trainer)
    with initialize_config_module("lightning_sync.conf", version_base="1.3"):
        cfg = compose("train", overrides=["run_dir=/tmp/x"])
    assert {f.name for f in dataclasses.fields(schema.JobConfig)} <= set(cfg)


# Commands that must succeed without training (run in the same batch to share the import time).
GOOD = {
    "help": (["--help"], "lsync-train: the lightning_sync main job"),
    "cfg_job": (["--cfg", "job", "trainer=gpu_ddp", "seed=5"], "process_group_backend: nccl"),
}


@pytest.mark.slow
def test_bad_configs_fail_fast_with_the_fix_and_help_works(tmp_path: Path) -> None:
    bad = {k: v for k, v in BAD.items() if not (k == "gpu_without_gpu" and _cuda())}
    started = time.monotonic()
    procs = {}
    commands = {**bad, **{name: (args, {}, text) for name, (args, text) in GOOD.items()}}
    for name, (args, env, _) in commands.items():  # all at once: each is mostly import time
        (tmp_path / name).mkdir()
        procs[name] = subprocess.Popen(
            ["timeout", "-k", "5", "180", sys.executable, "-m", "lightning_sync.train", *args,
             f"hydra.run.dir={tmp_path / name / 'run'}"], cwd=tmp_path / name, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=200)
        assert commands[name][2] in out, f"{name}:\n{out[-3000:]}"
        if name in GOOD:
            assert proc.returncode == 0 and not (tmp_path / name / "run").exists(), f"{name}: {out[-3000:]}"
            continue
        assert proc.returncode not in (0, 124, 137), f"{name}: exit {proc.returncode}\n{out[-3000:]}"
        assert "Fix:" in out or name == "unknown_option", out[-2000:]
        assert not list((tmp_path / name).rglob("rank1.log")), f"{name}: a rank was spawned"
        # refused before Hydra made the run directory (a sweep: before its first job's)
        assert not (tmp_path / name / "run").exists(), f"{name}: a run directory was left behind"
        assert not list((tmp_path / name).rglob("config.yaml")), f"{name}: a job started"
    assert time.monotonic() - started < 150
    # `lsync-train --help | head -1`: the reader leaves early; no BrokenPipeError traceback
    piped = subprocess.run(["bash", "-c", f"set -o pipefail; {sys.executable} -m lightning_sync.train --help | head -1"],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert piped.stdout.startswith("lsync-train: the lightning_sync main job"), piped.stdout
    assert "Error" not in piped.stderr and "Traceback" not in piped.stderr, piped.stderr


def test_compose_api_config_is_not_a_hydra_job() -> None:
    """Hydra's compose API + ``HydraConfig().set_config`` (lightning-hydra-template's tests): no job
    directory to replay, so Lightning's own launcher starts the ranks, as under ``ddp``."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from lightning_sync.launcher import hydra_active

    with initialize_config_module(config_module="lightning_sync.conf", version_base="1.3"):
        cfg = compose("train", overrides=["run_dir=/tmp/x"], return_hydra_config=True)
    try:
        HydraConfig().set_config(cfg)
        assert HydraConfig.initialized() and not hydra_active()
        from omegaconf import OmegaConf

        OmegaConf.set_readonly(cfg.hydra, False)
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = "/tmp/x"  # what @hydra.main sets for a job
        HydraConfig().set_config(cfg)
        assert hydra_active()
    finally:
        HydraConfig.instance().cfg = None  # type: ignore[assignment]


def test_lightnings_ddp_with_sync_batchnorm_on_cpu_is_refused_before_any_process() -> None:
    with initialize_config_module("lightning_sync.conf", version_base="1.3"):
        cfg = compose("train", overrides=["trainer.strategy=ddp", "run_dir=/tmp/x"])
    with pytest.raises(ConfigError, match="Fix: trainer.strategy=ddp_sync") as err:
        check_config(cfg)
    assert "torch.nn.SyncBatchNorm, which runs on CUDA only" in str(err.value)
    with initialize_config_module("lightning_sync.conf", version_base="1.3"):
        check_config(compose("train", overrides=["trainer.strategy=ddp", "trainer.sync_batchnorm=false",
                                                 "run_dir=/tmp/x"]))  # fine without SyncBatchNorm


@pytest.mark.parametrize(("args", "expected"), [
    (["model.lrr=0.1"], "model.lrr: no such key in the config (did you mean model.lr? Fix: model.lr=0.1)"),
    (["trainer.max_epoch=3"], "trainer.max_epoch: no such key in the config (did you mean trainer.max_epochs? Fix: "
                              "trainer.max_epochs=3)"),
    (["-m", "trainer=cpu", "model.lrr=0.1,0.2"], "model.lrr: no such key"),
    (["sed=3"], "sed: no such key in the config (did you mean seed? Fix: seed=3)"),
    # a group option mistyped, in a sweep's second choice too: the options a user may pick, no _base / _ddp
    (["-m", "trainer=cpu,cpu_dpp"], "trainer=cpu_dpp: no such option in config group 'trainer' (did you mean "
                                    "cpu_ddp? Fix: trainer=cpu_ddp; the options are cpu, cpu_ddp, gpu, gpu_ddp)"),
])
def test_mistyped_keys_get_the_projects_config_error(args: list[str], expected: str, tmp_path: Path) -> None:
    from lightning_sync.config import unknown_override

    assert expected in (unknown_override(args) or "")
    assert unknown_override(["model.lr=0.1", "trainer=cpu", "+extra.key=1", "seed=3"]) is None
    proc = subprocess.run([sys.executable, "-m", "lightning_sync.train", *args, f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode not in (0, 124) and f"lsync-train: config error: {expected}" in proc.stderr, proc.stderr
    assert "is not in struct" not in proc.stderr and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_failing_on_rank_0_ends_its_ranks_and_the_sweep_goes_on(tmp_path: Path) -> None:
    """A user's own @hydra.main script swept with -m (lightning-hydra-template's way): job 0 raises on rank 0
    alone, leaving rank 1 in DDP's all-reduce. Its ranks are reaped when job 1 starts (10 s, then killed),
    without Lightning's process observer SIGKILLing the sweep: job 1 runs, and Hydra reports job 0's error.
    (Before: rank 1 was waited for 120 s, then killed, and the observer killed the sweep with it.)"""
    script = Path(__file__).parent / "scripts" / "hydra_user_sweep.py"
    sweep = tmp_path / "sweep"
    proc = lsync_train("-m", "+strategy=ddp_sync", "+fail=true,false", f"hydra.sweep.dir={sweep}", cwd=tmp_path,
                       exe=[sys.executable, str(script)], timeout=240)
    assert proc.returncode == 1, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "RuntimeError: rank 0 fails in this job" in proc.stderr
    assert not (sweep / "0" / "done.json").exists()
    assert json.loads((sweep / "1" / "done.json").read_text()) == {"fail": False, "step": 4}
    assert not leftovers(str(tmp_path)), leftovers(str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_call_after_fit_in_a_job_creates_its_group_on_a_fresh_port(tmp_path: Path) -> None:
    """fit -> validate in one Hydra job (lightning-hydra-template's fit -> test(ckpt_path="best")): the
    fit's group is destroyed (its ranks' job goes on), and rank 0 still holds an object referencing it, so
    its old store server stays open. The validate's group is created on a port rank 0 picked before the
    old group went: nobody dials the lingering server. (Before: same port, rank 1 reached the old server
    after its 3 s wait and the guard's first broadcast failed, 'Connection reset by peer'; in the
    template, with SyncBatchNorm, it hung.)"""
    script = Path(__file__).parent / "scripts" / "hydra_user_sweep.py"
    sweep = tmp_path / "sweep"
    proc = lsync_train("-m", "+strategy=ddp_sync", "+fail=false", "+then_validate=true", f"hydra.sweep.dir={sweep}",
                       cwd=tmp_path, exe=[sys.executable, str(script)], timeout=160)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    done = json.loads((sweep / "0" / "done.json").read_text())
    assert done["step"] == 4 and done["val_loss"] > 0
    fit_port, validate_port = done["ports"]
    assert fit_port != validate_port
    assert not leftovers(str(tmp_path)), leftovers(str(tmp_path))
