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
if [ "$mode" = folders ] || [ "$mode" = folders_sync ]; then
  # Four whole folders, with every DDP registry name and the DDPStrategy class served by SyncDDPStrategy
  # (LSYNC_AS_DDP=all); "folders" runs Lightning's own DDP over them first, for the counts to compare.
  FOLDERS=(trainer/logging_ loops callbacks checkpointing)
  # not collectable here: the `flaky` marker needs pytest-rerunfailures, the legacy checkpoints a download
  common+=(--ignore=callbacks/test_spike.py --ignore=callbacks/test_stochastic_weight_avg.py
           --ignore=checkpointing/test_legacy_checkpoints.py)
  if [ "$mode" = folders ]; then
    echo "== Lightning $TAG, ${FOLDERS[*]}, Lightning's DDPStrategy"
    "$PY" -m pytest "${FOLDERS[@]}" "${common[@]}" -rfE >"$WORK/folders_ddp.log" 2>&1 || true
    tail -n 3 "$WORK/folders_ddp.log"
  fi
  echo "== Lightning $TAG, ${FOLDERS[*]}, every DDP name and DDPStrategy = lightning_sync.SyncDDPStrategy"
  LSYNC_AS_DDP=all "$PY" -m pytest "${FOLDERS[@]}" "${common[@]}" -rfE -p lsync_as_ddp >"$WORK/folders_sync.log" 2>&1 || true
  tail -n 3 "$WORK/folders_sync.log"
fi
if [ "$mode" = model_parallel ]; then
  # Lightning's ModelParallelStrategy tests (those that run on CPU), then with the class served by
  # SyncModelParallelStrategy
  MP=(strategies/test_model_parallel.py strategies/test_model_parallel_integration.py)
  echo "== Lightning $TAG, ${MP[*]}, Lightning's ModelParallelStrategy"
  "$PY" -m pytest "${common[@]}" "${MP[@]}" || true
  echo "== Lightning $TAG, ${MP[*]}, ModelParallelStrategy = lightning_sync.SyncModelParallelStrategy"
  LSYNC_AS_MODEL_PARALLEL=1 "$PY" -m pytest "${common[@]}" -p lsync_as_ddp "${MP[@]}" || true
fi
if [ "$mode" = all ] || [ "$mode" = standalone ]; then
  # Each standalone test in its own pytest process (Lightning's launcher re-runs the command line
  # for rank 1), as Lightning's CI runs them.
  # The CPU ones among them (the others need GPUs).
  ids=(strategies/test_ddp_integration.py::test_find_unused_parameters_ddp_spawn_raises
       strategies/test_ddp_integration.py::test_find_unused_parameters_ddp_exception
       "strategies/test_ddp_integration.py::test_ddp_strategy_checkpoint_zero_redundancy_optimizer[ddp]"
       trainer/connectors/test_accelerator_connector.py::test_strategy_choice_ddp_on_cpu
       tuner/test_lr_finder.py::test_lr_finder_with_ddp
       overrides/test_distributed.py::test_params_synced_during_nonfit)
  for plugin in "" lsync_as_ddp; do
    log="$WORK/standalone${plugin:+_$plugin}.log"; : >"$log"
    passed=0; failed=0
    for id in "${ids[@]}"; do
      if PL_RUN_STANDALONE_TESTS=1 timeout -k 5 600 "$PY" -m pytest "$id" "${common[@]}" -rfE ${plugin:+-p $plugin} \
           >>"$log" 2>&1; then passed=$((passed + 1)); echo "PASSED $id" >>"$log"
      else failed=$((failed + 1)); echo "FAILED $id" >>"$log"; fi
    done
    echo "== Lightning $TAG standalone 2-process tests, plugin '${plugin:-none}': $passed passed, $failed failed"
  done
fi
