"""``lightning_sync.train`` is :mod:`lightning_sync.app.train` (the Hydra app's main job, under its old name):
``python -m lightning_sync.train`` runs it, as ``lsync-train`` does."""

import sys

from lightning_sync.app import train as _app

if __name__ == "__main__":
    _app.main()
else:
    sys.modules[__name__] = _app
