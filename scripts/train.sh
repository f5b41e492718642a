#!/usr/bin/env bash
# The main job: set-up (once) + lsync-train (2-process DDP on CPU by default). Extra arguments are
# Hydra overrides, e.g. `bash scripts/train.sh trainer.max_epochs=3 seed=7`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV=${LSYNC_VENV:-.venv}
exec "$VENV/bin/lsync-train" "$@"
