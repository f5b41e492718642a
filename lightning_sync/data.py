"""``lightning_sync.data`` is :mod:`lightning_sync.app.data` (the Hydra app's module, under its old name)."""

import sys

from lightning_sync.app import data as _app

sys.modules[__name__] = _app
