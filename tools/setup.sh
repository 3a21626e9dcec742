#!/bin/sh
# Installs what libctr needs from Debian's archive (only what is missing, so a
# second run is quick), then configures and builds.
#
#   tools/setup.sh              build dependencies, then build into ./build
#   tools/setup.sh --tests      also the test dependencies (GoogleTest, PyTorch for parity)
#   tools/setup.sh --sanitize   also clang, its sanitizer runtimes and llvm-symbolizer;
#                               builds into ./build-san with clang under AddressSanitizer
#                               and UndefinedBehaviorSanitizer, with the tests and the
#                               libFuzzer targets (the build tools/sanitize.sh runs)
#
# Environment: BUILD_DIR (default build, or build-san with --sanitize), MESON_ARGS
# (extra `meson setup` arguments).
set -eu

cd "$(dirname "$0")/.."
mode=${1:-}
case "$mode" in
  "" | --tests | --sanitize) ;;
  *) echo "usage: $0 [--tests | --sanitize]" >&2; exit 2 ;;
esac
if [ "$mode" = --sanitize ]; then BUILD_DIR=${BUILD_DIR:-build-san}; else BUILD_DIR=${BUILD_DIR:-build}; fi

pkgs="meson ninja-build pkg-config g++ flatbuffers-compiler libflatbuffers-dev
libopenblas-dev libcli11-dev nlohmann-json3-dev libxxhash-dev libssl-dev libucx-dev python3"
if [ -n "$mode" ]; then
  pkgs="$pkgs libgtest-dev python3-numpy python3-torch python3-flatbuffers python3-setuptools
ucx-utils binutils golang-go valgrind"
fi
if [ "$mode" = --sanitize ]; then
  pkgs="$pkgs clang libclang-rt-dev llvm"
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

# The sanitizer build: one clang build serves the sanitized test suites and the
# fuzzers (-Dfuzz=true adds libFuzzer's coverage instrumentation). Every program
# and libctr.so link the shared AddressSanitizer runtime (found through an
# rpath), so that Python, Go and Rust programs can load the sanitized libctr.so
# with that runtime preloaded. CUDA is left out: its kernels are not sanitized.
if [ "$mode" = --sanitize ]; then
  export CC=clang CXX=clang++
  runtime_dir=$(dirname "$(clang -print-file-name=libclang_rt.asan-x86_64.so)")
  set -- -Dcuda=disabled -Dnccl=disabled -Dbuildtype=debugoptimized -Db_lundef=false \
    -Db_sanitize=address,undefined -Dfuzz=true \
    "-Dc_link_args=-shared-libasan -Wl,-rpath,$runtime_dir" \
    "-Dcpp_link_args=-shared-libasan -Wl,-rpath,$runtime_dir"
else
  set --
fi

# nvcc lives outside PATH in the CUDA toolkit's standard prefix; meson finds the
# CUDA compiler on PATH only.
if [ -x /usr/local/cuda/bin/nvcc ]; then
  case ":$PATH:" in *:/usr/local/cuda/bin:*) ;; *) PATH="$PATH:/usr/local/cuda/bin"; export PATH ;; esac
fi

# The test suites need GoogleTest, which only --tests installs: a build made for
# the quick start leaves them out, and --tests turns them on.
if [ -n "$mode" ]; then tests=true; else tests=false; fi
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  # shellcheck disable=SC2086
  meson setup "$BUILD_DIR" -Dtests=$tests ${MESON_ARGS:-} "$@"
else
  # Packages installed just now (UCX, GoogleTest, ...) are found only by a
  # fresh configuration.
  if [ -n "$missing" ]; then meson setup --reconfigure "$BUILD_DIR"; fi
  if [ "$tests" = true ]; then meson configure "$BUILD_DIR" -Dtests=true; fi
  # shellcheck disable=SC2086
  if [ -n "${MESON_ARGS:-}" ] || [ $# -gt 0 ]; then meson configure "$BUILD_DIR" ${MESON_ARGS:-} "$@"; fi
fi
ninja -C "$BUILD_DIR"
