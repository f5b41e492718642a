#!/usr/bin/env bash
# The project's test command: set-up (once) + the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV=${LSYNC_VENV:-.venv}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
set +e
"$VENV/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "test.sh: pytest collected no tests - treating as failure" >&2
  exit 1
fi
exit "$rc"
