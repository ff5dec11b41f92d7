#!/usr/bin/env bash
# Where the CPU of running ranks goes, by shared object: `perf record -e cpu-clock` on every process whose
# command line matches PATTERN (each rank of a running job), for SECONDS, then per process the share of its
# samples in Open MPI's polling loops (the vader BTL, opal_progress: a rank spinning while it waits), the kernel
# (for the allreduce mostly Open MPI's CMA copy of the peer's memory, `_copy_to_iter`), Open MPI's reduction
# (`mca_op_*`), Python and torch. Used for docs/performance.md (ninth session): `train`'s ranks polled 7-19 %
# of their samples, the library API loop's 1-5 %, skipping the per-step agreement changed nothing.
#
#   hpctrain launch -n 2 -- train --data DIR --model mlp:2048,2048 --batch-size 64 --max-steps 800 \
#       --checkpoint-every 0 --run-dir /tmp/run &
#   sleep 8; bash benchmarks/cpu_share.sh '^/[^ ]*python -m hpctrain train .*/tmp/run' 5
#
# Needs `perf` (apt-get install linux-perf) and perf_event_paranoid <= 2 for processes of the same user; the
# software event cpu-clock works in VMs without a PMU. Writes its samples under a temporary directory.
set -euo pipefail
pattern=${1:?usage: cpu_share.sh PATTERN [SECONDS]}
seconds=${2:-5}
command -v perf >/dev/null || { echo "cpu_share.sh: perf not found (apt-get install linux-perf)" >&2; exit 2; }
pids=()
for pid in $(pgrep -f -- "$pattern" || true); do  # not this script (its command line holds the pattern too)
  cmdline=$(tr '\0' ' ' 2>/dev/null < "/proc/$pid/cmdline") || continue  # gone already (pgrep's own subshell)
  if [[ -n $cmdline && $cmdline != *cpu_share.sh* ]]; then pids+=("$pid"); fi
done
[ ${#pids[@]} -gt 0 ] || { echo "cpu_share.sh: no process matches '$pattern'" >&2; exit 2; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
for pid in "${pids[@]}"; do
  timeout $((seconds + 30)) perf record -q -e cpu-clock -F 1000 -p "$pid" -o "$dir/$pid.data" -- sleep "$seconds" \
    >/dev/null 2>&1 &
done
wait
for pid in "${pids[@]}"; do
  [ -s "$dir/$pid.data" ] || { echo "pid $pid: no samples (did it end?)"; continue; }
  perf report -i "$dir/$pid.data" --no-children --sort dso --stdio 2>/dev/null | awk -v pid="$pid" '
    /%/ { gsub("%", "", $1); share = $1 + 0; dso = $2; total += share
          if (dso ~ /vader|open-pal|pml_ob1|libmpi/) poll += share
          else if (dso ~ /kernel/) kernel += share
          else if (dso ~ /mca_op/) op += share
          else if (dso ~ /python|multiarray|MPI\./) py += share
          else if (dso ~ /torch|c10/) torch += share }
    END { printf "pid %s: MPI polling %.1f%%, kernel %.1f%%, MPI reduction %.1f%%, Python %.1f%%, torch %.1f%%\n",
                 pid, poll, kernel, op, py, torch }'
done
