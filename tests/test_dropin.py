"""``ddp_sync`` is a drop-in for ``ddp``: the same Lightning features give the same outcome.

Lightning's own DDP tests with ``"ddp"`` served by ``SyncDDPStrategy`` are run by
``tests/lightning_suite/run.sh`` (docs/compat.md); this is the project's own side-by-side check.
"""

from __future__ import annotations

import json
import subprocess
import sys
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
