#!/usr/bin/env bash
# Build DyNet 2.1.2 (its C++ library and Python module) into a virtual environment of its
# own, for `python -m benchmarks.vs_dynet --dynet-python DEST/venv/bin/python`.
#
# DyNet has no wheel for Python 3.11, and its source distribution would download a pinned
# Eigen from GitHub; this takes Debian's Eigen 3.4 headers instead (unpacked under DEST,
# nothing installed system-wide). Needs python3, g++, cmake, apt-get, and PyPI and Debian
# reachable. About 5 minutes on 2 cores. Usage: benchmarks/build_dynet.sh [DEST] (.dynet)
set -euo pipefail
PYTHON=${PYTHON:-python3}
DEST=${1:-.dynet}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
cd "$DEST"

"$PYTHON" -m venv venv
venv/bin/pip install -q --upgrade pip
venv/bin/pip install -q "cython<3" numpy setuptools wheel
venv/bin/pip download -q --no-deps -d . dyNET==2.1.2  # an sdist only
apt-get download libeigen3-dev
dpkg-deb -x libeigen3-dev_*.deb eigen
rm -rf dyNET-2.1.2
tar xzf dyNET-2.1.2.tar.gz

cd dyNET-2.1.2
# DyNet's CMake builds with -Ofast -march=native (Release)
EIGEN3_INCLUDE_DIR="$DEST/eigen/usr/include/eigen3" MAKEFLAGS=-j"$(nproc)" \
    ../venv/bin/python setup.py build
# setup.py's install step stops on a missing LICENSE.txt, so the built files are copied:
# the module links libdynet.so from the venv's lib/ (its rpath)
BUILT=$(ls -d build/py*-64bit)
SITE=$(../venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp "$BUILT"/dynet/libdynet.so ../venv/lib/
cp "$BUILT"/python/_dynet*.so "$BUILT"/python/dynet.py "$BUILT"/python/dynet_config.py \
    "$BUILT"/python/dynet_viz.py "$SITE"/
cd "$DEST"
venv/bin/python -c "import dynet_config; dynet_config.set(mem='64'); import dynet; \
print('DyNet built:', dynet.__file__)"
echo "use: python -m benchmarks.vs_dynet --dynet-python $DEST/venv/bin/python"
