#!/usr/bin/env bash
# Horovod 0.28.1 from its PyPI sdist, built against this machine's Open MPI, into a venv of its own: the peer
# that benchmarks/step_limit.py and benchmarks/horovod_compare.py time hpctrain against (--horovod-python).
#
#   bash benchmarks/build_horovod.sh [VENV]        # default /tmp/hvdenv; about 3.5 minutes on 2 cores
#                                                  # (the build's log: VENV/horovod-build.log)
#   python benchmarks/step_limit.py --rounds 5 --horovod-python /tmp/hvdenv/bin/python
#
# The same torch as the project's (the CPU wheel, pinned), MPI only (no Gloo, TensorFlow or MXNet), and one
# change to the sdist: C++17 instead of its C++14, which today's torch headers need.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/tmp/hvdenv}
VERSION=0.28.1
TORCH=$(awk -F' *[?:]?= *' '/^TORCH_VERSION/{print $2; exit}' Makefile)  # the Makefile's pin
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "torch==${TORCH:-2.13.0}" numpy cmake
"$VENV/bin/pip" download -q --no-deps --no-binary :all: "horovod==$VERSION" -d "$WORK"
tar xzf "$WORK/horovod-$VERSION.tar.gz" -C "$WORK"
cd "$WORK/horovod-$VERSION"
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' CMakeLists.txt horovod/torch/CMakeLists.txt
HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITHOUT_GLOO=1 HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS=-j"$(nproc)" \
    "$VENV/bin/pip" install --no-build-isolation -v . > "$VENV/horovod-build.log" 2>&1
cd /  # not the source tree: its horovod/ has no built extension
"$VENV/bin/python" -c "import horovod, horovod.torch as hvd; hvd.init(); assert hvd.mpi_built(); print('horovod', horovod.__version__, 'with MPI in', '$VENV')"
