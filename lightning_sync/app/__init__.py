"""The Hydra app: what ``lsync-train`` runs (``python -m lightning_sync.train``).

- :mod:`~lightning_sync.app.train`: the main job (compose the config, check it, fit, validate, one JSON line);
- :mod:`~lightning_sync.app.config`: the config check before any run directory exists (``CheckConfig``, a Hydra
  callback), and :mod:`~lightning_sync.app.schema`: the schema it checks against;
- :mod:`~lightning_sync.app.data` and :mod:`~lightning_sync.app.models`: the digits data module and CNN the
  shipped configs build.

The configs are ``lightning_sync/conf/`` (``conf/`` at the top of the repository). The library (every module
outside this package) imports nothing from here (``tests/test_layout.py`` checks the import graph); the old
module names (``lightning_sync.train``, ``.config``, ``.schema``, ``.data``, ``.models``) are these modules.
"""
