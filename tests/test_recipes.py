"""Every recipe in recipes/ runs in the suite and shows what it claims.

The sync recipes (recipes/*.py) run on 2 CPU processes, shrunk by their arguments: each test launches
the recipe exactly as its docstring says (Lightning's launcher or torchrun), under `timeout -k 5`,
then re-derives the property from the per-rank lines the recipe prints instead of trusting the
recipe's own verdict (the averaged loss against each rank's loss, the digests of every rank, the
shards of every rank).

The launch recipes (recipes/launch_*) run on the two-node test cluster with lsync-doctor as the
payload (marked `cluster`: root and network namespaces). Point SCRIPT at the training job instead of
the doctor to test training launches the same way.
"""

from __future__ import annotations

import ast
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import Cluster

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
TIMEOUT = 300  # generous: the CI machine is shared; a healthy run takes 5-30 s
#: pytest's limit for a test that launches one recipe: above run()'s own limits, so a hang fails there
#: (killing the launcher and its ranks) before pytest gives up on the test.
ONE_RUN = pytest.mark.timeout(TIMEOUT + 30 + 60)

DOCTOR = {"SCRIPT": "python -m lightning_sync.doctor"}

#: recipe file -> the test that runs it (tests/test_docs.py uses this to accept commands in the docs).
RUNS: dict[str, str] = {
    "ddp_basics.py": "test_ddp_basics_gradients_and_parameters_agree",
    "loss_averaging.py": "test_loss_averaging_equals_mean_of_rank_losses",
    "broadcast_decision.py": "test_broadcast_decision_and_the_rank_divergent_mistake",
    "exact_validation.py": "test_exact_validation_counts_every_sample_once",
    "syncbn.py": "test_syncbn_running_stats_are_union_statistics",
    "local_sgd.py": "test_local_sgd_ranks_identical_after_each_average",
    "seeds.py": "test_seeds_equal_where_needed_different_where_needed",
    "distributed_sampler.py": "test_distributed_sampler_shards_and_set_epoch",
    "init_process_group.py": "test_init_process_group_env_and_file_rendezvous",
    "predict_to_parquet.py": "test_predict_to_parquet_index_once_in_order",
    "fsdp2.py": "test_fsdp2_validation_equals_one_process_under_model_parallel_sync",
    "uneven_streams.py": "test_uneven_streams_train_every_sample_where_ddp_hangs",
    "world_size_invariance.py": "test_world_size_invariance_one_two_three_ranks_and_the_summed_loss",
    "fault_tolerant_ddp.py": "test_fault_tolerant_ddp_a_killed_group_recovers_and_both_end_equal",
}


def run(cmd: list[str], cwd: Path, timeout: int = TIMEOUT) -> str:
    """Run a launcher command under `timeout -k 5`; return its stdout (the recipes print there)."""
    # Not PYTHONUNBUFFERED: unbuffered, print() writes the text and its newline separately, and the
    # two ranks' lines interleave mid-line. Buffered, each `print(..., flush=True)` is one write.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(["timeout", "-k", "5", str(timeout), *cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout + 30)
    assert proc.returncode == 0, (f"{' '.join(cmd)}: exit {proc.returncode}\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout


def script(recipe: str, *args: str, cwd: Path) -> str:
    """`python recipes/X.py ARGS`: Lightning's launcher (or mp.spawn) starts the other rank itself."""
    return run([sys.executable, str(RECIPES / recipe), *args], cwd)


def torchrun(recipe: str, *args: str, cwd: Path) -> str:
    """`torchrun --standalone --nproc_per_node=2 recipes/X.py ARGS`."""
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                str(RECIPES / recipe), *args], cwd)


HEX = r"([0-9a-f]{12})"  # the recipes' digests: fixed width, so a glued-on next line cannot extend them
NUM = r"([-+]?\d[\d.e+-]*)"


def per_rank(pattern: str, out: str) -> dict[int, tuple[str, ...]]:
    """`{rank: groups}` for a pattern whose first group is the rank; exactly one match per rank of 2."""
    found: dict[int, tuple[str, ...]] = {}
    for m in re.finditer(pattern, out):  # finditer, not lines: two ranks' prints may share a line
        rank = int(m.group(1))
        assert rank not in found, f"rank {rank} printed {pattern!r} twice:\n{out}"
        found[rank] = m.groups()[1:]
    assert sorted(found) == [0, 1], f"expected ranks 0 and 1 to print {pattern!r}:\n{out}"
    return found


def test_every_recipe_is_tested_and_opens_with_its_commands() -> None:
    scripts = sorted(p.name for p in RECIPES.glob("*.py"))
    assert scripts and set(scripts) <= set(RUNS), f"recipes without a test: {set(scripts) - set(RUNS)}"
    tests = {name for name, obj in globals().items() if name.startswith("test_") and callable(obj)}
    assert set(RUNS.values()) <= tests, f"RUNS names missing tests: {set(RUNS.values()) - tests}"
    for name in scripts:
        source = (RECIPES / name).read_text()
        doc = ast.get_docstring(ast.parse(source)) or ""
        commands = [line.strip() for line in doc.splitlines() if re.match(r"\s*(python|torchrun|lsync-ft-run) ", line)]
        assert commands, f"{name}: the docstring must open with the exact launch commands"
        for command in commands:
            assert f"recipes/{name}" in command, f"{name}: {command!r} does not run this recipe"
            for flag in re.findall(r"(?<=\s)--[a-z][\w-]*", command.split("#")[0].split(f"recipes/{name}")[1]):
                assert f'"{flag}"' in source, f"{name}: its docstring uses {flag}, which the script does not define"
        assert len(source.splitlines()) < 100, f"{name}: keep recipes under 100 lines"


@pytest.mark.slow
@ONE_RUN
def test_ddp_basics_gradients_and_parameters_agree(tmp_path: Path) -> None:
    out = script("ddp_basics.py", "--max-steps", "3", cwd=tmp_path)
    losses = per_rank(r"rank (\d) step 0 local loss " + NUM, out)
    assert losses[0] != losses[1], "both ranks saw the same batch"
    grads = per_rank(r"rank (\d) step 0 gradient digest " + HEX, out)
    assert grads[0] == grads[1], "DDP did not average the gradients"
    params = per_rank(r"rank (\d) final parameter digest " + HEX, out)
    assert params[0] == params[1]
    assert "parameters identical across 2 ranks: True" in out


@pytest.mark.slow
@ONE_RUN
def test_loss_averaging_equals_mean_of_rank_losses(tmp_path: Path) -> None:
    out = script("loss_averaging.py", "--max-steps", "3", cwd=tmp_path)
    rank_values: dict[int, dict[int, tuple[float, int]]] = {}
    for m in re.finditer(r"rank (\d) step (\d+) loss " + NUM + r" n (\d+)", out):
        rank_values.setdefault(int(m.group(2)), {})[int(m.group(1))] = (float(m.group(3)), int(m.group(4)))
    reduced = {int(m.group(1)): tuple(map(float, m.group(2, 3, 4)))
               for m in re.finditer(rf"step (\d+) mean {NUM} sum/world {NUM} weighted {NUM}", out)}
    assert sorted(reduced) == sorted(rank_values) == [0, 1, 2], out
    for step, (mean, by_hand, weighted) in reduced.items():
        values = rank_values[step]
        assert sorted(values) == [0, 1]
        expect = sum(v for v, _ in values.values()) / 2
        expect_weighted = sum(v * n for v, n in values.values()) / sum(n for _, n in values.values())
        assert math.isclose(mean, expect, rel_tol=1e-6) and math.isclose(by_hand, expect, rel_tol=1e-6)
        assert math.isclose(weighted, expect_weighted, rel_tol=1e-6)


@pytest.mark.slow
@ONE_RUN
def test_broadcast_decision_and_the_rank_divergent_mistake(tmp_path: Path) -> None:
    out = script("broadcast_decision.py", "--max-epochs", "5", "--stop-after", "2", "--show-mistake",
                 "--ckpt-dir", str(tmp_path / "ckpt"), cwd=tmp_path)
    lr = per_rank(r"rank (\d) lr " + NUM, out)
    assert lr[0] == lr[1], "the hyperparameter differs across ranks"
    # The message names both calls; its wording depends on who caught it (the collectives' own check
    # or, under ddp_sync's collective guard, the guard with call sites), so only the facts are checked.
    caught = per_rank(r"rank (\d) caught CollectiveMismatchError: ([^\n]*ranks entered different collectives[^\n]*)",
                      out)
    for (message,) in caught.values():
        assert "rank 0" in message and "broadcast_object" in message and "gather_objects" in message, message
    stopped = per_rank(r"rank (\d) stopped after (\d+) epochs", out)
    assert stopped[0] == stopped[1] == ("2",), "ranks did not stop together at rank 0's decision"
    assert (tmp_path / "ckpt" / "best.ckpt").is_file()


@pytest.mark.slow
@ONE_RUN
def test_exact_validation_counts_every_sample_once(tmp_path: Path) -> None:
    out = script("exact_validation.py", "--size", "21", cwd=tmp_path)
    rows = per_rank(r"rank (\d) gathered (\d+) rows, index == range\(N\): (True|False)", out)
    assert rows[0] == rows[1] == ("21", "True")
    metrics = per_rank(rf"rank (\d) self.log: count (\d+) acc {NUM}; gathered: acc {NUM}", out)
    assert metrics[0] == metrics[1]
    count, logged_acc, gathered_acc = metrics[0]
    assert count == "21", "ddp_sync's plain self.log should count each of the 21 samples once (ddp: 22)"
    found = re.search(r"single-process accuracy over all 21 samples " + NUM, out)
    assert found, out
    reference = float(found.group(1))
    assert math.isclose(float(gathered_acc), reference, rel_tol=1e-6)
    assert math.isclose(float(logged_acc), reference, rel_tol=1e-6), "self.log's epoch mean is not exact"


@pytest.mark.slow
@ONE_RUN
def test_syncbn_running_stats_are_union_statistics(tmp_path: Path) -> None:
    out = script("syncbn.py", "--max-steps", "3", cwd=tmp_path)
    stats = per_rank(r"rank (\d) (\w+) running_mean (\[[^\]]*\]) max error vs union statistics " + NUM, out)
    for layer, mean, error in stats.values():
        assert "SyncBatchNorm" in layer and float(error) < 1e-4, stats
    assert stats[0][1] == stats[1][1]
    assert "running statistics identical across 2 ranks: True" in out


@pytest.mark.slow
@ONE_RUN
def test_fsdp2_validation_equals_one_process_under_model_parallel_sync(tmp_path: Path) -> None:
    for strategy in ("model_parallel_sync", "model_parallel"):
        out = script("fsdp2.py", "--strategy", strategy, "--max-epochs", "1", cwd=tmp_path)
        m = re.search(rf"{strategy}: val_mse {NUM} over 1001 samples, one process {NUM}, root seed (\w+)", out)
        assert m, out
        logged, one = float(m.group(1)), float(m.group(2))
        if strategy == "model_parallel_sync":
            assert logged == pytest.approx(one, rel=1e-5) and m.group(3) == "7"
        else:  # Lightning's padded sampler: one sample counted twice
            assert logged != pytest.approx(one, rel=1e-6) and m.group(3) == "None"


@pytest.mark.slow
@ONE_RUN
def test_local_sgd_ranks_identical_after_each_average(tmp_path: Path) -> None:
    out = torchrun("local_sgd.py", "--max-steps", "5", "--k", "2", "--seed", "3", cwd=tmp_path)
    averages: dict[int, dict[int, tuple[float, str]]] = {}
    for m in re.finditer(rf"rank (\d) step (\d+) drift before average {NUM} digest after {HEX}", out):
        averages.setdefault(int(m.group(2)), {})[int(m.group(1))] = (float(m.group(3)), m.group(4))
    assert sorted(averages) == [2, 4, 5], out  # every k steps, and once more at the end
    for step, ranks in averages.items():
        assert sorted(ranks) == [0, 1]
        assert ranks[0][1] == ranks[1][1], f"step {step}: weights differ after averaging"
        assert ranks[0][0] > 0, f"step {step}: the replicas never drifted, so nothing was shown"
    assert "all 2 ranks hold identical weights: True" in out


@pytest.mark.slow
@ONE_RUN
def test_seeds_equal_where_needed_different_where_needed(tmp_path: Path) -> None:
    out = script("seeds.py", "--epochs", "2", cwd=tmp_path)
    seeds = per_rank(r"rank (\d) root seed (\d+)", out)
    assert seeds[0] == seeds[1] == ("100",), "rank 1 (seeded 101) should follow rank 0's seed"
    inits = per_rank(r"rank (\d) init digest " + HEX, out)
    assert inits[0] == inits[1]
    masks = per_rank(r"rank (\d) first dropout mask " + HEX, out)
    assert masks[0] != masks[1], "ranks drew identical dropout masks"
    seen = {r: ast.literal_eval(v[0]) for r, v in per_rank(r"rank (\d) seen (\[[^\]]*\])", out).items()}
    for epoch in range(2):
        shard0, shard1 = (seen[r][epoch * 8:(epoch + 1) * 8] for r in (0, 1))
        assert sorted(shard0 + shard1) == list(range(16)), f"epoch {epoch}: shards overlap or miss samples"
    for verdict in ("root seed agreed", "model init equal", "shards disjoint and complete every epoch",
                    "dropout masks differ"):
        assert f"{verdict}: True" in out


@pytest.mark.slow
@ONE_RUN
def test_distributed_sampler_shards_and_set_epoch(tmp_path: Path) -> None:
    out = torchrun("distributed_sampler.py", "--size", "12", "--epochs", "3", cwd=tmp_path)
    orders: dict[tuple[bool, int, int], list[int]] = {}
    for m in re.finditer(r"rank (\d) set_epoch (True|False) epoch (\d) indices (\[[^\]]*\])", out):
        orders[(m.group(2) == "True", int(m.group(3)), int(m.group(1)))] = ast.literal_eval(m.group(4))
    assert len(orders) == 2 * 3 * 2, out
    for set_epoch in (True, False):
        for epoch in range(3):
            both = orders[(set_epoch, epoch, 0)] + orders[(set_epoch, epoch, 1)]
            assert sorted(both) == list(range(12)), f"set_epoch={set_epoch} epoch {epoch}: not disjoint and complete"
        for rank in (0, 1):
            distinct = {tuple(orders[(set_epoch, e, rank)]) for e in range(3)}
            assert len(distinct) == (3 if set_epoch else 1), f"set_epoch={set_epoch} rank {rank}: {distinct}"
    assert "shuffle=True beside a sampler: ValueError: sampler option is mutually exclusive with shuffle" in out
    assert "size 13 on 2 ranks: rank 0 gets 7 indices, 1 of them repeats" in out


@pytest.mark.slow
@pytest.mark.timeout(2 * (TIMEOUT + 30) + 60)  # two launches
def test_init_process_group_env_and_file_rendezvous(tmp_path: Path) -> None:
    for init, out in (("env", torchrun("init_process_group.py", cwd=tmp_path)),
                      ("file", script("init_process_group.py", "--spawn", "2", cwd=tmp_path))):
        reports = per_rank(rf"rank (\d)/2 backend (gloo|nccl) init {init}:// all_reduce sum {NUM} expected {NUM}", out)
        assert all(r == ("gloo", "3.0", "3.0") for r in reports.values()), reports
        per_rank(r"rank (\d) clean teardown", out)


@pytest.mark.slow
def test_predict_to_parquet_index_once_in_order(tmp_path: Path) -> None:
    out = script("predict_to_parquet.py", "--size", "101", "--batch-size", "8", "--out", str(tmp_path / "p.parquet"),
                 cwd=tmp_path)
    seen = per_rank(r"rank (\d) sees (\d+) rows written, per rank (\{[^}]*\})", out)
    assert seen[0] == seen[1], "the ranks hold different manifests"
    rows, counts = seen[0][0], ast.literal_eval(seen[0][1])
    assert rows == "101" and sum(counts.values()) == 101 and all(c > 0 for c in counts.values()), seen
    assert "columns ['index', 'probs', 'pred', 'label']; index == range(N): True" in out, out
    found = re.search(r"max \|probs - single-process probs\| " + NUM, out)
    assert found and float(found.group(1)) < 1e-6, out
    assert (tmp_path / "p.manifest.json").is_file() and not (tmp_path / "p.parts").exists()


@pytest.mark.slow
@ONE_RUN
def test_uneven_streams_train_every_sample_where_ddp_hangs(tmp_path: Path) -> None:
    out = script("uneven_streams.py", "--show-mistake", "--hang-timeout", "25", cwd=tmp_path)
    runs = per_rank(r"rank (\d) trained (\d+) real batches and (\d+) stand-in steps; samples (\d+) of 1001; "
                    rf"weights {HEX}", out)
    assert runs[0][:3] == ("19", "0", "1001") and runs[1][:3] == ("13", "6", "1001"), runs
    assert runs[0][3] == runs[1][3], "the replicas differ"
    assert "ddp hung: rank 0 waits in DDP's gradient all-reduce" in out, out


@pytest.mark.slow
@pytest.mark.timeout(2 * TIMEOUT + 90)
def test_world_size_invariance_one_two_three_ranks_and_the_summed_loss(tmp_path: Path) -> None:
    out = script("world_size_invariance.py", "--show-mistake", "--max-steps", "12", cwd=tmp_path)
    for n in (2, 3):  # every quantity within float rounding of the one-process run
        found = re.search(rf"{n} ranks vs 1: loss {NUM}, grad_norm {NUM}, weights {NUM}, metrics {NUM}", out)
        assert found and all(float(g) < 1e-5 for g in found.groups()), out
    assert "world-size invariance: OK (1 rank vs 2 ranks vs 3 ranks" in out, out
    assert "world-size invariance: FAILED (1 rank vs 2 ranks)" in out and "the loss is summed over the batch" in out
    found = re.search(rf"the global batch's loss is {NUM} on 1 rank, {NUM} on 2 ranks", out)
    assert found and float(found.group(1)) == pytest.approx(2 * float(found.group(2)), rel=1e-4), out


@pytest.mark.slow
@ONE_RUN
@pytest.mark.parametrize("nproc, fsdp", [(1, []), (2, []), (2, ["--fsdp"])])
def test_fault_tolerant_ddp_a_killed_group_recovers_and_both_end_equal(tmp_path: Path, nproc: int,
                                                                       fsdp: list[str]) -> None:
    out = run([sys.executable, "-m", "lightning_sync.ft.launch", "--replicas", "2", "--min-replicas", "2",
               "--nproc-per-replica", str(nproc), "--", sys.executable, str(RECIPES / "fault_tolerant_ddp.py"),
               "--kill-at", "8", "--max-steps", "20", *fsdp], tmp_path)
    lines = {int(m.group(1)): m for m in re.finditer(
        r"replica group (\d) \(life (\d)\): step (\d+), weights checksum (\S+), committed (\d+), run again (\d+), "
        r"missing shards (\d+), recovered (\d+)", out)}
    assert sorted(lines) == [0, 1], out
    survivor, restarted = lines[0], lines[1]
    assert survivor.group(2, 3, 5, 6, 7, 8) == ("0", "20", "20", "1", "0", "0"), out
    assert restarted.group(2, 3, 5, 7, 8) == ("1", "20", "12", "0", "1"), out
    assert survivor.group(4) == restarted.group(4), out  # the same weights


def header_commands() -> list[str]:
    """Every launch command in the recipes' docstrings, exactly as written (comments dropped)."""
    commands = []
    for recipe in sorted(RECIPES.glob("*.py")):
        doc = ast.get_docstring(ast.parse(recipe.read_text())) or ""
        commands += [line.split("#")[0].strip() for line in doc.splitlines() if re.match(r"\s*(python|torchrun) ", line)]
    return commands


#: Header commands that a test above runs with the same launcher and flags (smaller sizes aside);
#: the header test runs the others as written.
COVERED = {
    "python recipes/ddp_basics.py", "python recipes/loss_averaging.py", "python recipes/exact_validation.py",
    "python recipes/syncbn.py", "python recipes/seeds.py", "python recipes/broadcast_decision.py --show-mistake",
    "torchrun --standalone --nproc_per_node=2 recipes/local_sgd.py",
    "torchrun --standalone --nproc_per_node=2 recipes/distributed_sampler.py",
    "torchrun --standalone --nproc_per_node=2 recipes/init_process_group.py",
    "python recipes/init_process_group.py --spawn 2",
    "python recipes/uneven_streams.py", "python recipes/uneven_streams.py --show-mistake",
    "python recipes/world_size_invariance.py", "python recipes/world_size_invariance.py --show-mistake",
}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_header_commands_run_as_written(tmp_path: Path) -> None:
    """What a new user does after `bash scripts/train.sh` and `source .venv/bin/activate`: paste each
    recipe's header command in a clone. GPU commands need GPUs and are left out here, and so are the
    ones a test above already runs (COVERED). Nothing may be written outside outputs/ (git-ignored)."""
    every = [c for c in header_commands() if "--accelerator gpu" not in c]
    assert COVERED <= set(every), f"COVERED names commands no header has: {COVERED - set(every)}"
    commands = [c for c in every if c not in COVERED]
    assert len(commands) >= 6, commands
    clone = tmp_path / "clone"
    shutil.copytree(RECIPES, clone / "recipes", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env |= {"OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"}
    failures: list[str] = []
    pending, running = list(commands), []
    while pending or running:
        while pending and len(running) < 2:  # two at a time: each is mostly start-up
            command = pending.pop(0)
            running.append((command, subprocess.Popen(["timeout", "-k", "5", str(TIMEOUT), "bash", "-c", command],
                                                      cwd=clone, env=env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True)))
        command, proc = running.pop(0)
        out, _ = proc.communicate(timeout=TIMEOUT + 30)
        if proc.returncode != 0:
            failures.append(f"$ {command}\nexit {proc.returncode}\n{out[-3000:]}")
        elif "different initial" in out:
            failures.append(f"$ {command}\nwarned about initial parameters DDP overwrites anyway:\n{out[-3000:]}")
    assert not failures, "\n\n".join(failures)
    written = sorted(str(p.relative_to(clone)) for p in clone.iterdir() if p.name not in ("recipes", "outputs"))
    assert not written, f"recipes wrote outside outputs/: {written}"
    assert (clone / "outputs" / "recipes" / "broadcast_decision" / "best.ckpt").is_file()


# ------------------------------------------------------------------ launch recipes (two-node test cluster)


@pytest.mark.cluster
@pytest.mark.slow
def test_recipes_open_with_their_commands() -> None:
    for recipe in sorted(RECIPES.glob("launch_*")):
        head = recipe.read_text().splitlines()[:12]
        assert any(f"recipes/{recipe.name}" in line for line in head), f"{recipe.name}: no launch command up top"
        assert "set -euo pipefail" in recipe.read_text()


@pytest.mark.cluster
@pytest.mark.slow
def test_torchrun_single_node(cluster: Cluster) -> None:
    out = cluster.run("n0", "bash", str(RECIPES / "launch_torchrun_single_node.sh"), "--timeout", "30",
                      env={**DOCTOR, "NPROC": "2"}, timeout=120)
    assert out.returncode == 0, out.stdout
    assert "launcher torchrun, 2 rank(s) on 1 node(s)" in out.stdout and "OK: 2 rank(s)" in out.stdout


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_torchrun_multinode(cluster: Cluster, rdzv: str) -> None:
    port = "29560" if rdzv == "static" else "29570"
    procs = [cluster.start(node, "bash", str(RECIPES / "launch_torchrun_multinode.sh"), "--timeout", "30",
                           env={**DOCTOR, "NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": "10.200.0.1",
                                "MASTER_PORT": port, "RDZV": rdzv, "RDZV_ID": f"recipe-{rdzv}"}, timeout=120)
             for rank, node in enumerate(("n0", "n1"))]
    results = cluster.wait(procs, timeout=135)
    assert all(r.returncode == 0 for r in results), results[0].stdout + results[1].stdout
    [head] = [r.stdout for r in results if "launcher torchrun, 4 rank(s) on 2 node(s)" in r.stdout]  # rank 0's node
    assert "OK: 4 rank(s) joined a gloo group" in head
    assert "veth-ls0 10.200.0.1" in head and "veth-ls1 10.200.0.2" in head  # each node's own interface


@pytest.mark.cluster
@pytest.mark.slow
def test_slurm_sbatch(cluster: Cluster) -> None:
    job = cluster.sbatch(RECIPES / "launch_slurm.sbatch", "--timeout", "30", env=DOCTOR, timeout=150)
    assert job.exit_code == 0, job.output
    assert "2 node(s) x 2 task(s), MASTER_ADDR=n0" in job.output
    assert "launcher slurm, 4 rank(s) on 2 node(s)" in job.output and "OK: 4 rank(s)" in job.output
