"""``lightning_sync.schema`` is :mod:`lightning_sync.app.schema` (the Hydra app's module, under its old name)."""

import sys

from lightning_sync.app import schema as _app

sys.modules[__name__] = _app
