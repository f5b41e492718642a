#!/usr/bin/env bash
# torchmetrics' Lightning integration tests on 2 CPU ranks, once with Lightning's "ddp" and once with
# "ddp_sync" (plugin two_ranks.py), each test in its own pytest process (Lightning's launcher re-runs
# the command for rank 1). docs/compat.md records the command, the tag and the counts.
#
#   bash tests/lightning_suite/torchmetrics.sh GIT_DIR TAG [WORKDIR]
set -euo pipefail
GIT_DIR=$1; TAG=$2
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$HERE/../.." && pwd)
WORK=${3:-/tmp/lsync-torchmetrics-$TAG}
PY=${PYTHON:-$REPO/.venv/bin/python}
if [ ! -d "$WORK/tests/integrations" ]; then
  mkdir -p "$WORK"
  git --git-dir="$GIT_DIR" archive --format=tar "$TAG" tests/integrations | tar -x -C "$WORK"
fi
cd "$WORK/tests"
export PYTHONPATH=$REPO:$HERE:$WORK/tests${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1
mapfile -t ids < <("$PY" -m pytest integrations/test_lightning.py --collect-only -q -p no:cacheprovider 2>/dev/null \
                    | grep '::')
for strategy in ddp ddp_sync; do
  log="$WORK/$strategy.log"; : >"$log"; passed=0; failed=0
  for id in "${ids[@]}"; do
    if LSYNC_TWO_RANKS_STRATEGY=$strategy timeout -k 5 300 "$PY" -m pytest "$id" -q -p no:cacheprovider \
         -p two_ranks -W "ignore::DeprecationWarning" >>"$log" 2>&1; then
      passed=$((passed + 1)); echo "PASSED $id" >>"$log"
    else failed=$((failed + 1)); echo "FAILED $id" >>"$log"; fi
  done
  echo "== torchmetrics $TAG integrations on 2 ranks, strategy '$strategy': $passed passed, $failed failed"
  grep "^FAILED" "$log" || true
done
