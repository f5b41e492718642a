"""Cost of the collective guard, measured side by side in one run.

    python bench/bench_guard.py                 # micro (2/4/8 ranks) + tiny-MLP fit
    python bench/bench_guard.py --main          # also the main job (lsync-train experiment=digits_cpu_ddp)
    python bench/bench_guard.py --elements      # gloo's all-reduce of 1-16 int64 (the confirmation sends 2)

1. hot path: this process, no communication: microseconds the guard adds to one collective call
   (call-site lookup + fingerprint into the ring), the same at any world size by construction.
2. micro: 2, 4 and 8 gloo ranks, `dist.all_reduce(float32[1])` in a loop, guard off/on alternated:
   the difference is what the guard costs per collective with its watchdog thread running.
   The same loop under TORCH_DISTRIBUTED_DEBUG=DETAIL (torch's own collective fingerprint check).
3. fit: a tiny MLP (batch 64/rank) on 2 ranks (`--fit-worlds 2,4,8`: also 4 and 8) through Lightning's launcher, one
   `self.log(..., sync_dist=True)` per step; `ddp_sync` with guard=False and the default guard,
   alternated in one process (ABBA after a dropped warm-up fit) so machine noise hits both; median time of
   one loop iteration (batch start to the next batch start: the step, the hooks and checks around it).
   (DETAIL is not measured here: with it, DDP's constructor dies with SIGSEGV on gloo in torch 2.13.)
4. main job (--main): `lsync-train experiment=digits_cpu_ddp` with the guard on and off, alternated;
   wall time of the fit.
Ratios are what hold on a shared machine; absolute times are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _elements(rank: int, world: int, n: int, port: int) -> dict:
    """gloo's all-reduce (MAX) of 1, 2, 3, 4 and 16 int64, each size in turn, 3 rounds: what the guard's
    confirmation costs by the size of what it sends (it sends 2)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out: dict[int, list[float]] = {}
    for _ in range(3):
        for size in (1, 2, 3, 4, 16):
            t = torch.ones(size, dtype=torch.int64)
            for _ in range(20):
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out.setdefault(size, []).append((time.perf_counter() - start) / n * 1e6)
    dist.destroy_process_group()
    return {size: statistics.median(v) for size, v in out.items()}


def _micro(rank: int, world: int, n: int, port: int, detail: bool = False) -> dict:
    import torch
    import torch.distributed as dist

    if detail:  # torch's own check: a fingerprint all-gather + monitored barrier before every collective
        dist.set_debug_level(dist.DebugLevel.DETAIL)
        x = torch.ones(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        for _ in range(20):
            dist.all_reduce(x)
        times = []
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(x)
            times.append((time.perf_counter() - start) / n * 1e6)
        dist.destroy_process_group()
        return {"detail": statistics.median(times)}

    # TCP rendezvous, as under Lightning/torchrun: the watchdog talks to the TCPStore server
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    from lightning_sync.guard import CollectiveGuard

    x = torch.ones(1)
    out: dict[str, list[float]] = {"off": [], "on": []}
    for label in ("off", "on") * 3:
        guard = CollectiveGuard(timeout=60) if label == "on" else None
        if guard:
            guard.install()
        for _ in range(20):
            dist.all_reduce(x)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        out[label].append((time.perf_counter() - start) / n * 1e6)
        if guard:
            guard.uninstall()
    dist.destroy_process_group()
    return {k: statistics.median(v) for k, v in out.items()}


def _hot_path(n: int = 20000) -> float:
    """Microseconds per guarded call spent in the guard itself (site lookup + fingerprint)."""
    from lightning_sync.guard.callsite import CallSites
    from lightning_sync.guard.fingerprint import Recorder
    from lightning_sync.guard.intercept import match_of

    import torch

    sites, recorder = CallSites(lambda: "training_step"), Recorder()
    t = torch.ones(1)
    start = time.perf_counter()
    for _ in range(n):
        match, _ = match_of("all_reduce", (t,), {})
        recorder.record("w", "all_reduce", match, sites.find(sys._getframe()))
        recorder.enter("w")
        recorder.busy = None
        recorder.take_unpublished() if len(recorder._unpublished) > 500 else None
    return (time.perf_counter() - start) / n * 1e6


def _fit(steps: int, repeats: int, out: Path, labels: tuple[str, ...], devices: int = 2) -> None:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_sync as ls

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
            self.times: list[float] = []
            self._t = 0.0

        def on_train_batch_start(self, batch, batch_idx):
            # one loop iteration, start to start: the step, the hooks around it (the strategy's
            # per-step checks included) and the next batch's fetch
            now = time.perf_counter()
            if self._t:
                self.times.append(now - self._t)
            self._t = now

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.set_num_threads(1)
    data = TensorDataset(torch.randn(64 * devices * steps, 32), torch.randn(64 * devices * steps))
    results: dict[str, list[float]] = {label: [] for label in labels}
    # A first fit warms the process up (it measured 10-20% slower than later ones) and is dropped;
    # then ABBA order, so a drift within the process hits both labels alike.
    order = [labels[0]] + [label for _ in range(repeats) for label in (*labels, *reversed(labels))]
    for i, label in enumerate(order):
        model = MLP()
        trainer = L.Trainer(accelerator="cpu", devices=devices,
                            strategy=ls.SyncDDPStrategy(seed=0, guard=_guard_setting(label)),
                            max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(model, DataLoader(data, batch_size=64))
        if i > 0:
            results[label].append(statistics.median(model.times[20:]) * 1e3)
        if trainer.global_rank == 0:
            (out / "fit.json").write_text(json.dumps(results))


def _guard_setting(label: str) -> object:
    """``off``: guard=False; ``on``: the default guard; ``on<S>`` (e.g. ``on1``): a guard whose watchdog turns every S s."""
    if label == "off":
        return False
    if label == "on":
        return True
    from lightning_sync.guard import CollectiveGuard

    return CollectiveGuard(interval=float(label[2:]))


def _main_job(repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"off": [], "on": []}
    exe = Path(sys.executable).with_name("lsync-train")
    for _ in range(repeats):
        for label in ("off", "on", "on", "off"):  # ABBA: a drift of the machine hits both alike
            with tempfile.TemporaryDirectory() as tmp:
                extra = ["+trainer.strategy.guard=false"] if label == "off" else []
                start = time.perf_counter()
                subprocess.run(["timeout", "-k", "5", "900", str(exe), "experiment=digits_cpu_ddp",
                                f"hydra.run.dir={tmp}", *extra], check=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1])
                times[label].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--micro-n", type=int, default=1000)
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--main", action="store_true", help="also time the main job (minutes)")
    parser.add_argument("--fit-out", type=Path)
    parser.add_argument("--labels", default="off,on")
    parser.add_argument("--fit-only", action="store_true", help="skip the hot-path and micro parts")
    parser.add_argument("--fit-worlds", default="2", help="ranks of the fit, e.g. 2,4,8 (the synced step's cost "
                        "with the world size)")
    parser.add_argument("--elements", action="store_true", help="only gloo's all-reduce of 1-16 int64 at --worlds "
                        "(why the guard's confirmation sends two)")
    parser.add_argument("--devices", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fit_out is not None:
        _fit(args.steps, args.repeats, args.fit_out, tuple(args.labels.split(",")), args.devices)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tests.distributed import run_ranks

    if args.elements:
        for world in map(int, args.worlds.split(",")):
            sizes = run_ranks(_elements, world, args=(args.micro_n, _port()), timeout=900, init=False)[0]
            print(f"{world} ranks, gloo all_reduce MAX of int64[n], us: "
                  + "  ".join(f"n={k}: {v:.0f}" for k, v in sizes.items()))
        return
    print(f"guard hot path (site lookup + fingerprint, no communication): {_hot_path():.1f} us per collective")
    for world in ([] if args.fit_only else map(int, args.worlds.split(","))):
        micro = run_ranks(_micro, world, args=(args.micro_n, _port()), timeout=900, init=False)
        off = statistics.median(m["off"] for m in micro)
        on = statistics.median(m["on"] for m in micro)
        detail = statistics.median(
            m["detail"] for m in run_ranks(_micro, world, args=(args.micro_n, _port(), True), timeout=900, init=False))
        print(f"{world} ranks: dist.all_reduce(float32[1]) off {off:8.1f} us  guard {on:8.1f} us ({on / off:5.2f}x, "
              f"{on - off:+7.1f} us per collective)  DETAIL {detail:8.1f} us ({detail / off:5.2f}x)")
    # TORCH_DISTRIBUTED_DEBUG=DETAIL is measured in the micro part only: with it, DDP's constructor dies
    # with SIGSEGV on gloo in torch 2.13 (DDP's Logger.set_construction_data_and_log), set before torch
    # starts or at run time alike.
    for devices in map(int, args.fit_worlds.split(",")):
        fit: dict[str, list[float]] = {"off": [], "on": []}
        paired: list[float] = []  # per process pair: its guarded fits over its unguarded ones (off, on, on, off)
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run(["timeout", "-k", "5", "1800", sys.executable, __file__, "--fit-out", tmp,
                                "--steps", str(args.steps), "--repeats", "1", "--labels", "off,on",
                                "--devices", str(devices)], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
                one = json.loads((Path(tmp) / "fit.json").read_text())
                for k, v in one.items():
                    fit[k] += v
                paired.append(sum(one["on"]) / sum(one["off"]))
        for name, pick in (("median", statistics.median), ("best", min)):
            s_off, s_on = (pick(fit[k]) for k in ("off", "on"))
            print(f"{devices} ranks, MLP step + 1 sync_dist ({name} fit): off {s_off:.3f} ms  guard {s_on:.3f} ms "
                  f"({s_on / s_off:.3f}x)")
        # The steadiest figure: processes differ by up to +-20% in speed here, and a process's own
        # off, on, on, off fits share its speed
        print(f"{devices} ranks, MLP step + 1 sync_dist (paired: median over {len(paired)} process pairs of their "
              f"on/off ratio): {statistics.median(paired):.3f}x (pairs {['%.3f' % r for r in sorted(paired)]})")
        print("(per-fit medians, ms: " + "; ".join(f"{k} {['%.2f' % t for t in v]}" for k, v in fit.items())
              + f"; {args.steps} steps per fit, {devices} ranks, gloo)")
    if args.main:
        times = _main_job(2)
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        print(f"main job (lsync-train experiment=digits_cpu_ddp), wall s: off {times['off']}  on {times['on']}  "
              f"ratio {on / off:.3f}")


if __name__ == "__main__":
    main()
