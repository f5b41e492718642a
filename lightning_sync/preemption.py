"""SLURM preemption under ``ddp_sync``: the requeue checkpoint is written at a step every rank agrees on.

Lightning's SLURM support (``SLURMEnvironment(auto_requeue=True)``, the default under SLURM) saves
``hpc_ckpt_N.ckpt`` and runs ``scontrol requeue`` from inside the handler of SLURM's requeue
signal (SIGUSR1, sent ahead of the time limit with ``#SBATCH --signal=SIGUSR1@90``). A Python
signal handler runs wherever the rank happens to be, and ranks are rarely at the same place:
``save_checkpoint`` issues collectives (a barrier; under ``ddp_sync`` also the gather of every rank's
loader and RNG states), so one rank enters them while another is in the next step's gradient
all-reduce: a hang, a collective paired with the wrong one, or a mid-step checkpoint.

``ddp_sync`` keeps Lightning's handler but runs it where every rank agrees. The signal only notes
the request; at the start of every training step Lightning already broadcasts rank 0's SIGTERM flag
(one element, every step), and ``ddp_sync`` widens that tensor by a second element, the requeue
request. Every rank then runs Lightning's handler at the end of that same step (``on_train_batch_end``,
where ``ModelCheckpoint(every_n_train_steps=...)`` saves too), so the checkpoint is a mid-epoch
checkpoint like any other and resumes to the exact batch (``docs/resume.md``); at the start of a step
the next batch's random augmentation has already been drawn, and a checkpoint there would draw it
again on resume. No collective is added. Rank 0's request decides (SLURM signals every task).
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable

import lightning as L
import torch

from lightning_sync._compat import lightning_api as compat
from lightning_sync.errors import LightningSyncError

__all__ = ["DeferredRequeue"]


class DeferredRequeue(L.Callback):
    """Runs Lightning's SLURM requeue handler at the next step boundary, on every rank at once.

    ``SyncDDPStrategy`` owns one, adds it to the trainer's callbacks and installs it once Lightning
    registered its signal handlers."""

    def __init__(self) -> None:
        self.requested = False
        self.due = False  # every rank agreed: save at the end of this training step
        self.handled = 0  # how many requeue checkpoints this process wrote (tests read it)
        self._signum: int | None = None
        self._handler: Callable[[int, Any], Any] | None = None
        self._loop: Any = None

    def install(self, trainer: Any) -> bool:
        """Replace Lightning's per-step SIGTERM broadcast by this one, and take over the requeue signal from
        Lightning's handler (call after Lightning registered it). Returns whether the signal was taken:
        only in ``fit`` (validate, test and predict have no training steps to wait for and keep
        Lightning's handler), under SLURM with auto-requeue, with more than one rank, from the main
        thread. The broadcast is replaced in every ``fit`` with more than one rank: Lightning's swallows
        any exception, the collective guard's error included, and training would walk on into the next
        step's collectives of a broken group."""
        if self._loop is not None or trainer.world_size < 2 or not trainer.training:
            return False
        self._loop = compat.install_step_flag_broadcast(trainer, self._step_boundary)
        if threading.current_thread() is not threading.main_thread():
            return False
        signum = compat.slurm_requeue_signal(trainer)
        if signum is None:
            return False
        handler = signal.getsignal(signum)
        if not callable(handler):  # Lightning registered none (the user's own handler was there first)
            return False
        self._signum, self._handler = signum, handler
        signal.signal(signum, self._note)
        return True

    def uninstall(self) -> None:
        """Put Lightning's handler and its step broadcast back (Lightning's own teardown then restores
        the handlers it found)."""
        compat.remove_step_flag_broadcast(self._loop)
        self._loop = None
        if self._handler is None:
            return
        main = threading.current_thread() is threading.main_thread()
        if main and self._signum is not None and signal.getsignal(self._signum) == self._note:
            signal.signal(self._signum, self._handler)
        self._handler, self.requested, self.due = None, False, False

    def _note(self, signum: int, frame: Any) -> None:
        self.requested = True

    def _step_boundary(self, trainer: Any) -> None:
        """Lightning's per-step SIGTERM broadcast, with the requeue request beside the SIGTERM flag."""
        flags = torch.tensor([int(bool(getattr(trainer, "received_sigterm", False))), int(self.requested)],
                             device=trainer.strategy.root_device)
        # One guarded operation of a known layout (int64[2] on every rank, from this line): the guard
        # records it and skips the confirmation it makes before a user's broadcast on gloo, running it on a
        # gloo group of its own where nothing else can pair with it (CollectiveGuard.own_broadcast).
        guard = getattr(trainer.strategy, "guard", None)
        try:
            if guard is not None:
                guard.own_broadcast("step flags broadcast", "int64[2] src=0", flags)
            else:
                torch.distributed.broadcast(flags, src=0)
        except LightningSyncError:
            raise  # the collective guard's finding: not a reason to carry on as if nothing was sent
        except Exception:  # noqa: BLE001 - as Lightning: a failed broadcast is no SIGTERM
            flags = torch.zeros(2, dtype=torch.long)
        sigterm, requeue = (int(v) for v in flags.tolist())
        if requeue:
            self.requested, self.due = False, True
        if sigterm:
            compat.raise_sigterm_exception()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Run Lightning's handler where every rank agreed to: every rank saves, rank 0 requeues."""
        if self.due and self._handler is not None:
            self.due = False
            self.handled += 1
            self._handler(self._signum, None)  # type: ignore[arg-type]
