#!/bin/sh
# Builds the bundle that carries libctr's GPU checks to a GPU machine without
# package registries (the NVIDIA driver and CUDA 13 there: a CUDA installation
# or PyTorch's CUDA wheels):
#
#   tools/gpu/bundle.sh [OUT]        default OUT: gpu-bundle.tar.xz
#
# The tarball unpacks to ctr-gpu/: bin/ (ctr, test_gpu, test_plugin,
# equiv_train), lib/ (libctr, libctr-cuda.so, the plugin test's plugins, UCX's
# transports in lib/ucx), one wrapper per program beside them (ctr-gpu/ctr runs
# bin/ctr with lib/ and the target's CUDA libraries on its library path, see
# env.sh), check.sh, the two-ranks test and the benchmark against PyTorch.
#
# What is carried is decided per library by rule: the programs' shared
# libraries are bundled except the system's own (the glibc family, the loader,
# libstdc++, libgcc_s), which the target's newer ones replace, and the CUDA and
# NVIDIA libraries, which are the target's. Every carried binary is then checked
# to need at most GLIBC_2.34 and GLIBCXX_3.4.30 (CTR_MAX_GLIBC,
# CTR_MAX_GLIBCXX) and libctr's own code to hold no AVX-512 instruction outside
# the functions that run only where cpuid reports AVX-512 (a target attribute:
# kernels/cpu/peak.cc's register-only peak loops); the
# bundle fails otherwise. The build is BUILD_DIR (default build-gpu), set up
# with -Dcuda=enabled -Dtests=true -Dnative=false (generic x86-64), and
# -Dnccl=enabled where nccl.h exists.
set -eu
cd "$(dirname "$0")/../.."
out=${1:-gpu-bundle.tar.xz}
case $out in /*) ;; *) out=$PWD/$out ;; esac
BUILD_DIR=${BUILD_DIR:-build-gpu}
MAX_GLIBC=${CTR_MAX_GLIBC:-2.34}
MAX_GLIBCXX=${CTR_MAX_GLIBCXX:-3.4.30}
PATH="$PATH:/usr/local/cuda/bin"
export PATH

# ---------------------------------------------------------------------------
# Build

if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  nccl=disabled
  if [ -f /usr/local/cuda/include/nccl.h ] || [ -f /usr/include/nccl.h ]; then nccl=enabled; fi
  meson setup "$BUILD_DIR" -Dcuda=enabled -Dnccl=$nccl -Dtests=true -Dnative=false >/dev/null
fi
if [ "$(meson introspect --buildoptions "$BUILD_DIR" | python3 -c 'import json, sys
print(next(o["value"] for o in json.load(sys.stdin) if o["name"] == "native"))')" != False ]; then
  echo "bundle: $BUILD_DIR is built with -Dnative=true; the bundle needs generic code (-Dnative=false)" >&2
  exit 1
fi
libctr=$(ninja -C "$BUILD_DIR" -t targets all | sed -n 's/^\(lib\/libctr\.so\.[0-9.]*\): .*/\1/p' | head -1)
ninja -C "$BUILD_DIR" ${NINJA_JOBS:+-j"$NINJA_JOBS"} "$libctr" lib/libctr-cuda.so tools/ctr tests/test_gpu \
  tests/test_plugin tests/equiv_train tests/libctr-testdev.so tests/libctr-badabi.so \
  tests/libctr-faultdev.so tests/libctr-graphdev.so >/dev/null

# ---------------------------------------------------------------------------
# Programs, libctr, scripts

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
b="$stage/ctr-gpu"
mkdir -p "$b/bin" "$b/lib/ucx" "$b/py/bench" "$b/py/export/models"
programs="ctr test_gpu test_plugin equiv_train"
cp "$BUILD_DIR/tools/ctr" "$BUILD_DIR/tests/test_gpu" "$BUILD_DIR/tests/test_plugin" "$BUILD_DIR/tests/equiv_train" \
  "$b/bin/"
soname=$(readelf -d "$BUILD_DIR/$libctr" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
cp -L "$BUILD_DIR/$libctr" "$b/lib/$soname"
cp "$BUILD_DIR/lib/libctr-cuda.so" "$BUILD_DIR"/tests/libctr-testdev.so "$BUILD_DIR"/tests/libctr-badabi.so \
  "$BUILD_DIR"/tests/libctr-faultdev.so "$BUILD_DIR"/tests/libctr-graphdev.so "$b/lib/"
for p in $programs; do
  cp tools/gpu/wrapper.sh "$b/$p"
  chmod +x "$b/$p"
done
cp tools/gpu/env.sh tools/gpu/check.sh tests/gpu/test_gpu_ranks.py "$b/"
# The benchmark against PyTorch and the PyTorch models it builds.
cp tools/bench/bench_gpu.py tools/bench/torch_models.py "$b/py/bench/"
cp tools/export/models/*.py "$b/py/export/models/"

# ---------------------------------------------------------------------------
# Shared libraries, by rule

# carried NAME: whether a library (by file name) travels in the bundle.
carried() {
  case $1 in
    # glibc and its loader, the C++ runtime and libgcc_s: the target's own.
    libc.so* | libm.so* | libmvec.so* | libpthread.so* | libdl.so* | librt.so* | libresolv.so* | libutil.so* | \
      libanl.so* | libnsl.so* | libthread_db.so* | libBrokenLocale.so* | ld-linux*.so* | linux-vdso.so* | \
      libstdc++.so* | libgcc_s.so*) return 1 ;;
    # The driver and CUDA's libraries: found on the target (env.sh).
    libcuda.so* | libcublas* | libcudart* | libnccl* | libcudnn* | libnvidia* | libnvrtc* | libnvJitLink* | \
      libcufft* | libcurand* | libcusparse* | libcusolver* | libnvToolsExt* | libcupti*) return 1 ;;
    # libctr and its plugins are copied above.
    libctr*) return 1 ;;
  esac
  return 0
}

# UCX loads its transports from ucx/ beside libucs: shared memory ones only
# (the CUDA, ROCm, InfiniBand, GDRCopy, XPMEM and RDMA-CM ones need drivers).
ucs=$(ldd "$b/bin/ctr" | awk '/libucs\.so/ {print $3}')
if [ -n "$ucs" ] && [ -d "$(dirname "$ucs")/ucx" ]; then
  for m in "$(dirname "$ucs")"/ucx/*.so.0; do
    case $(basename "$m") in
      *_cuda* | *_rocm* | *_gdr* | *_ib* | *_rdmacm* | *_xpmem*) ;;
      *) cp -L "$m" "$b/lib/ucx/" ;;
    esac
  done
fi

: > "$stage/skipped"
for f in "$b"/bin/* "$b"/lib/*.so* "$b"/lib/ucx/*.so*; do
  [ -e "$f" ] || continue
  LD_LIBRARY_PATH="$b/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$f" 2>/dev/null |
    awk '$2 == "=>" && $3 ~ /^\// {print $1, $3} $2 == "=>" && $3 == "not" {print $1, "-"}'
done | sort -u | while read -r name path; do
  if carried "$name"; then
    if [ "$path" = - ]; then
      echo "bundle: $name is needed but not found on this machine" >&2
      exit 1
    fi
    [ -e "$b/lib/$name" ] || cp -L "$path" "$b/lib/$name"
  else
    case $name in libctr*) ;; *) echo "$name" >> "$stage/skipped" ;; esac
  fi
done
strip --strip-unneeded "$b"/bin/* "$b"/lib/*.so* "$b"/lib/ucx/*.so* 2>/dev/null || true

# ---------------------------------------------------------------------------
# Checks: C library and C++ runtime versions, no AVX-512 in libctr's code

# The highest version of each of glibc, libstdc++ and its ABI that FILE needs
# (its .gnu.version_r), as "GLIBC_x GLIBCXX_y CXXABI_z".
needs() {
  readelf -V --wide "$1" 2>/dev/null | awk '
    /^Version needs section/ {r = 1; next}
    /^Version (definition|symbols) section/ {r = 0}
    r && match($0, /Name: (GLIBC|GLIBCXX|CXXABI)_[0-9.]+/) {
      v = substr($0, RSTART + 6, RLENGTH - 6); print v
    }' | sort -t_ -k1,1 -k2,2V | awk -F_ '{top[$1] = $0} END {
      printf "%s %s %s\n", top["GLIBC"] ? top["GLIBC"] : "-", top["GLIBCXX"] ? top["GLIBCXX"] : "-",
        top["CXXABI"] ? top["CXXABI"] : "-"}'
}
newer() { [ "$1" != "$2" ] && [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | tail -n 1)" = "$1" ]; }

report="$b/BUNDLE.txt"
{
  echo "commit: $(git describe --always --dirty --abbrev=40 2>/dev/null || echo unknown)"
  echo "built on: $(. /etc/os-release && echo "$PRETTY_NAME"), glibc $(getconf GNU_LIBC_VERSION | cut -d' ' -f2)"
  echo "not carried (the target's own): $(sort -u "$stage/skipped" | tr '\n' ' ')"
  echo
  echo "highest symbol versions needed (limits: GLIBC_$MAX_GLIBC, GLIBCXX_$MAX_GLIBCXX):"
} > "$report"
bad=0
for f in "$b"/bin/* "$b"/lib/*.so* "$b"/lib/ucx/*.so*; do
  set -- $(needs "$f")
  verdict=ok
  if [ "$1" != - ] && newer "${1#GLIBC_}" "$MAX_GLIBC"; then verdict="TOO NEW ($1)"; bad=1; fi
  if [ "$2" != - ] && newer "${2#GLIBCXX_}" "$MAX_GLIBCXX"; then verdict="TOO NEW ($2)"; bad=1; fi
  printf '  %-28s %-12s %-16s %-14s %s\n' "${f#"$b"/}" "$1" "$2" "$3" "$verdict" >> "$report"
done
echo >> "$report"
# Functions compiled for AVX-512 by a target attribute run only where cpuid
# says the CPU has it (kernels/cpu/peak.cc measures the peak that way): they
# are allowed, by name, and counted apart. Any other AVX-512 instruction would
# be code a CPU without it cannot run.
dispatched=$(sed -n 's/^__attribute__((target("[^"]*"))) [a-z0-9_ ]* \([A-Za-z0-9_]*\)(.*/\1/p' \
  kernels/cpu/*.cc | sort -u | tr '\n' ' ')
echo "AVX-512 instructions (zmm or mask registers) in libctr's code, outside the functions" \
  "dispatched on cpuid ($dispatched):" >> "$report"
for f in "$b/lib/$soname" "$b/lib/libctr-cuda.so" "$b"/bin/*; do
  counts=$(objdump -d -C --no-show-raw-insn "$f" | awk -v allowed="$dispatched" '
    BEGIN { n = split(allowed, a, " "); for (i = 1; i <= n; i++) ok[a[i]] = 1 }
    /^[0-9a-f]+ <.*>:$/ {
      fn = $0; sub(/^[0-9a-f]+ </, "", fn); sub(/>:$/, "", fn)
      base = fn; sub(/\([^()]*\)( const)?$/, "", base); sub(/.*::/, "", base)
      free = (base in ok)
    }
    /%zmm|%k[0-7]/ { if (free) d++; else { c++; if (!(fn in seen)) { seen[fn] = 1; first = first "\n    " fn } } }
    END { printf "%d %d%s\n", c, d, first }')
  n=${counts%% *}
  rest=${counts#* }
  printf '  %-28s %s (dispatched on cpuid: %s)\n' "${f#"$b"/}" "$n" "${rest%%
*}" >> "$report"
  if [ "$n" -ne 0 ]; then
    printf '%s\n' "$counts" | tail -n +2 | head -n 10 >> "$report"
    bad=1
  fi
done
git describe --always --dirty --abbrev=40 > "$b/COMMIT" 2>/dev/null || echo unknown > "$b/COMMIT"
cat "$report"
if [ $bad -ne 0 ]; then
  echo "bundle: refused: a binary needs a newer C library or C++ runtime than the limits, or holds AVX-512 code" >&2
  exit 1
fi

tar -C "$stage" -cf - ctr-gpu | xz -9e -T1 > "$out"
echo "bundle: $out ($(du -h "$out" | cut -f1), unpacked $(du -sh "$b" | cut -f1), $(find "$b" -type f | wc -l) files)"
