#!/usr/bin/env bash
# A real two-node test cluster on one machine (root only): two network namespaces joined by a veth
# pair, each "node" with its own hostname and /etc/hosts, and a SLURM controller + two slurmd.
#
#   bash ci/cluster.sh install              # apt-get install slurm-wlm iproute2 util-linux (once)
#   bash ci/cluster.sh up                   # n0 = 10.200.0.1 (veth-ls0), n1 = 10.200.0.2 (veth-ls1)
#   bash ci/cluster.sh run n0 srun -N2 --ntasks-per-node=2 python -m lightning_sync.doctor --devices 2 --num-nodes 2
#   bash ci/cluster.sh run n1 hostname      # any command, inside node n1's namespaces
#   bash ci/cluster.sh run --net-only n1 CMD  # n1's network only: the machine's hostname and /etc/hosts
#                                           # (the classic misconfiguration: hostname -> 127.0.0.1)
#   bash ci/cluster.sh status
#   bash ci/cluster.sh down                 # always safe; also cleans up after a crashed run
#
# Environment:
#   LSYNC_CLUSTER      name; namespaces are ${LSYNC_CLUSTER}0 and ${LSYNC_CLUSTER}1 (default: lsn)
#   LSYNC_CLUSTER_DIR  state, config and logs (default: /tmp/lsync-cluster-$LSYNC_CLUSTER)
#   LSYNC_CLUSTER_CPUS CPUs per node announced to SLURM (default: 2)
# Only 10.200.0.0/24 inside our own namespaces and loopback are used, so two clusters with different
# names can run side by side. `run` exports SLURM_CONF so srun/sbatch/squeue find this cluster.
# Nodes are entered with nsenter (`ip netns exec` remounts /sys, which breaks slurmd).
set -euo pipefail

NAME=${LSYNC_CLUSTER:-lsn}
DIR=${LSYNC_CLUSTER_DIR:-/tmp/lsync-cluster-$NAME}
CPUS=${LSYNC_CLUSTER_CPUS:-2}
NS=("${NAME}0" "${NAME}1")
IFACE=(veth-ls0 veth-ls1)
ADDR=(10.200.0.1 10.200.0.2)
export SLURM_CONF=$DIR/slurm.conf

die() { echo "cluster.sh: $*" >&2; exit 1; }
need_root() { [ "$(id -u)" = 0 ] || die "needs root (network namespaces, mounts, slurm daemons); run it with sudo."; }

node_index() {  # n0|0 -> 0, n1|1 -> 1
  case "$1" in n0|0) echo 0 ;; n1|1) echo 1 ;; *) die "unknown node '$1': use n0 or n1." ;; esac
}

# Run "$@" on node $1 (0|1): its network namespace, hostname n$1 and private /etc/hosts.
on_node() {
  local r=$1; shift
  [ -e "/run/netns/${NS[$r]}" ] || die "node n$r is not up (no namespace ${NS[$r]}); run: bash ci/cluster.sh up"
  # shellcheck disable=SC2016  # expanded by the inner bash, from its arguments
  nsenter --net="/run/netns/${NS[$r]}" unshare -u -m --propagation private /bin/bash -c \
    'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"' on_node "n$r" "$DIR/hosts" "$@"
}

cmd_install() {
  need_root
  local tools=(slurmctld slurmd srun sbatch squeue sinfo scontrol ip nsenter unshare flock timeout)
  local missing=0 t
  for t in "${tools[@]}"; do command -v "$t" >/dev/null 2>&1 || missing=1; done
  [ "$missing" = 0 ] && return 0
  # Two test workers may install at once (each claims its own cluster): one installs, the other waits for it
  # here and finds the tools; apt-get itself waits up to 5 min for a dpkg lock held by any other apt process.
  exec 9>/tmp/lsync-cluster-install.lock
  flock 9
  missing=0
  for t in "${tools[@]}"; do command -v "$t" >/dev/null 2>&1 || missing=1; done
  if [ "$missing" = 0 ]; then exec 9>&-; return 0; fi
  local pkgs=(slurm-wlm iproute2 util-linux coreutils)
  local apt=(apt-get -o DPkg::Lock::Timeout=300)
  echo "cluster.sh: installing ${pkgs[*]} with apt-get ..." >&2
  export DEBIAN_FRONTEND=noninteractive
  if ! "${apt[@]}" install -y -qq --no-install-recommends "${pkgs[@]}" >"/tmp/lsync-cluster-install.log" 2>&1; then
    # package lists missing or stale: refresh once, then retry
    "${apt[@]}" update -qq >>"/tmp/lsync-cluster-install.log" 2>&1 || true
    "${apt[@]}" install -y -qq --no-install-recommends "${pkgs[@]}" >>"/tmp/lsync-cluster-install.log" 2>&1 \
      || { tail -20 /tmp/lsync-cluster-install.log >&2; die "apt-get install ${pkgs[*]} failed (log above)."; }
  fi
  exec 9>&-
  for t in "${tools[@]}"; do command -v "$t" >/dev/null 2>&1 || die "'$t' still missing after installing ${pkgs[*]}."; done
}

write_config() {
  mkdir -p "$DIR"/{state,log,spool/n0,spool/n1}
  printf '127.0.0.1 localhost\n%s n0\n%s n1\n' "${ADDR[0]}" "${ADDR[1]}" >"$DIR/hosts"
  cat >"$SLURM_CONF" <<CONF
# written by ci/cluster.sh for cluster '$NAME'
ClusterName=lsync
SlurmctldHost=n0(${ADDR[0]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=30
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
NodeName=n0 NodeAddr=${ADDR[0]} CPUs=$CPUS RealMemory=4000 State=UNKNOWN
NodeName=n1 NodeAddr=${ADDR[1]} CPUs=$CPUS RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
}

idle_nodes() { on_node 0 sinfo -h -N -o %T 2>/dev/null | grep -c '^idle' || true; }

cmd_up() {
  need_root
  for t in slurmctld slurmd sinfo nsenter unshare ip; do
    command -v "$t" >/dev/null 2>&1 || die "'$t' not found; run: bash ci/cluster.sh install"
  done
  cmd_down >/dev/null 2>&1 || true  # leftovers of a crashed run
  write_config
  local r
  for r in 0 1; do ip netns add "${NS[$r]}"; done
  ip link add "${IFACE[0]}" netns "${NS[0]}" type veth peer name "${IFACE[1]}" netns "${NS[1]}"
  for r in 0 1; do
    ip -n "${NS[$r]}" addr add "${ADDR[$r]}/24" dev "${IFACE[$r]}"
    ip -n "${NS[$r]}" link set lo up
    ip -n "${NS[$r]}" link set "${IFACE[$r]}" up
  done
  on_node 0 slurmctld
  on_node 0 slurmd
  on_node 1 slurmd
  for _ in $(seq 1 120); do
    [ "$(idle_nodes)" = 2 ] && { echo "cluster.sh: up: n0 ${ADDR[0]}, n1 ${ADDR[1]} idle (SLURM_CONF=$SLURM_CONF)"; return 0; }
    sleep 0.25
  done
  echo "cluster.sh: nodes not idle after 30 s:" >&2
  on_node 0 sinfo -N >&2 || true
  tail -n 15 "$DIR"/log/*.log >&2 || true
  cmd_down >/dev/null 2>&1 || true
  die "up failed (slurm logs above)."
}

# TERM, wait up to 5 s, then KILL; only the pids given (ours: from our pid files or our namespaces).
stop_pids() {
  [ "$#" -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true
  local p alive
  for _ in $(seq 1 20); do
    alive=0
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && return 0
    sleep 0.25
  done
  kill -KILL "$@" 2>/dev/null || true
}

cmd_down() {
  need_root
  local r pids=() f p
  if [ -e "/run/netns/${NS[0]}" ] && [ -f "$SLURM_CONF" ]; then
    timeout -k 2 5 nsenter --net="/run/netns/${NS[0]}" scontrol shutdown >/dev/null 2>&1 || true
  fi
  for f in "$DIR"/slurmctld.pid "$DIR"/slurmd-n0.pid "$DIR"/slurmd-n1.pid; do
    [ -f "$f" ] && p=$(cat "$f" 2>/dev/null) && [ -n "$p" ] && kill -0 "$p" 2>/dev/null && pids+=("$p")
  done
  for r in 0 1; do  # anything still running inside our namespaces: daemons, job steps, stuck launchers
    if [ -e "/run/netns/${NS[$r]}" ]; then
      for p in $(ip netns pids "${NS[$r]}" 2>/dev/null); do pids+=("$p"); done
    fi
  done
  stop_pids "${pids[@]+"${pids[@]}"}"
  for r in 0 1; do
    if [ -e "/run/netns/${NS[$r]}" ]; then ip netns del "${NS[$r]}" 2>/dev/null || true; fi
  done
  # The namespaces' veth pair disappears with them. Config and logs go too, unless asked to keep them.
  [ "${LSYNC_CLUSTER_KEEP:-0}" = 1 ] || rm -rf "$DIR"
  for r in 0 1; do
    [ ! -e "/run/netns/${NS[$r]}" ] || die "down: namespace ${NS[$r]} still exists."
  done
  echo "cluster.sh: down (${NS[0]}, ${NS[1]})"
}

cmd_status() {
  local r up=1 f
  for r in 0 1; do
    if [ -e "/run/netns/${NS[$r]}" ]; then echo "n$r: namespace ${NS[$r]} ${ADDR[$r]} (${IFACE[$r]})"
    else echo "n$r: no namespace ${NS[$r]}"; up=0; fi
  done
  for f in slurmctld slurmd-n0 slurmd-n1; do
    if [ -f "$DIR/$f.pid" ] && kill -0 "$(cat "$DIR/$f.pid")" 2>/dev/null; then echo "$f: pid $(cat "$DIR/$f.pid")"
    else echo "$f: not running"; up=0; fi
  done
  [ "$up" = 1 ] || return 1
  on_node 0 sinfo -N
}

main() {
  [ "$#" -ge 1 ] || die "usage: cluster.sh install|up|run NODE CMD...|status|down"
  local sub=$1; shift
  case "$sub" in
    install) cmd_install ;;
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    run)
      local net_only=0
      [ "${1:-}" = --net-only ] && { net_only=1; shift; }
      [ "$#" -ge 2 ] || die "usage: cluster.sh run [--net-only] n0|n1 CMD [ARGS...]"
      local r; r=$(node_index "$1"); shift
      if [ "$net_only" = 1 ]; then
        [ -e "/run/netns/${NS[$r]}" ] || die "node n$r is not up (no namespace ${NS[$r]}); run: bash ci/cluster.sh up"
        exec nsenter --net="/run/netns/${NS[$r]}" "$@"
      fi
      on_node "$r" "$@" ;;
    *) die "unknown subcommand '$sub': use install, up, run, status or down." ;;
  esac
}

main "$@"
