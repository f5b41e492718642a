#!/usr/bin/env bash
# The project's test command: set-up (once) + the whole suite. Extra arguments go to pytest.
#
#   bash scripts/test.sh [PYTEST ARGS]            # newest pins (constraints.txt), whole suite
#   bash scripts/test.sh --oldest [PYTEST ARGS]   # the oldest Lightning setup.cfg allows, in .venv-oldest,
#                                                 # fast tier (-m "not slow and not cluster") unless -m is given
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--oldest" ]; then
  shift
  # The floor is written once, in setup.cfg's install_requires ("lightning>=X,<Y").
  LSYNC_LIGHTNING=$(sed -nE 's/^ *lightning>=([0-9.]+).*/\1/p' setup.cfg | head -n 1)
  [ -n "$LSYNC_LIGHTNING" ] || { echo "test.sh: no 'lightning>=X' in setup.cfg" >&2; exit 1; }
  export LSYNC_LIGHTNING LSYNC_VENV=${LSYNC_VENV_OLDEST:-.venv-oldest}
  case " $* " in *" -m "*) ;; *) set -- -m "not slow and not cluster" "$@" ;; esac
  echo "test.sh: lightning $LSYNC_LIGHTNING (the oldest supported), in $LSYNC_VENV: pytest $*" >&2
fi
bash scripts/bootstrap.sh
VENV=${LSYNC_VENV:-.venv}
# Byte-compile the package and the test scripts once: where PYTHONDONTWRITEBYTECODE is set (these machines),
# every rank of every run would otherwise compile lightning_sync from source again (pip compiled the venv's own)
"$VENV/bin/python" -m compileall -q lightning_sync tests >/dev/null
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
set +e
# Two workers: a 2-rank Lightning run leaves a core idle while its ranks import one after the
# other. Tests marked alone run with nothing beside them, cluster/serial ones one at a time (tests/conftest.py).
# LSYNC_TEST_WORKERS=0 (or -n 0 among the arguments) runs everything in one process.
"$VENV/bin/python" -m pytest -n "${LSYNC_TEST_WORKERS:-2}" --dist loadgroup "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "test.sh: pytest collected no tests - treating as failure" >&2
  exit 1
fi
exit "$rc"
