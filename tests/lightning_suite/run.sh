#!/usr/bin/env bash
# Lightning's own CPU DDP tests, run twice: with Lightning's "ddp", then with "ddp" served by
# SyncDDPStrategy (plugin lsync_as_ddp.py), plus the standalone 2-process tests. docs/compat.md
# records the command, the tag and the counts.
#
#   bash tests/lightning_suite/run.sh GIT_DIR TAG [WORKDIR]
#
# GIT_DIR: a clone (or bare mirror) of github.com/Lightning-AI/pytorch-lightning; TAG: the tag of the
# installed lightning (or the nearest one it has). Lightning's files are extracted to WORKDIR
# (default /tmp/lsync-lightning-TAG), outside this repository.
set -euo pipefail
GIT_DIR=$1; TAG=$2
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$HERE/../.." && pwd)
WORK=${3:-/tmp/lsync-lightning-$TAG}
PY=${PYTHON:-$REPO/.venv/bin/python}
if [ ! -d "$WORK/tests/tests_pytorch" ]; then
  mkdir -p "$WORK"
  git --git-dir="$GIT_DIR" archive --format=tar "$TAG" tests/tests_pytorch pyproject.toml | tar -x -C "$WORK"
fi
FILES=(strategies/test_ddp.py strategies/test_ddp_integration.py strategies/test_ddp_integration_comm_hook.py
       trainer/connectors/test_accelerator_connector.py trainer/connectors/test_signal_connector.py
       utilities/test_combined_loader.py tuner/test_lr_finder.py tuner/test_scale_batch_size.py
       tuner/test_tuning.py overrides/test_distributed.py)
export PYTHONPATH=$REPO:$HERE${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1
cd "$WORK/tests/tests_pytorch"
common=(-q -p no:cacheprovider -p no:randomly --timeout 300 -W "ignore:torch.distributed.nn.functional.all_gather is deprecated:FutureWarning")
mode=${LSYNC_SUITE_MODE:-all}
if [ "$mode" = all ] || [ "$mode" = ddp ]; then
  echo "== Lightning $TAG, strategy 'ddp' = Lightning's DDPStrategy"
  "$PY" -m pytest "${FILES[@]}" "${common[@]}" -rfE >"$WORK/ddp.log" 2>&1 || true
  tail -n 3 "$WORK/ddp.log"
fi
if [ "$mode" = all ] || [ "$mode" = sync ]; then
  echo "== Lightning $TAG, strategy 'ddp' = lightning_sync.SyncDDPStrategy"
  "$PY" -m pytest "${FILES[@]}" "${common[@]}" -rfE -p lsync_as_ddp >"$WORK/ddp_sync.log" 2>&1 || true
  tail -n 3 "$WORK/ddp_sync.log"
fi
if [ "$mode" = all ] || [ "$mode" = standalone ]; then
  for plugin in "" lsync_as_ddp; do
    echo "== Lightning $TAG standalone 2-process tests, plugin '${plugin:-none}'"
    PL_RUN_STANDALONE_TESTS=1 "$PY" -m pytest "${FILES[@]}" "${common[@]}" -rfE ${plugin:+-p $plugin} \
      >"$WORK/standalone${plugin:+_$plugin}.log" 2>&1 || true
    tail -n 3 "$WORK/standalone${plugin:+_$plugin}.log"
  done
fi
