#!/usr/bin/env bash
# One node, NPROC processes (one per GPU; on CPU, one per "device"), started by torchrun.
#
#   NPROC=2 bash recipes/launch_torchrun_single_node.sh                      # lsync-train, 2 processes
#   NPROC=2 bash recipes/launch_torchrun_single_node.sh trainer.max_epochs=3 # extra args go to SCRIPT
#   SCRIPT="python -m lightning_sync.doctor" NPROC=2 bash recipes/launch_torchrun_single_node.sh   # preflight
#
# The layout is passed to SCRIPT (Trainer(devices=NPROC, num_nodes=1)) so it always matches torchrun's.
# DEBUG=1 turns on torch.distributed / NCCL logging. The multi-node version is
# launch_torchrun_multinode.sh; it differs only in the lines marked "multi-node".
set -euo pipefail

SCRIPT=${SCRIPT:-lsync-train}   # any command: lsync-train, "python train.py", "python -m lightning_sync.doctor"
NPROC=${NPROC:-2}               # processes on this node = Trainer(devices=...)
NNODES=1

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}                       # torchrun's default; raise for CPU-heavy loaders
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a failed NCCL op aborts, not hangs
if [ "${DEBUG:-0}" = 1 ]; then
  export TORCH_DISTRIBUTED_DEBUG=DETAIL TORCH_CPP_LOG_LEVEL=INFO NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET
fi

case "$SCRIPT" in  # how SCRIPT is told the layout: flags for the doctor, Hydra overrides for training
  *doctor*) LAYOUT=(--devices "$NPROC" --num-nodes "$NNODES") ;;
  *) LAYOUT=("trainer.devices=$NPROC" "trainer.num_nodes=$NNODES") ;;
esac

read -r -a CMD <<<"$SCRIPT"
exec torchrun --standalone --nnodes=1 --nproc_per_node="$NPROC" --no-python \
  "${CMD[@]}" "${LAYOUT[@]}" "$@"
