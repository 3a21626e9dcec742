#!/bin/sh
# Installs what libctr needs from Debian's archive (only what is missing, so a
# second run is quick), then configures and builds.
#
#   tools/setup.sh              build dependencies, then build into ./build
#   tools/setup.sh --tests      also the test dependencies: GoogleTest and the like from
#                               Debian, and the Python environment of the tests and the
#                               exporter (PyTorch, numpy, pytest, ...) from PyPI into .venv,
#                               exactly as tools/requirements-test.txt pins it
#   tools/setup.sh --sanitize   also clang, its sanitizer runtimes and llvm-symbolizer;
#                               builds into ./build-san with clang under AddressSanitizer
#                               and UndefinedBehaviorSanitizer, with the tests and the
#                               libFuzzer targets (the build tools/sanitize.sh runs)
#
# Environment: BUILD_DIR (default build, or build-san with --sanitize), MESON_ARGS
# (extra `meson setup` arguments). The test suites run their Python programs with
# .venv/bin/python3 (tests/meson.build), which --tests and --sanitize make.
set -eu

cd "$(dirname "$0")/.."
mode=${1:-}
case "$mode" in
  "" | --tests | --sanitize) ;;
  *) echo "usage: $0 [--tests | --sanitize]" >&2; exit 2 ;;
esac
if [ "$mode" = --sanitize ]; then BUILD_DIR=${BUILD_DIR:-build-san}; else BUILD_DIR=${BUILD_DIR:-build}; fi

pkgs="meson ninja-build pkg-config g++ flatbuffers-compiler libflatbuffers-dev
libopenblas-dev libdnnl-dev libcli11-dev nlohmann-json3-dev libxxhash-dev libssl-dev libucx-dev python3"
if [ -n "$mode" ]; then
  pkgs="$pkgs libgtest-dev python3-numpy python3-setuptools python3-venv
ucx-utils binutils golang-go valgrind"
  # The launchers and tokenizers the integration tests start for real: Open MPI's
  # mpirun, Slurm (the test runs its own one-node cluster: slurmctld, slurmd and
  # munged), and SentencePiece (the library ctr links when found, spm_train for the
  # test's own model).
  pkgs="$pkgs openmpi-bin slurm-wlm munge libsentencepiece-dev sentencepiece"
fi
if [ "$mode" = --sanitize ]; then
  pkgs="$pkgs clang libclang-rt-dev llvm libomp-dev"  # libomp: clang's OpenMP, which oneDNN's bf16 GEMMs use
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

# The tests' Python environment. It is made anew whenever the requirements file differs
# from the copy the venv keeps of the one it was made from (so a package dropped from the
# file goes too), and is left alone otherwise. pip keeps the wheels it downloaded in its
# cache, so making it again takes no download. --no-deps: the file lists every package,
# dependencies included; --no-compile: modules are compiled when first imported, not all
# of torch's at install.
venv_made=false
if [ -n "$mode" ]; then
  req=tools/requirements-test.txt
  if ! cmp -s "$req" .venv/requirements-test.txt; then
    echo "setup: making the Python environment .venv ($req)"
    rm -rf .venv
    /usr/bin/python3 -m venv .venv
    .venv/bin/python3 -m pip install -q --disable-pip-version-check --no-deps --no-compile \
      --only-binary=:all: -r "$req"
    cp "$req" .venv/requirements-test.txt
    venv_made=true
  fi
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
  # Packages installed just now (UCX, GoogleTest, ...) and a new .venv are found
  # only by a fresh configuration.
  if [ -n "$missing" ] || [ "$venv_made" = true ]; then meson setup --reconfigure "$BUILD_DIR"; fi
  if [ "$tests" = true ]; then meson configure "$BUILD_DIR" -Dtests=true; fi
  # shellcheck disable=SC2086
  if [ -n "${MESON_ARGS:-}" ] || [ $# -gt 0 ]; then meson configure "$BUILD_DIR" ${MESON_ARGS:-} "$@"; fi
fi
ninja -C "$BUILD_DIR"
