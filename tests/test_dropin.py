"""``ddp_sync`` is a drop-in for ``ddp``: the same Lightning features give the same outcome.

Lightning's own DDP tests with ``"ddp"`` served by ``SyncDDPStrategy`` are run by
``tests/lightning_suite/run.sh`` (docs/compat.md); this is the project's own side-by-side check.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "side_by_side.py"


def run(out: Path, strategy: str, timeout: int = 420) -> list[dict]:
    out.mkdir(parents=True)
    proc = subprocess.run(["timeout", "-k", "5", str(timeout), sys.executable, str(SCRIPT), "--out", str(out),
                           "--strategy", strategy], capture_output=True, text=True, timeout=timeout + 20)
    assert proc.returncode == 0, f"{strategy}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def flat(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}{key}.").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in flat(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}


@pytest.mark.slow
@pytest.mark.timeout(2 * (420 + 20) + 60)  # two launches under their own limits
def test_ddp_sync_matches_ddp_feature_by_feature(tmp_path: Path) -> None:
    ddp = run(tmp_path / "ddp", "ddp")
    sync = run(tmp_path / "ddp_sync", "ddp_sync")
    for rank in range(2):
        a, b = ddp[rank], sync[rank]
        for step in a:
            assert "error" not in a[step] or step == "batch_size_finder", f"ddp rank {rank} {step}: {a[step]}"
            if "error" in a[step]:  # Lightning refuses it the same way for both
                assert (a[step]["error"], a[step]["message"]) == (b[step].get("error"), b[step].get("message")), \
                    f"rank {rank} {step}: ddp {a[step]} vs ddp_sync {b[step]}"
                continue
            assert "error" not in b[step], f"ddp_sync rank {rank} {step}: {b[step]}"
        assert (a["cli_fit"]["ok"]["strategy"], b["cli_fit"]["ok"]["strategy"]) == ("DDPStrategy", "SyncDDPStrategy")
        # Same seed, same sampler order, no dropout: the very same training, number for number.
        for step in ("cli_fit", "resume", "find_unused_parameters", "static_graph"):
            want, got = flat(a[step]["ok"]), flat(b[step]["ok"])
            want.pop("strategy", None), got.pop("strategy", None)
            assert want == pytest.approx(got, rel=1e-5), f"rank {rank} {step}: ddp {want} vs ddp_sync {got}"
        for step in ("validate", "test", "predict"):
            assert flat(a[step]["ok"]) == pytest.approx(flat(b[step]["ok"]), rel=1e-5), f"rank {rank} {step}"
    assert ddp[0]["resume"]["ok"]["epoch"] == 3


USER_PROJECT = Path(__file__).parent / "scripts" / "user_project.py"


def run_user_project(out: Path, strategy: str, *extra: str, timeout: int = 300) -> list[dict]:
    out.mkdir(parents=True)
    proc = subprocess.run(["timeout", "-k", "5", str(timeout), sys.executable, str(USER_PROJECT), "--out", str(out),
                           "--strategy", strategy, *extra], capture_output=True, text=True, timeout=timeout + 20)
    assert proc.returncode == 0, f"{strategy}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(3 * (300 + 20) + 60)
def test_a_users_project_with_lightnings_defaults_behaves_as_under_ddp_and_counts_exactly(tmp_path: Path) -> None:
    """Tutorial-style code (progress bar, model summary, CSV logger, torchmetrics, checkpoints, early
    stopping, LR monitor, accumulation, clipping), 101 validation and 77 test samples on 2 ranks."""
    ddp = run_user_project(tmp_path / "ddp", "ddp")
    sync = run_user_project(tmp_path / "ddp_sync", "ddp_sync")
    for d, s in zip(ddp, sync):
        assert d["error"] is None and s["error"] is None, (d, s)
        # what ddp_sync promises not to change
        for key in ("best", "global_step", "lr_logged", "gathered_shapes"):
            assert s[key] == d[key], key
        assert s["fit"].keys() == d["fit"].keys() and s["test"].keys() == d["test"].keys()
        # what it changes: every sample once (Lightning's padded sampler repeats one in each)
        assert d["fit"]["val_count"] == d["validate"]["val_count"] == 102 and d["test"]["test_count"] == 78
        assert s["fit"]["val_count"] == s["validate"]["val_count"] == 101 and s["test"]["test_count"] == 77
    # Lightning's "use devices=1 to evaluate each sample exactly once" is untrue under ddp_sync, and only it goes
    padded = [w for w in ddp[0]["eval_warnings"] if "exactly once" in w or "Using `DistributedSampler`" in w]
    assert len(padded) == 2, ddp[0]["eval_warnings"]  # validate and test
    # every other warning as often as under ddp (issue 40, point 5): counted, not only the same set
    expected = Counter(ddp[0]["eval_warnings"]) - Counter(padded)
    assert Counter(sync[0]["eval_warnings"]) == expected, (sync[0]["eval_warnings"], ddp[0]["eval_warnings"])
    # predict: Lightning's own sampler does not pad there; both give every sample once
    assert sync[0]["predicted"] + sync[1]["predicted"] == 77 == ddp[0]["predicted"] + ddp[1]["predicted"]
    assert sync[0]["fit"] == sync[1]["fit"] and sync[0]["test"] == sync[1]["test"]

    # self.all_gather of per-sample rows: under ddp_sync the last batches differ (51 and 50 samples), and
    # every rank gets the same named error with the fix instead of gloo's abort and garbage
    rows = run_user_project(tmp_path / "rows", "ddp_sync", "--gather-rows")
    for report in rows:
        assert report["error"]["type"] == "RankMismatchError", report
        assert "self.all_gather: the tensor differs across ranks: rank 0 (3, 3) float32 on cpu, rank 1 (2, 3)" \
               in report["error"]["message"]
        assert "all_gather_uneven" in report["error"]["message"]


@pytest.mark.slow
@pytest.mark.timeout(300 + 60)
def test_the_same_project_under_pytorch_lightning_gives_the_same_numbers(tmp_path: Path) -> None:
    """``import pytorch_lightning as pl`` projects: strategy="ddp_sync" resolves to lightning_sync.pl's class."""
    ref = run_user_project(tmp_path / "lightning", "ddp_sync")
    pl = run_user_project(tmp_path / "pl", "ddp_sync", "--namespace=pytorch_lightning")
    for a, b in zip(ref, pl):
        assert a["error"] is None and b["error"] is None, (a, b)
        for key in ("fit", "validate", "test", "predicted", "best", "global_step", "gathered_shapes"):
            assert a[key] == b[key], key
    assert pl[0]["validate"]["val_count"] == 101 and pl[0]["test"]["test_count"] == 77
