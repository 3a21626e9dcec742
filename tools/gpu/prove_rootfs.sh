#!/bin/sh
# Proves on a machine without a GPU that the GPU bundle runs on a system newer
# than the one that built it: the bundle carries no C library, C++ runtime or
# loader, so its programs must start on the target's own (glibc 2.39 and later
# on the GPU machines; Debian 12 builds with 2.36). The proof:
#
#   1. a Debian 13 (trixie, glibc 2.41) minbase root made with debootstrap,
#      unless ROOT already holds one;
#   2. tools/gpu/bundle.sh;
#   3. the tarball unpacked inside the root and ctr-gpu/check.sh run there under
#      chroot with a clean environment: it must exit 0, leave exactly the three
#      report files, skip every GPU stage with the reason, and `ctr version`
#      must run on the root's glibc (no missing GLIBC_ version, no stack
#      smashing); then the whole check on the CPU backend there
#      (CTR_CHECK_DEVICE=cpu: the GPU suite's harness, two ranks over the
#      bundled UCX) must pass; the GPU-less check then runs on this machine
#      from the tarball;
#   4. where this machine has CUDA's cuBLASLt and NCCL, they are put into the
#      root as PyTorch's CUDA wheels lay them out (nvidia/cu13/lib and
#      nvidia/nccl/lib in python3's site directory) and the check runs there
#      again: the wrappers must find them, so the plugin test runs whole and
#      `ctr` gets as far as the driver;
#   5. the sizes: the tarball and report together under 64 MiB, at most 8 files.
#
#   tools/gpu/prove_rootfs.sh [ROOT]      default ROOT: trixie-root beside the repository
#
# Not part of the test suites: it needs root (debootstrap, chroot, a /proc
# mount), the network for Debian's archive (MIRROR, default
# http://deb.debian.org/debian) the first time, and minutes.
set -eu
cd "$(dirname "$0")/../.."
repo=$PWD
ROOT=${1:-$(dirname "$repo")/trixie-root}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
[ "$(id -u)" = 0 ] || { echo "prove_rootfs: needs root (debootstrap, chroot)" >&2; exit 2; }

fail() { echo "prove_rootfs: FAILED: $*" >&2; exit 1; }

# ---------------------------------------------------------------------------
# 1. The root

if [ ! -x "$ROOT/usr/bin/python3" ] || ! grep -q trixie "$ROOT/etc/os-release" 2>/dev/null; then
  command -v debootstrap >/dev/null || fail "debootstrap not found (apt-get install debootstrap)"
  echo "== debootstrap trixie into $ROOT"
  debootstrap --variant=minbase --include=python3,xz-utils trixie "$ROOT" "$MIRROR" > "$ROOT.debootstrap.log" 2>&1 ||
    fail "debootstrap (see $ROOT.debootstrap.log)"
fi
root_glibc=$(chroot "$ROOT" getconf GNU_LIBC_VERSION | cut -d' ' -f2)
host_glibc=$(getconf GNU_LIBC_VERSION | cut -d' ' -f2)
echo "== root: $(. "$ROOT/etc/os-release" && echo "$PRETTY_NAME"), glibc $root_glibc; this machine: glibc $host_glibc"

# ---------------------------------------------------------------------------
# 2. The bundle

work=$(mktemp -d)
mounted=""
wheel=""
cleanup() {
  [ -z "$mounted" ] || umount "$ROOT/proc" || true
  rm -rf "$work" "$ROOT/tmp/ctr-proof" ${wheel:+"$wheel"}
}
trap cleanup EXIT
echo "== tools/gpu/bundle.sh"
tools/gpu/bundle.sh "$work/gpu-bundle.tar.xz"

# ---------------------------------------------------------------------------
# 3. The check inside the root, then on this machine

mkdir -p "$ROOT/tmp/ctr-proof"
cp "$work/gpu-bundle.tar.xz" "$ROOT/tmp/ctr-proof/"
mount -t proc proc "$ROOT/proc" && mounted=1
in_root() {
  chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 TMPDIR=/tmp \
    /bin/sh -c "cd /tmp/ctr-proof && $1"
}
echo "== in the root: tar xJf gpu-bundle.tar.xz; ctr-gpu/ctr version; ldd of bin/ctr"
in_root 'tar xJf gpu-bundle.tar.xz && ctr-gpu/ctr version' > "$work/version.txt" 2>&1 ||
  { cat "$work/version.txt"; fail "ctr version in the root"; }
cat "$work/version.txt"
in_root 'LD_LIBRARY_PATH=ctr-gpu/lib ldd ctr-gpu/bin/ctr' | awk '{print "  " $1, $2, $3}'
if grep -qE "GLIBC_|GLIBCXX_|stack smashing|not found" "$work/version.txt"; then fail "ctr version: $(cat "$work/version.txt")"; fi
echo "== in the root: ctr-gpu/check.sh report"
rc=0
in_root 'ctr-gpu/check.sh report' || rc=$?
[ $rc -eq 0 ] || fail "check.sh in the root exited $rc"

echo "== in the root: CTR_CHECK_DEVICE=cpu ctr-gpu/check.sh report-cpu"
rc=0
in_root 'CTR_CHECK_DEVICE=cpu ctr-gpu/check.sh report-cpu' > "$work/cpu.txt" 2>&1 || rc=$?
grep -E '^\[ *[0-9]+ s\] [a-z_0-9]+ +(PASS|FAIL|TIMEOUT|SKIP)' "$work/cpu.txt" | sed 's/^/  /'
[ $rc -eq 0 ] || { cat "$work/cpu.txt"; fail "check.sh on the CPU backend in the root exited $rc"; }
for s in smoke gpu_suite gpt2_small ranks; do
  grep -qE "^$s +PASS " "$ROOT/tmp/ctr-proof/report-cpu/summary.txt" || fail "stage $s on the CPU backend did not pass"
done

echo "== on this machine: ctr-gpu/check.sh report"
mkdir -p "$work/host"
tar -C "$work/host" -xJf "$work/gpu-bundle.tar.xz"
(cd "$work/host" && env -u LD_LIBRARY_PATH ctr-gpu/check.sh report > console.txt 2>&1) ||
  { cat "$work/host/console.txt"; fail "check.sh on this machine"; }
tail -n 2 "$work/host/console.txt"

# ---------------------------------------------------------------------------
# 4. CUDA's libraries laid out as PyTorch's wheels, in the root

cuda_lib=${CUDA_HOME:-/usr/local/cuda}/lib64
if [ -e "$cuda_lib/libcublasLt.so.13" ]; then
  site=$(chroot "$ROOT" python3 -c 'import site; print(site.getsitepackages()[0])')
  wheel=$ROOT$site/nvidia
  mkdir -p "$wheel/cu13/lib" "$wheel/nccl/lib"
  # A hard link where the root shares the file system, else a copy.
  put() { ln -f "$1" "$2" 2>/dev/null || cp "$1" "$2"; }
  put "$(readlink -f "$cuda_lib/libcublasLt.so.13")" "$wheel/cu13/lib/libcublasLt.so.13"
  [ -e "$cuda_lib/libnccl.so.2" ] && put "$(readlink -f "$cuda_lib/libnccl.so.2")" "$wheel/nccl/lib/libnccl.so.2"
  echo "== in the root, cuBLASLt in $site/nvidia/cu13/lib, NCCL in $site/nvidia/nccl/lib: ctr-gpu/check.sh report-wheel"
  rc=0
  in_root 'ctr-gpu/check.sh report-wheel' > "$work/wheel.txt" 2>&1 || rc=$?
  tail -n 2 "$work/wheel.txt"
  [ $rc -eq 0 ] || { cat "$work/wheel.txt"; fail "check.sh in the root with the wheels exited $rc"; }
  w=$ROOT/tmp/ctr-proof/report-wheel/summary.txt
  grep -qE "^  libcublasLt.so.13: $site/nvidia/cu13/lib \(python wheel\)" "$w" || fail "the wrappers did not find cuBLASLt in the wheel"
  grep -qE "^plugin +PASS +[0-9]+ +\[ PASSED \] 7 tests" "$w" || fail "the plugin test did not run whole with the wheel's cuBLASLt"
  grep -qE "^smoke +SKIP +[0-9]+ +no usable GPU: .*libcuda.so.1 cannot be loaded" "$w" || fail "ctr did not reach the driver"
  sed -n 's/^  \(lib[a-zA-Z]*\.so\.[0-9]*: .*\)/  \1/p; /^plugin /p; /^smoke /p' "$w"
fi

# ---------------------------------------------------------------------------
# 5. The reports

verify() {  # verify REPORT_DIR GLIBC WHERE
  files=$(ls -A "$1" | tr '\n' ' ')
  [ "$files" = "console.log logs.tar.xz summary.txt " ] || fail "$3: report files: $files"
  grep -q "^  glibc: $2\$" "$1/summary.txt" || fail "$3: the probe did not find glibc $2"
  grep -qE '^probe +PASS' "$1/summary.txt" || fail "$3: probe did not pass"
  for s in smoke gpu_suite rerun memcheck gpt2_small kernels ranks bench; do
    grep -qE "^$s +SKIP +[0-9]+ +no usable GPU: ." "$1/summary.txt" || fail "$3: stage $s is not skipped for want of a GPU"
  done
  if grep -qE "GLIBC_[0-9.]+' not found|GLIBCXX_[0-9.]+' not found|stack smashing" "$1/console.log"; then
    fail "$3: a program did not start"
  fi
  mkdir -p "$work/logs.$3" && tar -C "$work/logs.$3" -xJf "$1/logs.tar.xz"
  if grep -rqE "GLIBC_[0-9.]+' not found|GLIBCXX_[0-9.]+' not found|stack smashing" "$work/logs.$3"; then
    fail "$3: a program did not start (see its logs)"
  fi
}
verify "$ROOT/tmp/ctr-proof/report" "$root_glibc" root
verify "$work/host/report" "$host_glibc" host

echo "== summary.txt from the root"
cat "$ROOT/tmp/ctr-proof/report/summary.txt"
echo "== sizes"
bundle_bytes=$(stat -c %s "$work/gpu-bundle.tar.xz")
report_bytes=0
for f in "$ROOT/tmp/ctr-proof/report"/*; do
  printf '  report/%-12s %9d bytes\n' "$(basename "$f")" "$(stat -c %s "$f")"
  report_bytes=$((report_bytes + $(stat -c %s "$f")))
done
printf '  %-19s %9d bytes (unpacked %s)\n' gpu-bundle.tar.xz "$bundle_bytes" \
  "$(du -sh "$ROOT/tmp/ctr-proof/ctr-gpu" | cut -f1)"
total=$((bundle_bytes + report_bytes))
printf '  bundle + report     %9d bytes (limit 67108864), %d files (limit 8)\n' "$total" 4
[ "$total" -lt 67108864 ] || fail "bundle and report exceed 64 MiB"
echo "prove_rootfs: ok: the bundle runs on glibc $root_glibc (root) and $host_glibc (this machine), every GPU stage skipped"
