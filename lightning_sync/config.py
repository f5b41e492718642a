"""``lightning_sync.config`` is :mod:`lightning_sync.app.config` (the Hydra app's module, under its old name)."""

import sys

from lightning_sync.app import config as _app

sys.modules[__name__] = _app
