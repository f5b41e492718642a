#!/usr/bin/env bash
# NNODES nodes x NPROC processes, started by one torchrun per node. Run the same line on every node:
#
#   # static rendezvous: node 0 hosts it, every node knows its NODE_RANK
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.200.0.1 bash recipes/launch_torchrun_multinode.sh   # on node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.200.0.1 bash recipes/launch_torchrun_multinode.sh   # on node 1
#   # c10d rendezvous: identical command on every node, ranks assigned on arrival
#   RDZV=c10d NNODES=2 MASTER_ADDR=10.200.0.1 bash recipes/launch_torchrun_multinode.sh     # on each node
#   # preflight first: same commands with SCRIPT="python -m lightning_sync.doctor"
#
# SOCKET_IFNAME=eth0 pins gloo and NCCL to the interface that reaches MASTER_ADDR; needed when a node's
# hostname resolves to 127.0.0.1 (lsync-doctor tells you). The name may differ per node. DEBUG=1 logs.
# Lines that differ from launch_torchrun_single_node.sh are marked "multi-node".
set -euo pipefail

SCRIPT=${SCRIPT:-lsync-train}   # any command: lsync-train, "python train.py", "python -m lightning_sync.doctor"
NPROC=${NPROC:-2}               # processes per node = Trainer(devices=...)
NNODES=${NNODES:-2}                                  # multi-node: = Trainer(num_nodes=...)
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to node 0 address, reachable from every node}  # multi-node
MASTER_PORT=${MASTER_PORT:-29500}                    # multi-node: same free port on every node
RDZV=${RDZV:-static}                                 # multi-node: static (needs NODE_RANK) or c10d

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a failed NCCL op aborts, not hangs
if [ -n "${SOCKET_IFNAME:-}" ]; then                 # multi-node: the interface between the nodes
  export GLOO_SOCKET_IFNAME=$SOCKET_IFNAME NCCL_SOCKET_IFNAME=$SOCKET_IFNAME
fi
if [ "${DEBUG:-0}" = 1 ]; then
  export TORCH_DISTRIBUTED_DEBUG=DETAIL TORCH_CPP_LOG_LEVEL=INFO NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET
fi

case "$SCRIPT" in  # how SCRIPT is told the layout: flags for the doctor, Hydra overrides for training
  *doctor*) LAYOUT=(--devices "$NPROC" --num-nodes "$NNODES") ;;
  *) LAYOUT=("trainer.devices=$NPROC" "trainer.num_nodes=$NNODES") ;;
esac

if [ "$RDZV" = c10d ]; then                          # multi-node: rendezvous
  RDZV_ARGS=(--rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="${RDZV_ID:-lsync}")
else
  RDZV_ARGS=(--node_rank="${NODE_RANK:?set NODE_RANK (0..NNODES-1)}" --master_addr="$MASTER_ADDR" \
             --master_port="$MASTER_PORT")
fi

read -r -a CMD <<<"$SCRIPT"
exec torchrun --nnodes="$NNODES" --nproc_per_node="$NPROC" "${RDZV_ARGS[@]}" --no-python \
  "${CMD[@]}" "${LAYOUT[@]}" "$@"
