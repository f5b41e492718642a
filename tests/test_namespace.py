"""``lightning_sync.pl``: the same API for the ``pytorch_lightning`` package, built from the same files."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

pytorch_lightning = pytest.importorskip("pytorch_lightning")

import lightning_sync  # noqa: E402
from lightning_sync import _namespace  # noqa: E402


def test_every_lightning_dependent_module_has_a_pytorch_lightning_build() -> None:
    import lightning_sync.pl as lpl

    for name in sorted(_namespace.lightning_dependent()):
        module = importlib.import_module(_namespace.PL_PACKAGE + name.removeprefix("lightning_sync"))
        assert module.__file__ == importlib.import_module(name).__file__  # the same source file
    assert issubclass(lpl.SyncDDPStrategy, pytorch_lightning.strategies.DDPStrategy)
    assert not issubclass(lpl.SyncDDPStrategy, lightning_sync.SyncDDPStrategy)
    for name in ("ValidationGather", "PredictionWriter", "SeedBroadcast", "SyncBatchNormConversion",
                 "ParameterConsistencyCheck"):
        assert issubclass(getattr(lpl, name), pytorch_lightning.Callback), name
    # what imports no Lightning is shared: one guard, one set of collectives, one error hierarchy
    assert lpl.collectives is lightning_sync.collectives and lpl.CollectiveGuard is lightning_sync.CollectiveGuard
    assert lpl.RankMismatchError is lightning_sync.RankMismatchError
    assert "lightning_sync.collectives" not in _namespace.lightning_dependent()


def test_pytorch_lightning_trainer_accepts_the_names_and_the_class() -> None:
    code = ("import pytorch_lightning as pl, lightning_sync, lightning_sync.pl as lpl\n"
            "for name in ('ddp_sync', 'ddp_sync_spawn', 'ddp_sync_notebook'):\n"
            "    t = pl.Trainer(accelerator='cpu', devices=2, strategy=name, logger=False)\n"
            "    assert type(t.strategy) is lpl.SyncDDPStrategy, type(t.strategy)\n"
            "t = pl.Trainer(accelerator='cpu', devices=2, strategy=lpl.SyncDDPStrategy(seed=3), logger=False)\n"
            "import lightning as L\n"
            "t = L.Trainer(accelerator='cpu', devices=2, strategy='ddp_sync', logger=False)\n"
            "assert type(t.strategy) is lightning_sync.SyncDDPStrategy\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.parametrize("first", ["pytorch_lightning", "lightning_sync"])
def test_the_names_reach_pytorch_lightning_in_either_import_order_and_the_build_waits(first: str) -> None:
    """Issue 45, point 4: `import lightning_sync` then `import pytorch_lightning` gave Lightning's generic
    invalid-strategy error; and the pytorch_lightning build (~0.4 s) was made at import, wanted or not."""
    other = "lightning_sync" if first == "pytorch_lightning" else "pytorch_lightning"
    code = (f"import sys, {first}, {other}\n"
            "import pytorch_lightning as pl\n"
            "built_at_import = 'lightning_sync.pl' in sys.modules\n"
            "t = pl.Trainer(accelerator='cpu', devices=2, strategy='ddp_sync', logger=False)\n"
            "import lightning_sync.pl as lpl\n"
            "assert type(t.strategy) is lpl.SyncDDPStrategy and t.strategy._start_method == 'popen', t.strategy\n"
            "t = pl.Trainer(accelerator='cpu', devices=2, strategy='model_parallel_sync', logger=False)\n"
            "assert type(t.strategy) is lpl.SyncModelParallelStrategy, type(t.strategy)\n"
            "print('built at import:', built_at_import)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("built at import: False"), proc.stderr[-3000:]


def test_lightning_users_do_not_import_pytorch_lightning() -> None:
    proc = subprocess.run([sys.executable, "-c", "import sys, lightning_sync; print('pytorch_lightning' in sys.modules)"],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr[-2000:]
