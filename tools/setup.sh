#!/bin/sh
# Installs what libctr needs from Debian's archive (only what is missing, so a
# second run is quick), then configures and builds into ./build.
#
#   tools/setup.sh            build dependencies, then build
#   tools/setup.sh --tests    also the test dependencies (GoogleTest, PyTorch for parity)
#
# Environment: BUILD_DIR (default build), MESON_ARGS (extra `meson setup` arguments).
set -eu

cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}

pkgs="meson ninja-build pkg-config g++ flatbuffers-compiler libflatbuffers-dev
libopenblas-dev libcli11-dev nlohmann-json3-dev libxxhash-dev libssl-dev libucx-dev python3"
if [ "${1:-}" = "--tests" ]; then
  pkgs="$pkgs libgtest-dev python3-numpy python3-torch python3-flatbuffers python3-setuptools
ucx-utils binutils golang-go valgrind"
fi

missing=""
for p in $pkgs; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  echo "setup: installing$missing"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends $missing
fi

# The test suites need GoogleTest, which only --tests installs: a build made for
# the quick start leaves them out, and --tests turns them on.
if [ "${1:-}" = "--tests" ]; then tests=true; else tests=false; fi
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  # shellcheck disable=SC2086
  meson setup "$BUILD_DIR" -Dtests=$tests ${MESON_ARGS:-}
else
  # Packages installed just now (UCX, GoogleTest, ...) are found only by a
  # fresh configuration.
  if [ -n "$missing" ]; then meson setup --reconfigure "$BUILD_DIR"; fi
  if [ "$tests" = true ]; then meson configure "$BUILD_DIR" -Dtests=true; fi
  # shellcheck disable=SC2086
  if [ -n "${MESON_ARGS:-}" ]; then meson configure "$BUILD_DIR" ${MESON_ARGS}; fi
fi
ninja -C "$BUILD_DIR"
