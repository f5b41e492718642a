"""Check that your own LightningModule trains the same model on N ranks as on one.

:func:`check_world_size_invariance` trains the module on each world size in real processes under
``SyncDDPStrategy(world_size_invariant=True)`` (Lightning's launcher, gloo on CPU by default), records every
step's global-batch loss and gradient norm, the final weights and every rank's logged metrics, and compares each
world size with the first (metrics after every step, ``trainer.callback_metrics``, and at the end). The report
names the first step and quantity that differ and the likely cause in your code, with the fix; it never changes
your code (no layer converted that you did not ask for)::

    from lightning_sync.testing import assert_world_size_invariant

    def test_my_model_is_world_size_invariant():
        assert_world_size_invariant("my_project.model:build", "my_project.data:train_loader", world_sizes=(1, 2))

Factories are importable callables (a function, or ``"module:name"``; a script's own functions work too): the
model factory returns the LightningModule, the data factories the *one-process* DataLoaders (``batch_size`` is
the global batch; each rank takes its slice). Also a command: ``lsync-doctor invariance MODULE:MODEL
MODULE:TRAIN [MODULE:VAL] [--world-sizes 1,2] [--max-steps 20] [--sync-batchnorm] [--trainer KEY=VALUE ...]``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_sync.invariance import CHECK_DRAWS_ENV, GENERATORS, generator_digests

__all__ = ["InvarianceReport", "assert_world_size_invariant", "check_world_size_invariance", "main"]

Factory = Callable[[], Any] | str


@dataclass
class InvarianceReport:
    """What :func:`check_world_size_invariance` found.

    Attributes:
        ok: every world size matched the first within ``rtol`` (losses, gradient norms, weights, metrics).
        causes: the likely causes of a difference, each with its fix (empty when ``ok``).
        first_difference: the first step and quantity that differ, in words (None when ``ok``).
        world_sizes: the world sizes compared (the first is the reference).
        gaps: per world size, the largest relative difference of each quantity.
        tips: what would make the run cheaper and keep it invariant (a passing check only), e.g. the
            ``keyed_generators`` the training samples need.
    """

    ok: bool
    causes: list[str]
    first_difference: str | None
    world_sizes: tuple[int, ...]
    gaps: dict[int, dict[str, float]] = field(default_factory=dict)
    tips: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        sizes = " vs ".join(_ranks(n) for n in self.world_sizes)
        if self.ok:
            worst = max((g for gaps in self.gaps.values() for g in gaps.values()), default=0.0)
            return "\n".join([f"world-size invariance: OK ({sizes}; largest relative difference {worst:.1e})",
                              *(f"  tip: {tip}" for tip in self.tips)])
        lines = [f"world-size invariance: FAILED ({sizes})"]
        if self.first_difference:
            lines.append(f"  first difference: {self.first_difference}")
        lines += [f"  likely cause: {c}" for c in self.causes] or [
            "  likely cause: none of the known ones was found (a random draw of your own outside training_step - a "
            "collate_fn, a callback -, a reduction of your own over ranks, or state kept per rank)."]
        return "\n".join(lines)


def check_world_size_invariance(model_factory: Factory, train_data: Factory, val_data: Factory | None = None,
                                world_sizes: Sequence[int] = (1, 2), max_steps: int = 20, *, seed: int = 1234,
                                rtol: float = 1e-5, weights_rtol: float | None = None, timeout: float = 600.0,
                                **trainer_kwargs: Any) -> InvarianceReport:
    """Train ``model_factory()`` on each of ``world_sizes`` (real processes) and compare them.

    Args:
        model_factory: returns the LightningModule (a new one per call, initialised the same way).
        train_data: returns the one-process training DataLoader (``batch_size``: the global batch).
        val_data: returns the validation DataLoader, or None (no validation).
        world_sizes: the first is the reference (1: one process).
        max_steps: training steps of each run.
        seed: the root seed of every run.
        rtol: the largest relative difference taken as float rounding.
        weights_rtol: the same for the final weights (default ``rtol``). Adam-type optimizers divide each
            gradient component by its running scale, so a rounding difference in a near-zero component becomes a
            full step: with them the weights drift apart by ~lr x steps while every step's loss and gradient agree
            (the report says so); pass a looser bound for the weights then.
        timeout: seconds each run may take before it is stopped (a hang is reported, not waited on).
        trainer_kwargs: more ``Trainer`` arguments (default: ``accelerator="cpu"``, no logger, no checkpoints).
    """
    reserved = sorted(set(trainer_kwargs) & {"devices", "num_nodes", "strategy"})
    if reserved:
        raise ValueError(f"check_world_size_invariance: Trainer argument(s) {', '.join(reserved)} are the checker's "
                         "own (world_sizes= sets the devices of each run on one node; the strategy is "
                         "SyncDDPStrategy(world_size_invariant=True)): drop them.")
    sizes = tuple(int(n) for n in world_sizes)
    if len(sizes) < 2 or min(sizes) < 1:
        raise ValueError(f"check_world_size_invariance: world_sizes={tuple(world_sizes)!r}: give two or more sizes "
                         "of at least 1 (the first is the reference), e.g. (1, 2).")
    spec = {"model": _spec(model_factory, "model_factory"), "train": _spec(train_data, "train_data"),
            "val": _spec(val_data, "val_data") if val_data is not None else None, "max_steps": int(max_steps),
            "seed": int(seed), "trainer_kwargs": trainer_kwargs, "path": list(sys.path)}
    runs: dict[int, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="lsync-invariance-") as tmp:
        for n in sizes:
            runs[n] = _launch(Path(tmp) / f"world{n}", {**spec, "world_size": n}, timeout)
    return compare_runs(runs, rtol, rtol if weights_rtol is None else weights_rtol)


def assert_world_size_invariant(*args: Any, **kwargs: Any) -> InvarianceReport:
    """:func:`check_world_size_invariance`, raising ``AssertionError(str(report))`` when it is not ok (pytest)."""
    report = check_world_size_invariance(*args, **kwargs)
    if not report.ok:
        raise AssertionError(str(report))
    return report


# --------------------------------------------------------------------------- the parent: launch and compare


def _spec(factory: Factory, what: str) -> str:
    if isinstance(factory, str):
        if ":" not in factory:
            raise ValueError(f"check_world_size_invariance: {what}={factory!r}: use 'module:function' (or the "
                             "function itself).")
        try:  # here, before any run starts: a typo is named in a second, not after every run failed on it
            found = _resolve(factory)
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # noqa: BLE001 - the user's module: whatever it raises (a SystemExit of
            # a parse_args() at its top level too) is named here, not taken for this program's exit
            raise ValueError(f"check_world_size_invariance: {what}={factory!r} cannot be imported: "
                             f"{type(err).__name__}: {err}") from err
        if not callable(found):
            raise ValueError(f"check_world_size_invariance: {what}={factory!r} is a {type(found).__name__}, not a "
                             "function returning one.")
        return factory
    module, name = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not callable(factory) or module is None or "<" in name:
        raise ValueError(f"check_world_size_invariance: {what}={factory!r} is not an importable function: each "
                         "world size runs in new processes, which import it. Define it at a module's top level.")
    if module == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        if path is None:
            raise ValueError(f"check_world_size_invariance: {what} is defined in an interactive session; new "
                             "processes cannot import it. Define it in a module (a .py file) and import it.")
        return f"{os.path.abspath(path)}:{name}"
    return f"{module}:{name}"


def _launch(out: Path, spec: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    out.mkdir(parents=True)
    (out / "spec.pkl").write_bytes(pickle.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in spec["path"] if p))
    env.pop("LOCAL_RANK", None)
    draws = out / "sample_draws"  # where every loading process notes the generators each training sample moved
    draws.mkdir()
    env[CHECK_DRAWS_ENV] = str(draws)
    n = spec["world_size"]
    proc = subprocess.Popen([sys.executable, "-m", "lightning_sync.testing", "--child", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        problem = f"with exit code {proc.returncode}; its last output:\n{(stderr or stdout)[-3000:]}" \
            if proc.returncode != 0 else None
    except subprocess.TimeoutExpired:
        # every process of the run (Lightning's launcher starts the other ranks in this session), not the first only
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # (a process of its own session may hold the pipes)
            proc.communicate(timeout=10)
        problem = None
    records = []
    for rank in range(n):
        path = out / f"rank{rank}.pkl"
        try:
            records.append(pickle.loads(path.read_bytes()) if path.exists() else {})
        except Exception:  # noqa: BLE001 - a record cut short: that rank did not finish
            records.append({})
    if problem is None and proc.returncode != 0:  # stopped at the timeout
        unfinished = [rank for rank, rec in enumerate(records) if not rec]
        problem = (f"it did not finish within {timeout:.0f} s (timeout=), so every process of it was ended; "
                   f"rank(s) {', '.join(map(str, unfinished))} had not ended their fit: a rank waiting in a collective "
                   "the others never reach (a hang), or a run slower than the timeout allows")
    if problem is not None and not any(rec.get("error") for rec in records):
        records[0] = {**records[0], "error": problem, "whole_run": True}
    noted = {(name, int(sample), kind) for path in draws.glob("draws-*.txt")
             for name, sample, kind in (line.split() for line in path.read_text().splitlines() if line.strip())}
    records[0] = {**records[0], "unkeyed_draws": sorted((n, i) for n, i, kind in noted if kind == "unkeyed"),
                  "keyed_used": sorted({n for n, _, kind in noted if kind == "keyed"})}
    return records


def _global_losses(records: list[dict[str, Any]]) -> dict[tuple[int, int], float]:
    """Per (epoch, batch): the global batch's loss, each rank's mean weighted by its rows (stand-ins count 0)."""
    total: dict[tuple[int, int], list[float]] = {}
    for rec in records:
        for epoch, batch, loss, rows in rec.get("losses", []):
            acc = total.setdefault((epoch, batch), [0.0, 0.0])
            acc[0] += loss * rows
            acc[1] += rows
    return {k: s / n for k, (s, n) in sorted(total.items()) if n}


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def compare_runs(runs: dict[int, list[dict[str, Any]]], rtol: float,
                 weights_rtol: float | None = None) -> InvarianceReport:
    """The report of runs recorded by the child processes (``runs[world size]``: every rank's record)."""
    weights_rtol = rtol if weights_rtol is None else weights_rtol
    sizes = tuple(runs)
    stopped: dict[str, list[str]] = {}  # an error, and the runs it stopped (one line for the same error)
    for n, records in runs.items():
        for rank, rec in enumerate(records):
            if rec.get("error"):
                where = f"the {n}-rank run" if rec.get("whole_run") else f"the {n}-rank run (rank {rank})"
                stopped.setdefault(str(rec["error"]), []).append(where)
                break
    causes = [f"{' and '.join(where)} stopped: {error}" for error, where in stopped.items()]
    if causes:
        return InvarianceReport(False, causes, "a run did not complete", sizes)
    ref_n = sizes[0]
    ref = runs[ref_n]
    ref_losses, ref_norms = _global_losses(ref), ref[0].get("grad_norms", [])
    first: tuple[int, str] | None = None
    gaps: dict[int, dict[str, float]] = {}
    for n in sizes[1:]:
        recs = runs[n]
        losses, norms = _global_losses(recs), recs[0].get("grad_norms", [])
        gap = {"loss": 0.0, "grad_norm": 0.0, "weights": 0.0, "metrics": 0.0}
        for i, key in enumerate(ref_losses):
            g = _rel(ref_losses[key], losses.get(key, math.nan))
            gap["loss"] = max(gap["loss"], g)
            if g > rtol and (first is None or i < first[0]):
                first = (i, f"step {i} (epoch {key[0]}, batch {key[1]}): the global batch's loss is "
                            f"{ref_losses[key]:.7g} on {_ranks(ref_n)}, {losses.get(key, math.nan):.7g} on {_ranks(n)} "
                            f"(relative {g:.1e})")
        for i, (a, b) in enumerate(zip(ref_norms, norms)):
            g = _rel(a, b)
            gap["grad_norm"] = max(gap["grad_norm"], g)
            if g > rtol and (first is None or i < first[0]):
                first = (i, f"step {i}: the gradient norm after DDP's all-reduce is {a:.7g} on {_ranks(ref_n)}, "
                            f"{b:.7g} on {_ranks(n)} (relative {g:.1e})")
        for i, logged in enumerate(ref[0].get("step_metrics", [])):
            for name, value in logged.items():
                for rank, rec in enumerate(recs):
                    steps = rec.get("step_metrics", [])
                    other = steps[i].get(name, math.nan) if i < len(steps) else math.nan
                    g = _rel(value, other)
                    gap["metrics"] = max(gap["metrics"], g)
                    if g > rtol and (first is None or i < first[0]):
                        first = (i, f"step {i}: logged metric {name!r} is {value:.7g} on {_ranks(ref_n)}, "
                                    f"{other:.7g} on rank {rank} of {n}")
        if len(norms) != len(ref_norms) and first is None:
            first = (min(len(norms), len(ref_norms)), f"{len(ref_norms)} optimizer steps on {_ranks(ref_n)}, "
                                                       f"{len(norms)} on {_ranks(n)}")
        w_ref, w = ref[0].get("weights", {}), recs[0].get("weights", {})
        scale = max((float(v.abs().max()) for v in w_ref.values()), default=1.0) or 1.0
        for k, v in w_ref.items():
            g = float((v - w[k]).abs().max()) / scale if k in w and w[k].shape == v.shape else math.inf
            gap["weights"] = max(gap["weights"], g)
        if gap["weights"] > weights_rtol and first is None:
            first = (1 << 30, f"the final weights differ by {gap['weights']:.1e} of their largest value")
        for name, value in ref[0].get("metrics", {}).items():
            for rank, rec in enumerate(recs):
                other = rec.get("metrics", {}).get(name, math.nan)
                g = _rel(value, other)
                gap["metrics"] = max(gap["metrics"], g)
                if g > rtol and first is None:
                    first = (1 << 31, f"logged metric {name!r}: {value:.7g} on {_ranks(ref_n)}, {other:.7g} on rank "
                                      f"{rank} of {n}")
        gaps[n] = gap
    drew_unkeyed = any(rec.get("unkeyed_draws") for recs in runs.values() for rec in recs)
    ok = first is None and not drew_unkeyed
    causes = [] if ok else _causes(runs, ref_losses)
    if first is None and drew_unkeyed:  # nothing differed in these steps, by chance: the declaration is still wrong
        first = (0, "no step differed within rtol, but training samples drew from a global generator that was not "
                    "seeded for them, so another run, world size or augmentation may differ")
    if (not ok and first is not None and "logged metric" in first[1] and not causes
            and all(g["loss"] <= rtol and g["grad_norm"] <= rtol and g["weights"] <= weights_rtol for g in gaps.values())):
        causes.append(
            "every step's loss and gradient norm and the final weights agree; only logged metrics differ, so they come "
            "from other inputs than the training batches, or are reduced over ranks in a way of your own: most often "
            "a validation set that draws random numbers while loading a sample (augmentation; world_size_invariant="
            "True keys the training set's samples only, evaluation samples draw from each rank's own stream), else a "
            "value kept or reduced per rank (a sync_dist reduction other than the mean, state of your own). Fix: no "
            "random augmentation in the validation Dataset, or seed it from the sample's index in __getitem__ (e.g. "
            "torch.Generator().manual_seed(i)); log sample means with sync_dist=True or torchmetrics.")
    if not ok and first is not None and first[0] == 1 << 30:  # only the weights differ: every step agreed
        causes.append(
            f"every step's loss, gradient norm and logged metrics agree within {rtol:g}; only the final weights "
            "differ: the optimizer amplifies the all-reduce's float rounding (Adam-type optimizers divide each "
            "gradient component by its running scale, so a rounding difference in a near-zero component becomes a "
            "full step). What is trained is the same. Fix: none needed; compare with weights_rtol= a bound of "
            "about lr x steps, or check with SGD.")
    return InvarianceReport(ok, causes, None if first is None else first[1], sizes, gaps,
                            _keying_tips(runs) if ok else [])


def _keying_tips(runs: dict[int, list[dict[str, Any]]]) -> list[str]:
    """Where the training samples moved fewer global generators than were seeded for them: the declaration that
    seeds only those."""
    reference = next(iter(runs.values()), [])
    first = reference[0] if reference else {}
    seeded, used = first.get("keyed_generators"), first.get("keyed_used")
    if seeded is None or used is None:
        return []
    needed = tuple(name for name in seeded if name in used)
    if needed == tuple(seeded):
        return []
    whose = " and ".join(f"{name}'s" for name in needed)
    drew = f"drew only from {whose} generator{'s' if len(needed) > 1 else ''}" if needed else \
        "drew from none of the global generators"
    seeded_text = ", ".join(f"{name}'s" for name in seeded)
    owner = str(first.get("keyed_by") or "")
    declare = (f"{owner} = {needed!r}" if owner.endswith(".keyed_generators") else
               f"keyed_generators = {needed!r} on the {first.get('train_set') or 'training Dataset'} class")
    return [f"the training samples {drew} in these runs ({seeded_text} seeded before each): {declare} seeds only "
            "what they use (with torch's alone keyed loading costs about a third of all three's; "
            "docs/invariance.md). This check sees a generator's state move: declare every generator __getitem__ "
            "draws from, also one whose state it puts back (isolate_rng)."]


def _causes(runs: dict[int, list[dict[str, Any]]], ref_losses: dict[tuple[int, int], float]) -> list[str]:
    causes: list[str] = []
    every = [(n, rank, rec) for n, recs in runs.items() for rank, rec in enumerate(recs)]
    bn = next((rec["batchnorm_per_rank"] for _, _, rec in every if rec.get("batchnorm_per_rank")), None)
    if bn and any(n > 1 for n in runs):
        causes.append(f"BatchNorm layers without synchronised statistics ({_names(bn)}): each rank normalises by "
                      "its own slice of the batch. Fix: Trainer(sync_batchnorm=True) (or "
                      "lightning_sync.convert_sync_batchnorm(model)).")
    draws = [d for _, _, rec in every for d in rec.get("global_rng", [])]
    if draws:
        steps = sorted({d["step"] for d in draws})
        generators = [g for g in ("torch", "numpy", "random") if any(g in d["generators"] for d in draws)]
        modules = sorted({m for d in draws for m in d["modules"]})
        where = [f"torch's in the forward of {_names(modules)} (F.dropout, torch.rand or a dropout layer left per rank "
                 "there)"] if modules else []
        if any("torch" in d["generators"] and not d["modules"] for d in draws):
            where.append("torch's in training_step itself, outside any submodule's forward (e.g. torch.rand or "
                         "torch.randn_like there)")
        other = [f"{g}'s" for g in ("numpy", "random") if g in generators]
        if other:
            where.append(f"{' and '.join(other)} (np.random or random calls in training_step or a forward)")
        causes.append(f"the training step drew from the global random generators ({'/'.join(generators)}) at step(s) "
                      f"{_names([str(s) for s in steps])}: {'; '.join(where)}. Those numbers come from each rank's own "
                      "stream. Fix: draw per-sample randomness in Dataset.__getitem__ (keyed by the sample under "
                      "world_size_invariant=True) and use nn.Dropout layers.")
    first = next(iter(ref_losses), None)
    for n, recs in runs.items():
        if n == 1 or first is None:
            continue
        step0 = [(loss, rows) for rec in recs for e, b, loss, rows in rec.get("losses", []) if (e, b) == first and rows]
        total = sum(loss for loss, _ in step0)
        if step0 and _rel(total, ref_losses[first]) < 1e-4 and _rel(ref_losses[first], total / len(step0)) > 1e-4:
            causes.append(f"the loss is summed over the batch: at the first step the {n} ranks' losses add up to the "
                          "one-process loss, and DDP averages the ranks' gradients, so N ranks train with 1/N of the "
                          "gradient. Fix: average over the batch (reduction='mean').")
            break
    for n, recs in runs.items():
        if n == 1:
            continue
        names = sorted({k for rec in recs for k in rec.get("metrics", {})})
        for name in names:
            values = [rec.get("metrics", {}).get(name, math.nan) for rec in recs]
            if any(_rel(values[0], v) > 1e-6 for v in values[1:]):
                shown = ", ".join(f"rank {r}: {v:.6g}" for r, v in enumerate(values))
                causes.append(f"metric {name!r} differs across the {n} ranks ({shown}): it is logged without "
                              f"sync_dist=True, so each rank keeps its own value. Fix: self.log({name!r}, value, "
                              "sync_dist=True), or log a torchmetrics object.")
        break
    unkeyed = sorted({(name, sample) for _, _, rec in every for name, sample in rec.get("unkeyed_draws", [])})
    if unkeyed:
        names = [g for g in GENERATORS if any(name == g for name, _ in unkeyed)]
        samples = sorted({sample for _, sample in unkeyed})
        keyed_by = next((rec["keyed_by"] for _, _, rec in every if rec.get("keyed_by")), None) or \
            "the data set's keyed_generators"
        whose = " and ".join(f"{g}'s" for g in names)
        plural = "s" if len(names) > 1 else ""
        causes.append(f"the training set's __getitem__ drew from {whose} global generator{plural} "
                      f"(sample(s) {_names([str(i) for i in samples])}), which {keyed_by} leaves unseeded: those "
                      "numbers come from each loading process's running stream, which depends on the number of "
                      "ranks. Fix: add "
                      f"{', '.join(repr(g) for g in names)} to {keyed_by} (or remove the attribute: all three "
                      "generators are then seeded).")
    left = next((rec["dropout_per_rank"] for _, _, rec in every if rec.get("dropout_per_rank")), None)
    if left:
        causes.append(f"dropout drawn per rank in {_names(left)} (only nn.Dropout and nn.Dropout1d/2d/3d layers key "
                      "their masks by the global batch's rows). Fix: use those layers, or no dropout there (as said "
                      "for each).")
    return causes


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _names(items: Sequence[str]) -> str:
    return ", ".join(items[:6]) + (f", ... ({len(items)} in all)" if len(items) > 6 else "")


# --------------------------------------------------------------------------- the child: one run, every rank


def _resolve(spec: str) -> Any:
    target, name = spec.rsplit(":", 1)
    if target.endswith(".py"):
        module_name = "_lsync_invariance_" + hashlib.blake2b(target.encode(), digest_size=6).hexdigest()
        module = sys.modules.get(module_name)
        if module is None:
            loaded = importlib.util.spec_from_file_location(module_name, target)
            assert loaded is not None and loaded.loader is not None
            module = importlib.util.module_from_spec(loaded)
            sys.modules[module_name] = module
            try:
                loaded.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]  # a later call (the file fixed) runs it again
                raise
    else:
        module = importlib.import_module(target)
    obj: Any = module
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


class _ForwardDraws:
    """Forward hooks on every submodule that note which ones' forward moved torch's global CPU generator (the
    innermost of nested ones are the callers to name)."""

    def __init__(self, module: Any) -> None:
        import torch

        self._torch = torch
        self._stack: list[Any] = []
        self.names: set[str] = set()
        self._handles: list[Any] = []
        for name, sub in module.named_modules():
            if name:
                self._handles.append(sub.register_forward_pre_hook(self._enter))
                self._handles.append(sub.register_forward_hook(self._leave(name)))

    def _enter(self, module: Any, args: Any) -> None:
        self._stack.append(self._torch.default_generator.get_state())

    def _leave(self, name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            if self._stack and not self._torch.equal(self._stack.pop(), self._torch.default_generator.get_state()):
                self.names.add(name)
        return hook

    def take(self) -> list[str]:
        """The innermost submodules whose forward drew since the last call."""
        names = sorted(n for n in self.names if not any(o.startswith(n + ".") for o in self.names))
        self.names.clear()
        self._stack.clear()
        return names

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _recorder(record: dict[str, Any]) -> Any:
    import lightning.pytorch as pl
    import torch

    from lightning_sync.batchnorm import per_rank_batchnorm
    from lightning_sync.invariance import make_dropout_invariant
    from lightning_sync.parts.invariant import WorldSizeInvariantPart

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self._rng: dict[str, bytes] = {}
            self._forward: _ForwardDraws | None = None

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            find = getattr(trainer.strategy, "part", None)
            part = find(WorldSizeInvariantPart) if callable(find) else None
            keyed = part.loader.dataset if part is not None and part.loader is not None else None
            record["keyed_by"] = getattr(keyed, "declared_by", None)
            record["keyed_generators"] = getattr(keyed, "generators", None)
            record["train_set"] = type(getattr(keyed, "dataset", None)).__name__
            record["batchnorm_per_rank"] = per_rank_batchnorm(pl_module)
            record["dropout_per_rank"] = make_dropout_invariant(pl_module)[1]  # already converted: only reads
            self._forward = _ForwardDraws(pl_module)

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            self._rng = dict(zip(GENERATORS, generator_digests()))
            if self._forward is not None:
                self._forward.take()

        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                     optimizer: Any) -> None:
            grads = [p.grad.detach().double().pow(2).sum() for p in pl_module.parameters() if p.grad is not None]
            record["grad_norms"].append(float(torch.stack(grads).sum().sqrt()) if grads else 0.0)

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            find = getattr(trainer.strategy, "part", None)
            part = find(WorldSizeInvariantPart) if callable(find) else None
            rows = part.loader.plan.sizes(batch_idx)[part.loader.plan.rank] if part is not None and part.loader else 0
            if isinstance(loss, torch.Tensor):
                record["losses"].append((trainer.current_epoch, batch_idx, float(loss.detach()), rows))
            now = dict(zip(GENERATORS, generator_digests()))
            moved = [name for name, digest in now.items() if self._rng.get(name) != digest]
            inside = self._forward.take() if self._forward is not None else []
            if moved:
                record["global_rng"].append({"step": len(record["losses"]) - 1, "generators": moved,
                                             "modules": inside if "torch" in moved else []})
            record["step_metrics"].append({k: float(v) for k, v in trainer.callback_metrics.items()
                                           if isinstance(v, torch.Tensor) and v.numel() == 1})

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if self._forward is not None:
                self._forward.remove()
            if trainer.global_rank == 0:
                record["weights"] = {k: v.detach().double().cpu() for k, v in pl_module.state_dict().items()
                                     if v.is_floating_point()}

    return Recorder()


def _child(out: Path) -> int:
    spec = pickle.loads((out / "spec.pkl").read_bytes())
    for entry in reversed(spec["path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    record: dict[str, Any] = {"losses": [], "grad_norms": [], "global_rng": [], "metrics": {},
                              "step_metrics": []}
    try:
        import lightning.pytorch as pl
        import torch

        import lightning_sync as ls

        pl.seed_everything(spec["seed"], verbose=False)
        model = _resolve(spec["model"])()
        train = _resolve(spec["train"])()
        val = _resolve(spec["val"])() if spec["val"] else None
        kwargs: dict[str, Any] = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False,
                                  "enable_progress_bar": False, "enable_model_summary": False,
                                  "max_steps": spec["max_steps"], "num_sanity_val_steps": 0}
        kwargs.update(spec["trainer_kwargs"])
        kwargs["callbacks"] = [*list(kwargs.get("callbacks") or []), _recorder(record)]
        kwargs.update(devices=spec["world_size"], num_nodes=1,
                      strategy=ls.SyncDDPStrategy(seed=spec["seed"], world_size_invariant=True))
        if val is None:
            kwargs.setdefault("limit_val_batches", 0)
        trainer = pl.Trainer(**kwargs)
        rank = trainer.global_rank
        trainer.fit(model, train, val)
        record["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()
                             if isinstance(v, torch.Tensor) and v.numel() == 1}
        code = 0
    except Exception as err:  # noqa: BLE001 - reported to the parent, which names it in the report
        record["error"] = f"{type(err).__name__}: {err}"
        traceback.print_exc()
        code = 1
    tmp = out / f"rank{rank}.pkl.tmp"
    tmp.write_bytes(pickle.dumps(record))
    os.replace(tmp, out / f"rank{rank}.pkl")  # whole or not at all: a rank killed while writing leaves no record
    return code


# --------------------------------------------------------------------------- the command


def main(argv: list[str] | None = None) -> int:
    """``lsync-doctor invariance MODULE:MODEL MODULE:TRAIN [MODULE:VAL]``: print the report; exit 0 when ok."""
    parser = argparse.ArgumentParser(
        prog="lsync-doctor invariance",
        description="Train your LightningModule on each world size (real processes, world_size_invariant=True) and "
        "say whether N ranks train the one-process model, and if not, why.")
    parser.add_argument("model", help="MODULE:FUNCTION returning the LightningModule")
    parser.add_argument("train", help="MODULE:FUNCTION returning the one-process training DataLoader")
    parser.add_argument("val", nargs="?", default=None, help="MODULE:FUNCTION returning the validation DataLoader")
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated; the first is the reference")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--weights-rtol", type=float, default=None,
                        help="the bound for the final weights (default --rtol; Adam-type optimizers: about lr x steps)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--sync-batchnorm", action="store_true", help="Trainer(sync_batchnorm=True)")
    parser.add_argument("--accelerator", default=None, help="Trainer(accelerator=...) (default cpu)")
    parser.add_argument("--trainer", action="append", default=[], metavar="KEY=VALUE",
                        help="another Trainer argument (repeatable), e.g. --trainer precision=bf16-mixed "
                        "--trainer accumulate_grad_batches=2 (VALUE read as a Python literal, else a string)")
    args = parser.parse_args(argv)
    try:
        sizes = tuple(int(s) for s in args.world_sizes.split(","))
    except ValueError:
        parser.error(f"--world-sizes {args.world_sizes!r}: use comma-separated integers, e.g. 1,2")
    trainer_kwargs: dict[str, Any] = {}
    checker_own = set(inspect.signature(check_world_size_invariance).parameters) - {"trainer_kwargs"}
    for item in args.trainer:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            parser.error(f"--trainer {item!r}: use KEY=VALUE, e.g. --trainer accumulate_grad_batches=2")
        if key in checker_own:
            option = f" (--{key.replace('_', '-')})" if key in vars(args) else ""  # (an option of this command)
            parser.error(f"--trainer {item!r}: {key} is not a Trainer argument but the checker's own{option}.")
        try:
            trainer_kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            trainer_kwargs[key] = value
    if args.sync_batchnorm:
        trainer_kwargs["sync_batchnorm"] = True
    if args.accelerator:
        trainer_kwargs["accelerator"] = args.accelerator
    sys.path.insert(0, os.getcwd())
    try:
        report = check_world_size_invariance(args.model, args.train, args.val, world_sizes=sizes,
                                             max_steps=args.max_steps, rtol=args.rtol, weights_rtol=args.weights_rtol,
                                             timeout=args.timeout, **trainer_kwargs)
    except ValueError as err:
        parser.error(str(err))
    print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(_child(Path(sys.argv[2])))
    sys.exit(main())
