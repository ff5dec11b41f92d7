#!/usr/bin/env bash
# A two-node Slurm cluster on this one host, for trying `hpctrain submit` and for the test suite.
#
#   slurm/cluster.sh up       install what is missing, start munged, slurmctld and slurmd n1 + n2, wait until idle
#   slurm/cluster.sh down     stop what `up` started
#   slurm/cluster.sh status   say what runs (exit 0 when both nodes are up)
#
# Needs root (Debian/Ubuntu). Idempotent: `up` on a running cluster only checks it; `up` after the templates
# changed restarts the daemons. Everything lives under $HPCTRAIN_SLURM_STATE (default /var/lib/hpctrain-slurm);
# the config goes to /etc/slurm so that sbatch, squeue and srun need no SLURM_CONF. A /etc/slurm/slurm.conf
# that this script did not write is never touched.
#
# Each slurmd runs in its own mount namespace, where /var/tmp/pmix is its own directory (/var/tmp/pmix-n1,
# /var/tmp/pmix-n2): without that, the PMIx client directories of two slurmd on one host collide and
# `srun --mpi=pmix` across both nodes fails. GPUs are emulated: character devices under $STATE/dev (twins of /dev/null) stand in for
# /dev/nvidiaN in gres.conf, so Slurm allocates GRES and sets CUDA_VISIBLE_DEVICES as on a GPU node.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STATE="${HPCTRAIN_SLURM_STATE:-/var/lib/hpctrain-slurm}"
CONF_DIR=/etc/slurm
MARKER="# hpctrain local cluster"
CPUS="${HPCTRAIN_SLURM_CPUS:-4}"        # per node; more than the host has is fine (config_overrides)
GPUS="${HPCTRAIN_SLURM_GPUS:-2}"        # emulated GPUs per node
CTLD_PORT="${HPCTRAIN_SLURM_CTLD_PORT:-6817}"
N1_PORT="${HPCTRAIN_SLURM_N1_PORT:-17001}"
N2_PORT="${HPCTRAIN_SLURM_N2_PORT:-17002}"
NODES=(n1 n2)
WAIT_S="${HPCTRAIN_SLURM_WAIT_S:-90}"
PACKAGES=(munge slurmctld slurmd slurm-client slurm-wlm-basic-plugins)

say() { echo "cluster: $*"; }
die() { echo "cluster: error: $*" >&2; exit 1; }

need_root() {
  [ "$(id -u)" = 0 ] || die "run as root (sudo $0 $1): it starts daemons and writes /etc/slurm"
}

alive() {  # alive PIDFILE NAME: the pid in PIDFILE runs a process called NAME
  local pid
  [ -s "$1" ] || return 1
  pid="$(cat "$1" 2>/dev/null)" || return 1
  [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$2" ]
}

stop_pidfiles() {  # stop_pidfiles PIDFILE:NAME...: TERM each, then KILL what still runs after 10 s
  local item file name pid pids=() i running
  for item in "$@"; do
    file="${item%%:*}"; name="${item#*:}"
    alive "$file" "$name" || { rm -f "$file"; continue; }
    pid="$(cat "$file")"
    kill -TERM "$pid" 2>/dev/null || true
    pids+=("$pid:$file:$name")
  done
  for i in $(seq 1 50); do  # each daemon takes about 2 s to end: waited for together, not one by one
    running=0
    for item in "${pids[@]}"; do [ -d "/proc/${item%%:*}" ] && running=1; done
    [ "$running" = 0 ] && break
    sleep 0.2
  done
  for item in "${pids[@]}"; do
    pid="${item%%:*}"; item="${item#*:}"
    if [ -d "/proc/$pid" ]; then kill -KILL "$pid" 2>/dev/null || true; fi
    rm -f "${item%%:*}"
    say "stopped ${item#*:} (pid $pid)"
  done
}

install_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  [ "${#missing[@]}" = 0 ] && return 0
  say "installing ${missing[*]}"
  apt-get update -qq
  # Installing may try to start the services through systemd or init scripts; we start our own below.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

render() {  # render TEMPLATE > FILE
  sed -e "s|@HOSTNAME@|$(hostname -s)|g" -e "s|@STATE@|$STATE|g" -e "s|@CPUS@|$CPUS|g" \
      -e "s|@GPUS@|$GPUS|g" -e "s|@LASTGPU@|$((GPUS - 1))|g" -e "s|@CTLD_PORT@|$CTLD_PORT|g" \
      -e "s|@N1_PORT@|$N1_PORT|g" -e "s|@N2_PORT@|$N2_PORT|g" "$1"
}

write_config() {  # sets CONFIG_CHANGED=1 when a file in /etc/slurm changed
  CONFIG_CHANGED=0
  mkdir -p "$CONF_DIR"
  if [ -f "$CONF_DIR/slurm.conf" ] && ! head -n 1 "$CONF_DIR/slurm.conf" | grep -q "^$MARKER"; then
    die "$CONF_DIR/slurm.conf exists and was not written by $0: this host has its own Slurm; use it, or move that file away"
  fi
  local name tmp
  for name in slurm.conf gres.conf mpi.conf; do
    tmp="$(mktemp)"
    render "$HERE/$name.in" > "$tmp"
    if ! cmp -s "$tmp" "$CONF_DIR/$name"; then
      install -m 0644 "$tmp" "$CONF_DIR/$name"
      CONFIG_CHANGED=1
    fi
    rm -f "$tmp"
  done
}

make_dirs() {
  local n g
  mkdir -p "$STATE"/{ctld,run,log} /var/tmp/pmix
  for n in "${NODES[@]}"; do
    mkdir -p "$STATE/spool-$n" "/var/tmp/pmix-$n" "$STATE/dev/$n"
    for g in $(seq 0 $((GPUS - 1))); do
      # Slurm wants a character device; a twin of /dev/null (1:3) is one that nothing can misuse.
      [ -c "$STATE/dev/$n/nvidia$g" ] || { rm -f "$STATE/dev/$n/nvidia$g"; mknod -m 0666 "$STATE/dev/$n/nvidia$g" c 1 3; }
    done
  done
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    return 0
  fi
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged
  touch "$STATE/run/munged.ours"
  local i
  for i in $(seq 1 50); do
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && { say "munged started"; return 0; }
    sleep 0.2
  done
  die "munged did not start (see /var/log/munge/munged.log)"
}

start_ctld() {
  alive "$STATE/run/slurmctld.pid" slurmctld && return 0
  slurmctld
  say "slurmctld started (log $STATE/log/slurmctld.log)"
}

start_slurmd() {  # start_slurmd NODE: in a private mount namespace with its own /var/tmp/pmix
  local n="$1"
  alive "$STATE/run/slurmd-$n.pid" slurmd && return 0
  # shellcheck disable=SC2016  # $1 expands in the inner shell: the node name arrives as an argument
  unshare -m --propagation private sh -c \
    'mount --bind "/var/tmp/pmix-$1" /var/tmp/pmix && exec slurmd -N "$1"' sh "$n"
  say "slurmd $n started (log $STATE/log/slurmd-$n.log)"
}

nodes_up() {  # both nodes idle, mixed or allocated (not down, drained or unknown)
  local states
  states="$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u)" || return 1
  for n in "${NODES[@]}"; do
    echo "$states" | grep -Eq "^$n (idle|mix|alloc|comp)\*?$" || return 1
  done
}

wait_up() {
  local i
  for i in $(seq 1 $((WAIT_S * 2))); do
    if nodes_up; then
      say "up: nodes n1 n2 ($CPUS CPUs, $GPUS emulated GPUs each), partition debug"
      return 0
    fi
    # A node left DOWN by an earlier run of this cluster comes back once its slurmd answers.
    if [ $((i % 10)) = 0 ]; then
      scontrol update NodeName=n1,n2 State=RESUME >/dev/null 2>&1 || true
    fi
    sleep 0.5
  done
  sinfo -N -l >&2 || true
  tail -n 20 "$STATE/log/slurmctld.log" >&2 || true
  die "nodes not idle after ${WAIT_S}s (logs in $STATE/log)"
}

stop_all() {
  local n daemons=()
  for n in "${NODES[@]}"; do daemons+=("$STATE/run/slurmd-$n.pid:slurmd"); done
  daemons+=("$STATE/run/slurmctld.pid:slurmctld")
  [ -f "$STATE/run/munged.ours" ] && daemons+=("/run/munge/munged.pid:munged")
  stop_pidfiles "${daemons[@]}"
  rm -f "$STATE/run/munged.ours"
}

case "${1:-}" in
  up)
    need_root up
    install_packages
    make_dirs
    write_config
    if [ "$CONFIG_CHANGED" = 1 ] && { alive "$STATE/run/slurmctld.pid" slurmctld ||
        alive "$STATE/run/slurmd-n1.pid" slurmd || alive "$STATE/run/slurmd-n2.pid" slurmd; }; then
      say "config changed: restarting the daemons"
      daemons=("$STATE/run/slurmctld.pid:slurmctld")
      for n in "${NODES[@]}"; do daemons+=("$STATE/run/slurmd-$n.pid:slurmd"); done
      stop_pidfiles "${daemons[@]}"
    fi
    start_munge
    start_ctld
    for n in "${NODES[@]}"; do start_slurmd "$n"; done
    wait_up
    ;;
  down)
    need_root down
    stop_all
    say "down"
    ;;
  status)
    for n in slurmctld slurmd-n1 slurmd-n2; do
      if alive "$STATE/run/$n.pid" "${n%%-*}"; then echo "$n: running (pid $(cat "$STATE/run/$n.pid"))"
      else echo "$n: stopped"; fi
    done
    # sinfo retries a stopped slurmctld for about 20 s: ask it only when the daemon runs
    alive "$STATE/run/slurmctld.pid" slurmctld || exit 1
    if nodes_up; then sinfo -N -o '%N %t %c %G'; exit 0; fi
    exit 1
    ;;
  *)
    echo "usage: $0 up|down|status" >&2
    exit 2
    ;;
esac
