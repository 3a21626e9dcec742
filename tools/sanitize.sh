#!/bin/sh
# The sanitizer and fuzzing job of CI. One clang build of libctr under
# AddressSanitizer and UndefinedBehaviorSanitizer, with libFuzzer's coverage
# instrumentation (tools/setup.sh --sanitize), serves two parts:
#
#   tests  the unit, integration and bindings suites; any sanitizer report
#          fails its test;
#   fuzz   every libFuzzer target of tests/fuzz for FUZZ_SECONDS from its seed
#          corpus (tests/fuzz/corpus/<target>, copied to a temporary directory,
#          so the run never writes into the source tree); any crash, leak,
#          timeout or sanitizer report fails it, and the input that did it is
#          kept under BUILD/fuzz-artifacts/<target>/. The inputs that once
#          failed, tests/fuzz/crashes/<target>/, are each run once first.
#
#   tools/sanitize.sh [tests] [fuzz]      (default: both)
#
# Every part runs even after another failed; the exit status is 0 only if all
# passed. Environment: SAN_BUILD_DIR (default build-san); FUZZ_SECONDS (per
# target, default 45); FUZZ_TARGETS (default: graph files checkpoint store
# options); FUZZ_JOBS (targets run at once, default: the number of CPUs).
set -eu

cd "$(dirname "$0")/.."
SRC=$(pwd)
BUILD=${SAN_BUILD_DIR:-build-san}
FUZZ_SECONDS=${FUZZ_SECONDS:-45}
FUZZ_TARGETS=${FUZZ_TARGETS:-graph files checkpoint store options}
FUZZ_JOBS=${FUZZ_JOBS:-$(nproc)}
parts=${*:-tests fuzz}

now() { date +%s; }
t0=$(now)
BUILD_DIR=$BUILD tools/setup.sh --sanitize
echo "sanitize: build ready in $(($(now) - t0)) s"

RUNTIME=$(clang -print-file-name=libclang_rt.asan-x86_64.so)
# Any report ends the process with an error: AddressSanitizer stops at the first
# one, and UndefinedBehaviorSanitizer, whose checks otherwise print and go on,
# is told to as well. tests/sanitize/{ubsan,lsan}.supp list known findings whose
# fix is pending.
ASAN_BASE="halt_on_error=1:check_initialization_order=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$SRC/tests/sanitize/ubsan.supp"
export LSAN_OPTIONS="suppressions=$SRC/tests/sanitize/lsan.supp:print_suppressions=0"
failed=""

# ------------------------------------------------------------------------------------------
# Test suites

# run_suites NAME ASAN_OPTIONS PRELOAD MESON_TEST_ARGS...
run_suites() {
  name=$1
  asan=$2
  preload=$3
  shift 3
  t=$(now)
  status=0
  env ASAN_OPTIONS="$asan" ${preload:+LD_PRELOAD=$preload} \
    meson test -C "$BUILD" --no-rebuild --print-errorlogs --timeout-multiplier 2 \
    --logbase "sanitize-$name" "$@" || status=$?
  echo "sanitize: suites $name: $([ $status -eq 0 ] && echo passed || echo FAILED) in $(($(now) - t)) s"
  [ $status -eq 0 ] || failed="$failed $name"
}

case " $parts " in
  *" tests "*)
    # The C and C++ test programs link the runtime first; leaks fail them.
    # The 'hosted' integration tests (faults, rendezvous) start many ranks as
    # Python processes; they run in the regular suites only.
    run_suites unit-integration "$ASAN_BASE:abort_on_error=1:detect_leaks=1" "" \
      --suite unit --suite integration --no-suite hosted
    # Python, Go and Rust programs load the sanitized libctr.so into a process
    # that was not built with the runtime, so it is preloaded (the binding
    # drivers keep it away from cargo, go and cc: rustc does not start under
    # it, the others only slow down). Leak checking is off here: CPython leaves
    # hundreds of its own allocations unreachable at exit, which would fail
    # every Python test. libctr's own leaks are checked by the suites above
    # and by the fuzzers.
    run_suites bindings "$ASAN_BASE:abort_on_error=1:detect_leaks=0" "$RUNTIME" \
      --suite bindings
    ;;
esac

# ------------------------------------------------------------------------------------------
# Fuzzers

# Runs one target; prints one line, and the report on failure.
fuzz_one() {
  target=$1
  exe=$BUILD/tests/fuzz/fuzz_$target
  work=$(mktemp -d)
  log=$BUILD/fuzz-logs/$target.log
  artifacts=$BUILD/fuzz-artifacts/$target/
  rm -rf "$artifacts"
  mkdir -p "$artifacts" "$BUILD/fuzz-logs"
  cp -R "tests/fuzz/corpus/$target" "$work/corpus"
  seeds=$(ls "$work/corpus" | wc -l)
  dict=""
  [ -f "tests/fuzz/$target.dict" ] && dict="-dict=tests/fuzz/$target.dict"
  status=0
  : >"$log"
  # Inputs that once failed are run once each first; they are not mutated (a
  # finding whose fix is pending and suppressed would lead straight to its
  # next symptom).
  if [ -d "tests/fuzz/crashes/$target" ]; then
    TMPDIR=$work LD_PRELOAD=$RUNTIME ASAN_OPTIONS="$ASAN_BASE:detect_leaks=1" \
      "$exe" -timeout=10 -rss_limit_mb=4096 -malloc_limit_mb=4096 -close_fd_mask=2 \
      -artifact_prefix="$artifacts" "tests/fuzz/crashes/$target"/* >>"$log" 2>&1 || status=$?
  fi
  # libFuzzer's C++ library is linked ahead of the runtime, which must come
  # first: preloaded. stderr of the target is closed (-close_fd_mask=2; the
  # rendezvous server logs every refusal there); libFuzzer and the sanitizers
  # still report to the log. The scratch files of the targets go to $work.
  # shellcheck disable=SC2086
  [ $status -ne 0 ] || TMPDIR=$work LD_PRELOAD=$RUNTIME ASAN_OPTIONS="$ASAN_BASE:detect_leaks=1" \
    "$exe" -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=4096 -malloc_limit_mb=4096 \
    -close_fd_mask=2 -print_final_stats=1 -artifact_prefix="$artifacts" $dict "$work/corpus" \
    >>"$log" 2>&1 || status=$?
  done_line=$(sed -n 's/^Done \([0-9]*\) runs in \([0-9]*\) second.*/\1 runs in \2 s/p' "$log")
  inputs=$(ls "$work/corpus" | wc -l)
  rm -rf "$work"
  if [ $status -eq 0 ]; then
    echo "sanitize: fuzz_$target: ${done_line:-? runs}, corpus $seeds -> $inputs inputs, no finding"
    return 0
  fi
  echo "sanitize: fuzz_$target: FAILED (exit $status); the report ($log):"
  grep -E "ERROR|SUMMARY|runtime error|^fuzz:|#[0-9]+ 0x|Test unit written|timeout|out-of-memory" "$log" | head -60
  echo "sanitize: fuzz_$target: reproduce with: LD_PRELOAD=$RUNTIME $exe $artifacts<file>"
  return 1
}

case " $parts " in
  *" fuzz "*)
    t=$(now)
    running=""
    count=0
    for target in $FUZZ_TARGETS; do
      fuzz_one "$target" &
      running="$running $!:$target"
      count=$((count + 1))
      if [ $count -ge "$FUZZ_JOBS" ]; then
        for job in $running; do wait "${job%%:*}" || failed="$failed fuzz_${job#*:}"; done
        running=""
        count=0
      fi
    done
    for job in $running; do wait "${job%%:*}" || failed="$failed fuzz_${job#*:}"; done
    echo "sanitize: fuzzers done in $(($(now) - t)) s"
    ;;
esac

echo "sanitize: total $(($(now) - t0)) s"
if [ -n "$failed" ]; then
  echo "sanitize: FAILED:$failed"
  exit 1
fi
echo "sanitize: all passed"
