"""lsync-train: the main job. A small BatchNorm CNN on the 8x8 digits with ddp_sync, via Hydra:
a broadcast root seed, SyncBatchNorm, exact validation metrics (ValidationGather), one directory per job.

    lsync-train                                    # 2 processes on CPU (gloo); python -m lightning_sync.train
    lsync-train trainer=gpu                        # one GPU
    lsync-train trainer=gpu_ddp                    # every GPU of this node (NCCL)
    torchrun --nproc-per-node=8 -m lightning_sync.train trainer=gpu_ddp trainer.devices=8
    srun --nodes=2 --ntasks-per-node=8 lsync-train trainer=gpu_ddp trainer.devices=8 trainer.num_nodes=2
    lsync-train -m seed=1,2,3 model.lr=0.01,0.1    # a sweep: every job gets its own ranks and directory

Configs: lightning_sync/conf (``lsync-train --help``). Rank 0 prints a summary at the end and writes
it to <run dir>/summary.json. Console output comes from rank 0 only: the other ranks write their log
lines and Python warnings to <run dir>/rank<N>.log (their own warnings and errors still reach the console).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import lightning_sync as ls
from lightning_sync.app.config import ConfigError, check_config, global_rank, unknown_override
from lightning_sync.launcher import ENTRY_MODULE_ENV, finish_job

log = logging.getLogger("lightning_sync.train")


def train(cfg: DictConfig) -> float:
    """One Hydra job; returns the exact validation accuracy (for sweepers)."""
    started = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    try:
        check_config(cfg)  # before any process is spawned (a single run was checked before its dir existed)
    except ConfigError as err:  # one clear line, no traceback; stops a sweep at its first job
        message = f"lsync-train: config error: {err}"
        if global_rank() == 0 and run_dir.is_dir():  # a sweep job: Hydra made its directory already
            (run_dir / "CONFIG_ERROR.txt").write_text(message + "\n")
        raise SystemExit(message) from None
    _console_from_rank_zero_only()
    if global_rank() == 0:
        OmegaConf.save(cfg, run_dir / "config.resolved.yaml", resolve=True)  # once per job
    log.info("rank %d: pid %d, run dir %s, lightning_sync from %s", global_rank(), os.getpid(), run_dir,
             Path(__file__).parents[1])
    L.seed_everything(cfg.seed, verbose=False)  # ddp_sync then broadcasts rank 0's root seed
    data = instantiate(cfg.data)
    model = instantiate(cfg.model)
    callbacks = [instantiate(c) for c in cfg.callbacks.values() if c is not None]
    loggers = [instantiate(c) for c in cfg.logger.values() if c is not None]
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    failed = True
    try:
        trainer.fit(model, datamodule=data)
        port = os.environ.get("MASTER_PORT")
        if cfg.validate_after_fit:
            trainer.validate(model, datamodule=data, verbose=False)
        failed = False
    finally:
        finish_job(failed=failed)  # rank 0: reap this job's ranks, restore the environment
    acc = float(trainer.callback_metrics.get("val/acc", float("nan")))  # exact: ValidationGather's
    gather = next((c for c in callbacks if isinstance(c, ls.ValidationGather)), None)
    val_size = int(gather.gathered[0]["index"].numel()) if gather is not None and gather.gathered else None
    log.info("rank %d/%d done: lr=%s seed=%s master port %s val/acc=%.4f", trainer.global_rank,
             trainer.world_size, cfg.model.get("lr"), cfg.seed, port, acc)
    if trainer.global_rank == 0:
        root_seed = getattr(trainer.strategy, "seed", None)  # ddp_sync's broadcast root seed
        summary = {"seed": cfg.seed if root_seed is None else root_seed, "world_size": trainer.world_size,
                   "val_acc": acc, "val_size": val_size,
                   "lr": cfg.model.get("lr"), "epochs": trainer.current_epoch, "run_dir": str(run_dir),
                   "wall_s": round(time.perf_counter() - started, 1)}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"\nlsync-train: root seed {summary['seed']} | world size {summary['world_size']} | "
              f"val acc {acc:.4f} on {summary['val_size']} images | {summary['wall_s']} s\n"
              f"  run dir: {run_dir}", flush=True)
    return acc


def _console_from_rank_zero_only() -> None:
    """One copy of everything on the console: Python warnings go through logging (into every rank's
    log file); ranks > 0 show only their own warnings and errors on the console; Lightning's product tips are dropped."""
    logging.captureWarnings(True)
    # Python shows a warning once per place, but libraries that reset the warning filters (torch does,
    # in catch_warnings blocks) make it show again: say each text once per process.
    shown: set[str] = set()

    def first_time(record: logging.LogRecord) -> bool:
        text = record.getMessage()
        new = text not in shown
        shown.add(text)
        return new

    logging.getLogger("py.warnings").addFilter(first_time)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not str(record.msg).startswith("\N{ELECTRIC LIGHT BULB} Tip:"))
    if global_rank() == 0:
        return
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.FileHandler):  # the console: this rank's own warnings and errors
            handler.setLevel(logging.WARNING)
            handler.addFilter(lambda record: record.name != "py.warnings")  # rank 0 shows these already


_hydra_main = hydra.main(version_base="1.3", config_path="../conf", config_name="train")(train)


def main() -> Any:
    """Console script ``lsync-train``; every Hydra command-line option works."""
    os.environ.setdefault(ENTRY_MODULE_ENV, "lightning_sync.train")  # how rank > 0 restarts this job
    problem = unknown_override(sys.argv[1:]) if global_rank() == 0 else None
    if problem is not None:  # a mistyped key: the project's config error, before Hydra makes a run directory
        raise SystemExit(f"lsync-train: config error: {problem}")
    try:
        result = _hydra_main()
        sys.stdout.flush()
        return result
    except BrokenPipeError:  # `lsync-train --help | head`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        sys.exit(0)


if __name__ == "__main__":
    main()
