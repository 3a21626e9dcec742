#!/bin/sh
# Builds a self-contained bundle for a GPU machine that has the NVIDIA driver
# and CUDA (its own installation or PyTorch's CUDA wheels) but no package
# registries:
#
#   tools/gpu/bundle.sh [OUT]        default OUT: gpu-bundle.tar.xz
#
# The bundle holds libctr, libctr-cuda.so, the ctr tool, the GPU suite (its
# C++ tests and the two-ranks-on-one-GPU test with its training program), the
# plugin test, tools/gpu/run.sh, and every shared library they need except the
# CUDA libraries (cuBLASLt, the driver), which run.sh finds on the target. The
# C and C++ runtimes and their loader are included, so the programs also start
# on a system older than this one (run.sh uses the bundled loader when the
# system's cannot run them). Build directory: BUILD_DIR (default build-gpu).
set -eu
cd "$(dirname "$0")/../.."
out=${1:-gpu-bundle.tar.xz}
BUILD_DIR=${BUILD_DIR:-build-gpu}
PATH="$PATH:/usr/local/cuda/bin"
export PATH

if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  meson setup "$BUILD_DIR" -Dcuda=enabled -Dtests=true -Dnative=false >/dev/null
fi
libctr=$(ninja -C "$BUILD_DIR" -t targets all | sed -n 's/^\(lib\/libctr\.so\.[0-9.]*\): .*/\1/p' | head -1)
ninja -C "$BUILD_DIR" "$libctr" lib/libctr-cuda.so tools/ctr tests/test_gpu tests/test_plugin \
  tests/equiv_train tests/libctr-testdev.so tests/libctr-badabi.so >/dev/null

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
b="$stage/ctr-gpu"
mkdir -p "$b/bin" "$b/lib"
cp "$BUILD_DIR/tools/ctr" "$BUILD_DIR/tests/test_gpu" "$BUILD_DIR/tests/test_plugin" "$BUILD_DIR/tests/equiv_train" \
  "$b/bin/"
cp tests/gpu/test_gpu_ranks.py "$b/"
# The benchmark against PyTorch and the PyTorch models it builds.
mkdir -p "$b/py/bench" "$b/py/export/models"
cp tools/bench/bench_gpu.py tools/bench/torch_models.py "$b/py/bench/"
cp tools/export/models/*.py "$b/py/export/models/"
cp -L "$BUILD_DIR/lib/libctr.so" "$b/lib/libctr.so.1"
cp "$BUILD_DIR/lib/libctr-cuda.so" "$BUILD_DIR/tests/libctr-testdev.so" "$BUILD_DIR/tests/libctr-badabi.so" "$b/lib/"
cp tools/gpu/run.sh "$b/"

# Every library the programs load, except the CUDA ones taken from the target.
for f in "$b"/bin/* "$b"/lib/*.so*; do
  ldd "$f" 2>/dev/null | awk '$3 ~ /^\// {print $3} $1 ~ /^\/.*ld-linux/ {print $1}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libcublas* | libcudart* | libcuda.so* | libnccl* | libctr*) ;;
    *) cp -L "$lib" "$b/lib/" ;;
  esac
done
# UCX loads its transports from ucx/ beside libucs.
ucx_modules=$(dirname "$(ldd "$b/bin/ctr" | awk '/libucs.so/ {print $3}')")/ucx
if [ -d "$ucx_modules" ]; then
  mkdir -p "$b/lib/ucx"
  for m in "$ucx_modules"/*.so.0; do
    case "$(basename "$m")" in
      *_cuda* | *_rocm* | *_gdr* | *_ib* | *_rdmacm* | *_xpmem*) ;;
      *) cp -L "$m" "$b/lib/ucx/" ;;
    esac
  done
fi
strip --strip-unneeded "$b"/bin/* "$b"/lib/*.so* 2>/dev/null || true
git rev-parse HEAD > "$b/COMMIT" 2>/dev/null || echo unknown > "$b/COMMIT"
tar -C "$stage" -cJf "$out" ctr-gpu
echo "bundle: $out ($(du -h "$out" | cut -f1), unpacked $(du -sh "$b" | cut -f1))"
