"""``lightning_sync.models`` is :mod:`lightning_sync.app.models` (the Hydra app's module, under its old name)."""

import sys

from lightning_sync.app import models as _app

sys.modules[__name__] = _app
