"""One torchft replica group (one process, CPU) for tests/test_ft.py, run under lsync-ft-run.

python tests/scripts/ft_replica.py --out DIR [--steps 40] [--kill-at S] [--fail-always] [--sleep 0.05]

A linear model, momentum SGD; every step: torchft's quorum, this group's slice of the step's global batch (rows
chosen by the committed step, so a redone step reads the same rows), the gradient averaged over the live groups,
the optimizer step only if torchft commits. ``--kill-at S``: group 1 SIGKILLs itself in its first life once step S
(or the first after it) is committed (lsync-ft-run restarts it; it heals from group 0; ``--alone-sleep``: group 0, left alone, waits for group
1's next life to start and then slows down, so that it is still training when group 1 is back). ``--fail-always``: group 1 exits 3 in every life.
Each group appends one line a step to OUT/group<g>.log and writes OUT/group<g>.pt at its end.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

if "--fail-always" in sys.argv and os.environ.get("REPLICA_GROUP_ID") == "1":
    # group 1 fails in every life before it imports anything heavy: both of its lives end while group 0 is still
    # importing torch, so lsync-ft-run sees them while the run goes on (a race in CI when group 1 failed later)
    sys.exit(3)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lightning_sync.ft import ReplicaGroup, replica_context  # noqa: E402
from _ft_pacing import AlonePacer, announce_restart  # noqa: E402  (tests/scripts/, the script's own directory)

BATCH = 8


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--fail-always", action="store_true")
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--alone-sleep", type=float, default=0.0,
                   help="group 0's pause after a step it committed alone past --kill-at (its peer's restart "
                        "imports torch and Lightning meanwhile)")
    args = p.parse_args()
    group = ReplicaGroup.from_env()
    if args.fail_always and group.group_id == 1:
        sys.exit(3)
    torch.manual_seed(100 + group.group_id)  # different initial weights: torchft's first quorum syncs them
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(4096, 8, generator=torch.Generator().manual_seed(0))
    y = x @ torch.arange(1.0, 9.0) + 0.5
    healed: list[int] = []

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        healed.append(1)

    ctx = replica_context(state_dict, load_state_dict, min_replica_size=1)
    manager = ctx.manager
    if group.restart > 0:  # heartbeating from here: group 0 stops waiting for it (below)
        announce_restart(args.out, group.group_id, group.restart)
    log = open(args.out / f"group{group.group_id}.log", "a")  # noqa: SIM115 - closed below
    alone, pacer = 0, AlonePacer(args.out, args.alone_sleep)
    try:
        while manager.current_step() < args.steps:
            step = manager.current_step()
            manager.start_quorum()
            first = (step * BATCH * group.num_groups + group.group_id * BATCH) % len(x)
            rows = slice(first, first + BATCH)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x[rows]), y[rows])
            loss.backward()
            for param in model.parameters():
                manager.allreduce(param.grad).wait()
            committed = manager.should_commit()
            if committed:
                optimizer.step()
            participants = manager.num_participants()
            alone += committed and participants == 1
            log.write(f"life {group.restart} step {step} participants {participants} committed {int(committed)}\n")
            log.flush()
            # (at or after: a group that started late may have healed from a peer already past kill_at)
            if committed and step >= args.kill_at >= 0 and group.group_id == 1 and group.restart == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            alone_now = committed and participants == 1 and step > args.kill_at >= 0 and group.group_id == 0
            # left alone after the kill: first wait until group 1's next life has started (up to 120 s), so that a
            # restart slowed down by a loaded machine still finds group 0 training; then --alone-sleep
            pacer.after_step(alone_now, after_fault=True)
            if not alone_now:
                time.sleep(args.sleep)
        weights = torch.cat([t.detach().flatten() for t in model.parameters()])
        torch.save({"weights": weights, "restart": group.restart, "healed": bool(healed), "steps_alone": alone,
                    "step": manager.current_step()}, args.out / f"group{group.group_id}.pt")
    finally:
        log.close()
        ctx.close()


if __name__ == "__main__":
    main()
