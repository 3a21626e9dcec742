#!/bin/bash
# The GPU check: every GPU test and measurement of libctr in one command, sized
# to finish inside one time budget, leaving three files.
#
#   ctr-gpu/check.sh [REPORT_DIR] [--budget SECONDS]      from an unpacked bundle
#   tools/gpu/check.sh [REPORT_DIR] --from-build BUILD     from a build tree
#
# REPORT_DIR (default: report) ends up holding exactly summary.txt (results,
# environment, per-kernel times, benchmark table), logs.tar.xz (every stage's
# log, the GPU suite's JSON, ncu's CSV, the benchmark's JSON) and console.log
# (what this script printed); it must be empty or hold only those.
#
# Stages, in order, each under its own time limit (coreutils timeout), each
# started only while the budget (default 540 s) still allows its least useful
# time, and recorded as PASS, FAIL, TIMEOUT or SKIP with the reason:
#   probe        OS, glibc, CPU, GPU and driver, where cuBLASLt, cuDNN and NCCL
#                were found, Python and PyTorch, `ctr version`, and whether
#                `ctr` can use the GPU (a one-step run of a tiny model)
#   plugin       the backend plugin loader (test_plugin)
#   smoke        a small model on device cuda with and without CUDA graphs; the
#                two loss curves must be identical
#   gpu_suite    test_gpu (GoogleTest JSON in the logs), with how many of its
#                attention shapes ran on cuDNN's fused SDPA, or why not
#   rerun        the suite's failing tests again with CUDA_LAUNCH_BLOCKING=1
#   memcheck     the same under `compute-sanitizer --tool memcheck`
#   gpt2_small   GPT-2 small at real size (12 x 768, T 1024, batch 8), 10 steps,
#                and its attention path (the backend's "ctr: cudnn:" line)
#   kernels      one step of it under `ncu --clock-control none`, kernel
#                durations only: calls, total and share per kernel
#   ranks        two ranks on one GPU against one rank (test_gpu_ranks.py)
#   bench        libctr against PyTorch eager and torch.compile (bench_gpu.py)
# Without a usable GPU (no libcuda.so.1, nvidia-smi failing, or `ctr` saying
# it has none) every stage after plugin is skipped, saying why. The exit
# status is 0 when nothing failed or timed out.
#
# From a bundle the programs are the bundle's wrappers (env.sh); with
# --from-build the build's own programs, given the CUDA libraries' directories
# the same way. CTR_CHECK_DEVICE=cpu runs every stage against the CPU backend
# instead (as CTR_TEST_DEVICE=cpu does for the GPU suite), with small models in
# place of GPT-2 small: a check of the check itself on a machine without a GPU.
set -u

self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
here=$(dirname "$self")

# ---------------------------------------------------------------------------
# Stages (run as `check.sh --stage NAME` under timeout, in a process group
# that timeout ends whole)

# Models: the smoke test's, and GPT-2 small (tiny ones when checking the check).
SMOKE=(--preset gpt --layers 4 --dim 256 --heads 4 --vocab 4096 --seq 256) SMOKE_BATCH=8
GPT2=(--preset gpt --layers 12 --dim 768 --heads 12 --vocab 50304 --seq 1024) GPT2_BATCH=8
if [ "${CTR_CHECK_DEVICE:-cuda}" != cuda ]; then
  SMOKE=(--preset gpt --layers 2 --dim 64 --heads 2 --vocab 256 --seq 32) SMOKE_BATCH=2
  GPT2=(--preset gpt --layers 2 --dim 128 --heads 4 --vocab 512 --seq 128) GPT2_BATCH=2
fi

note() { printf '%s\n' "$*" > "$CTR_CHECK_WORK/note.$STAGE"; }
log_tail() { tail -n "${2:-3}" "$1" 2>/dev/null | tr -s ' \t' ' ' | cut -c1-300; }
# The last line of output that says why a device cannot be used, if any.
no_gpu_line() {
  grep -hE "no usable GPU|cannot serve device|needs the backend plugin|cannot be loaded" "$@" 2>/dev/null |
    tail -n 1 | sed "s/^ctr: error: //; s/^unsupported: //; s/^backend plugin libctr-cuda.so cannot serve device 'cuda': //;
      s/ (the CUDA backend needs an NVIDIA GPU.*)\$//" |
    sed -E 's/([(;] ?)([^;()]+)(; \2)+([;)])/\1\2\4/g' | cut -c1-400   # the same reason once
}
py() { command -v python3 >/dev/null 2>&1; }

stage_probe() {
  . "$ENVSH"
  local out=$LOGS/probe.txt gpu_reason="" smi=""
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(uname -srm)"
    echo "os: $( (. /etc/os-release && echo "$PRETTY_NAME") 2>/dev/null || echo unknown)"
    echo "glibc: $(getconf GNU_LIBC_VERSION 2>/dev/null | cut -d' ' -f2 || true)"
    echo "ldd: $(ldd --version 2>&1 | head -n 1)"
    echo "cpu: $(nproc) x $(sed -n 's/^model name[^:]*: //p' /proc/cpuinfo | head -n 1)"
    echo "memory: $(awk '/^MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"
    echo "programs: $CTR_CHECK_SOURCE"
  } > "$out"
  if command -v nvidia-smi >/dev/null 2>&1; then
    if smi=$(timeout 30 nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap,clocks.max.sm \
      --format=csv,noheader 2>&1) && [ -n "$smi" ]; then
      printf 'gpu: %s\n' "$smi" | sed '2,$s/^/gpu: /' >> "$out"
      echo "cuda (driver): $(timeout 30 nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -n 1)" \
        >> "$out"
    else
      gpu_reason="nvidia-smi fails: $(printf '%s' "$smi" | tail -n 1 | cut -c1-200)"
      echo "gpu: none ($gpu_reason)" >> "$out"
    fi
  else
    gpu_reason="nvidia-smi not found"
    echo "gpu: none (nvidia-smi not found)" >> "$out"
  fi
  local cuda
  cuda=$( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null | awk '$1 == "libcuda.so.1" {print $NF; exit}')
  if [ -z "$cuda" ]; then
    for d in $(printf '%s' "${LD_LIBRARY_PATH:-}" | tr ':' ' '); do
      [ -e "$d/libcuda.so.1" ] && cuda=$d/libcuda.so.1 && break
    done
  fi
  echo "libcuda.so.1: ${cuda:-not found}" >> "$out"
  [ -n "$cuda" ] || gpu_reason="${gpu_reason:+$gpu_reason; }libcuda.so.1 not found"
  for f in libcublasLt.so.13 libcudnn.so.9 libnccl.so.2; do
    local found
    found=$(ctr_gpu_find "$f")
    printf '%s: %s\n' "$f" "$(printf '%s' "${found:-not found}" | awk -F'\t' 'NF > 1 {printf "%s (%s)", $1, $2; next} {print}')" \
      >> "$out"
  done
  for t in compute-sanitizer ncu; do
    echo "$t: $(command -v "$t" || echo not found)" >> "$out"
  done
  if py; then
    echo "python: $(python3 --version 2>&1)" >> "$out"
    echo "torch: $(timeout 90 python3 -c 'import torch
print(torch.__version__, "cuda", torch.version.cuda, "available" if torch.cuda.is_available() else "not available")' \
      2>&1 | tail -n 1 | cut -c1-200)" >> "$out"
  else
    echo "python: python3 not found" >> "$out"
  fi
  if [ -n "$BUNDLE_INFO" ] && [ -f "$BUNDLE_INFO" ]; then
    echo "bundle: $(sed -n 's/^commit: //p' "$BUNDLE_INFO"), $(sed -n 's/^built on: //p' "$BUNDLE_INFO")" >> "$out"
  fi

  # ctr itself: the version, then one step of a tiny model on device cuda.
  # Checking the check on another device: only ctr's answer counts.
  [ "$DEVICE" = cuda ] || gpu_reason=""
  local rc=0
  timeout 30 "$CTR" version > "$LOGS/ctr_version.log" 2>&1 || rc=$?
  echo "ctr version: $(head -n 1 "$LOGS/ctr_version.log") (exit $rc)" >> "$out"
  if [ $rc -ne 0 ]; then
    gpu_reason="${gpu_reason:+$gpu_reason; }ctr does not start"
    printf '%s' "$gpu_reason" > "$CTR_CHECK_WORK/gpu_reason"
    note "ctr version fails (exit $rc): $(log_tail "$LOGS/ctr_version.log" 2)"
    return 1
  fi
  local tiny=$CTR_CHECK_WORK/scratch/tiny.ctrg
  timeout 60 "$CTR" graph build --preset gpt --layers 2 --dim 128 --heads 4 --vocab 512 --seq 64 -o "$tiny" \
    > "$LOGS/gpu_probe.log" 2>&1 &&
    timeout 120 "$CTR" run "$tiny" --device "$DEVICE" --steps 1 --batch 2 --log-every 0 >> "$LOGS/gpu_probe.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    gpu_reason=""
    echo "ctr on $DEVICE: usable" >> "$out"
  else
    local why
    why=$(no_gpu_line "$LOGS/gpu_probe.log")
    echo "ctr on $DEVICE: exit $rc: ${why:-$(log_tail "$LOGS/gpu_probe.log" 1)}" >> "$out"
    if [ -n "$why" ]; then
      gpu_reason="${gpu_reason:+$gpu_reason; }ctr: $why"
    elif [ -z "$gpu_reason" ]; then
      echo "ctr on $DEVICE: the device is there; the GPU stages run and show the failure" >> "$out"
    fi
  fi
  printf '%s' "$gpu_reason" > "$CTR_CHECK_WORK/gpu_reason"
  note "$(sed -n 's/^glibc: /glibc /p' "$out"); $(head -n 1 "$LOGS/ctr_version.log"); $(sed -n 's/^gpu: /GPU /p' "$out" |
    head -n 1)"
}

stage_plugin() {
  . "$ENVSH"
  local filter=()
  # Without cuBLASLt libctr-cuda.so cannot load, and the plugin's own two
  # checks would fail for that alone.
  if [ -z "$(ctr_gpu_find libcublasLt.so.13)" ]; then
    filter=(--gtest_filter=-Plugin.CudaWithoutGpuSaysWhy:Plugin.NcclWithoutGpuSaysWhy)
  fi
  "$TEST_PLUGIN" "${filter[@]}" > "$LOGS/plugin.log" 2>&1
  local rc=$?
  local left_out=""
  [ ${#filter[@]} -eq 0 ] || left_out="(the two checks of libctr-cuda.so left out: cuBLASLt not found)"
  note "$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$LOGS/plugin.log" | tr -s ' ' | tr '\n' ' ')$left_out"
  return $rc
}

stage_smoke() {
  local g=$CTR_CHECK_WORK/scratch/smoke.ctrg rc=0
  "$CTR" graph build "${SMOKE[@]}" -o "$g" > "$LOGS/smoke.log" 2>&1 || return 1
  for mode in graphs no_graphs; do
    local flag=""
    [ $mode = no_graphs ] && flag=--no-graphs
    echo "== ctr run --device $DEVICE $flag" >> "$LOGS/smoke.log"
    "$CTR" run "$g" --device "$DEVICE" --steps 30 --batch "$SMOKE_BATCH" --log-every 10 $flag \
      --metrics "$LOGS/smoke_$mode.jsonl" >> "$LOGS/smoke.log" 2>&1 || rc=1
  done
  [ $rc -eq 0 ] || { note "$(log_tail "$LOGS/smoke.log" 1)"; return 1; }
  local a b
  a=$(grep -o '"loss": *[-0-9.eE+naif]*' "$LOGS/smoke_graphs.jsonl")
  b=$(grep -o '"loss": *[-0-9.eE+naif]*' "$LOGS/smoke_no_graphs.jsonl")
  local first last
  first=$(printf '%s\n' "$a" | head -n 1 | sed 's/.*: *//' | xargs printf '%.4f')
  last=$(printf '%s\n' "$a" | tail -n 1 | sed 's/.*: *//' | xargs printf '%.4f')
  if [ -z "$a" ]; then
    note "no losses in the metrics files"
    return 1
  fi
  if [ "$a" != "$b" ]; then
    note "loss curves differ between CUDA graphs and launches (graphs: $first..$last; launches: $(printf '%s\n' "$b" | tail -n 1 | sed 's/.*: *//'))"
    return 1
  fi
  note "30 steps, loss $first -> $last, identical with and without CUDA graphs"
}

stage_gpu_suite() {
  "$TEST_GPU" --gtest_output="json:$LOGS/gpu_suite.json" > "$LOGS/gpu_suite.log" 2>&1
  local rc=$?
  if [ $rc -eq 77 ]; then
    note "skipped by the suite: $(log_tail "$LOGS/gpu_suite.log" 1)"
    return 77
  fi
  failing_tests "$LOGS/gpu_suite.log" > "$CTR_CHECK_WORK/failing"
  local failed
  failed=$(wc -l < "$CTR_CHECK_WORK/failing")
  note "$(grep -c '^\[       OK \]' "$LOGS/gpu_suite.log") passed, $failed failed$([ "$failed" -gt 0 ] &&
    printf ': %s' "$(head -n 5 "$CTR_CHECK_WORK/failing" | tr '\n' ' ')"); $(suite_attention_paths "$LOGS/gpu_suite.log")"
  return $rc
}

# Which attention path the suite's cuDNN cases took (GpuCudnnAttention prints
# "[ attention path ] SHAPE: FORWARD LINE | BACKWARD LINE" per shape): how many
# ran each direction on cuDNN, and the first other line (why not).
suite_attention_paths() {
  local all fwd bwd other
  all=$(grep -c '^\[ attention path \]' "$1")
  fwd=$(grep -c '^\[ attention path \].*attention forward runs on cuDNN' "$1")
  bwd=$(grep -c '^\[ attention path \].*attention backward runs on cuDNN' "$1")
  other=$(grep '^\[ attention path \]' "$1" | grep -v 'forward runs on cuDNN.*backward runs on cuDNN' | head -n 1 |
    sed 's/^\[ attention path \] //' | cut -c1-240)
  printf 'attention on cuDNN in %s (forward) and %s (backward) of %s shapes%s' "$fwd" "$bwd" "$all" \
    "${other:+ (else: $other)}"
}

# The attention path a ctr run took: the CUDA backend's "ctr: cudnn:" lines.
run_attention_path() {
  local l
  l=$(grep -h '^ctr: cudnn: ' "$@" 2>/dev/null | head -n 2 | sed 's/^ctr: cudnn: //' | cut -c1-160 | paste -sd'|' -)
  printf 'attention: %s' "${l:-own kernels (no cuDNN line: a build without cuDNN)}"
}

# The tests a GoogleTest log names as failed, then the one it started and never
# finished (a crash, or a hang the stage's timeout ended), one per line.
failing_tests() {
  sed -n 's/^\[  FAILED  \] \([^ ,]*\.[^ ,]*\).*/\1/p' "$1" | awk '!seen[$0]++'
  local last
  last=$(sed -n 's/^\[ RUN      \] //p' "$1" | tail -n 1)
  if [ -n "$last" ] && ! grep -F "] $last" "$1" | grep -qv '^\[ RUN '; then
    printf '%s\n' "$last"
  fi
}

# The failing tests of the suite as one --gtest_filter (at most $1).
failing_filter() { head -n "$1" "$CTR_CHECK_WORK/failing" | paste -sd: -; }

stage_rerun() {
  local f
  f=$(failing_filter 8)
  CUDA_LAUNCH_BLOCKING=1 "$TEST_GPU" --gtest_filter="$f" > "$LOGS/rerun_blocking.log" 2>&1
  local rc=$?
  note "with CUDA_LAUNCH_BLOCKING=1, $(failing_tests "$LOGS/rerun_blocking.log" | wc -l) of $(printf '%s\n' "$f" |
    awk -F: '{print NF}') fail again"
  return $rc
}

stage_memcheck() {
  local f
  f=$(failing_filter 3)
  compute-sanitizer --tool memcheck --target-processes all --error-exitcode 86 --print-limit 50 \
    "$TEST_GPU" --gtest_filter="$f" > "$LOGS/memcheck.log" 2>&1
  local rc=$?
  note "$f: $(grep -E '^========= (ERROR SUMMARY|LEAK SUMMARY)' "$LOGS/memcheck.log" | sed 's/^========= //' | tr '\n' ' ')$([ $rc -eq 86 ] && echo '(memory errors)')"
  return $rc
}


gpt2_graph() {
  local g=$CTR_CHECK_WORK/scratch/gpt2_small.ctrg
  [ -f "$g" ] || "$CTR" graph build "${GPT2[@]}" -o "$g" >> "$1" 2>&1 || return 1
  printf '%s\n' "$g"
}

stage_gpt2_small() {
  local log=$LOGS/gpt2_small.log g
  g=$(gpt2_graph "$log") || { note "graph build failed: $(log_tail "$log" 1)"; return 1; }
  "$CTR" run "$g" --device "$DEVICE" --steps 10 --batch "$GPT2_BATCH" --log-every 1 --metrics "$LOGS/gpt2_small.jsonl" \
    >> "$log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then note "$(log_tail "$log" 1)"; return $rc; fi
  if py; then
    local steps
    steps=$(python3 - "$LOGS/gpt2_small.jsonl" "$GPT2_BATCH" "${GPT2[11]}" <<'EOF'
import json, math, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
rows = [r for r in rows if "loss" in r]
tps = [r["tokens_per_s"] for r in rows[3:] if "tokens_per_s" in r]
finite = all(math.isfinite(r["loss"]) for r in rows)
print(f"batch {sys.argv[2]} x {sys.argv[3]}, {len(rows)} steps, loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}"
      + (f", median {statistics.median(tps):.0f} tokens/s after 3 steps" if tps else "")
      + ("" if finite else ", NON-FINITE LOSS"))
EOF
)
    note "$steps; $(run_attention_path "$log")"
    case $steps in *NON-FINITE*) return 1 ;; esac
  else
    note "$(run_attention_path "$log")"
  fi
  return 0
}

stage_kernels() {
  local log=$LOGS/kernels.log g
  g=$(gpt2_graph "$log") || { note "graph build failed: $(log_tail "$log" 1)"; return 1; }
  # Two steps without graphs (each kernel its own launch); the table counts
  # the kernels after the first step's AdamW launch up to the second step's:
  # one whole step.
  ncu --clock-control none --target-processes all --metrics gpu__time_duration.sum --csv --print-units base \
    --print-kernel-base function --log-file "$LOGS/kernels_ncu.csv" \
    "$CTR" run "$g" --device "$DEVICE" --steps 2 --batch "$GPT2_BATCH" --log-every 1 --no-graphs >> "$log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    note "ncu or the run failed (exit $rc): $(grep -hE 'ERR_|==ERROR==' "$LOGS/kernels_ncu.csv" "$log" 2>/dev/null | head -n 1 | cut -c1-200)"
    return $rc
  fi
  py || { note "python3 not found: no table (the CSV is in the logs)"; return 0; }
  python3 - "$LOGS/kernels_ncu.csv" "$GPT2_BATCH" "${GPT2[11]}" > "$LOGS/kernels.txt" <<'EOF'
import csv, sys
rows = [l for l in open(sys.argv[1], errors="replace") if l.startswith('"')]
SCALE = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
kernels, unit = [], "nsecond"
for r in csv.DictReader(rows):
    if "Metric Name" in r:  # the details page: a row per kernel and metric
        if r["Metric Name"] == "gpu__time_duration.sum":
            kernels.append((r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * SCALE.get(r["Metric Unit"], 1e-3)))
    elif "gpu__time_duration.sum" in r:  # the raw page: a row per kernel, its first row the units
        if not r.get("Kernel Name"):
            unit = r["gpu__time_duration.sum"]
            continue
        kernels.append((r["Kernel Name"], float(r["gpu__time_duration.sum"].replace(",", "")) * SCALE.get(unit, 1e-3)))
# Two steps ran: the second step's share of AdamW launches closes it, the
# first step's closes the one before.
adam = [i for i, (name, _) in enumerate(kernels) if "adamw" in name.lower()]
if adam and len(adam) % 2 == 0:
    k = len(adam) // 2
    step, what = kernels[adam[k - 1] + 1:adam[-1] + 1], "one step (the launches after the first step's AdamW up to the second's)"
else:
    step, what = kernels, "the whole run (no two AdamW launches to cut one step out)"
table = {}
for name, us in step:
    calls, total = table.get(name, (0, 0.0))
    table[name] = (calls + 1, total + us)
total = sum(t for _, t in table.values()) or 1.0
print(f"GPT-2 small, batch {sys.argv[2]} x {sys.argv[3]}, no CUDA graphs: {what}; {len(step)} launches, {total:.0f} us of kernel time")
print(f"{'kernel':<56} {'calls':>6} {'total us':>11} {'share':>7}")
for name, (calls, t) in sorted(table.items(), key=lambda kv: -kv[1][1]):
    print(f"{name[:56]:<56} {calls:>6} {t:>11.1f} {100 * t / total:>6.1f}%")
EOF
  note "$(head -n 1 "$LOGS/kernels.txt")"
}

stage_ranks() {
  python3 "$RANKS_PY" "$CTR" "$EQUIV" > "$LOGS/ranks.log" 2>&1
  local rc=$?
  note "$(log_tail "$LOGS/ranks.log" 2 | tr '\n' ' ')"
  return $rc
}

stage_bench() {
  # Its own limit: a little under the stage's, so it ends with a table.
  local limit=$(( ${CTR_CHECK_LIMIT:-240} - 15 ))
  python3 "$BENCH_PY" --ctr "$CTR" --model gpt2_small --steps 10 --warmup 3 --out "$LOGS" \
    --time-limit "$limit" > "$LOGS/bench.log" 2>&1
  local rc=$?
  note "$(grep -E '^(ctr|torch_eager|torch_compile) ' "$LOGS/bench.log" | tr -s ' ' | tr '\n' ';')"
  # A peer that fails is reported in the table; libctr failing fails the stage.
  grep -qE '^ctr +error:' "$LOGS/bench.log" && return 1
  return $rc
}

if [ "${1:-}" = --stage ]; then
  STAGE=$2
  "stage_$2"
  exit $?
fi

# ---------------------------------------------------------------------------
# Arguments, report folder, console log

report=report budget=540 from_build=""
while [ $# -gt 0 ]; do
  case $1 in
    --budget) budget=${2:?--budget needs seconds}; shift 2 ;;
    --from-build) from_build=${2:?--from-build needs a build directory}; shift 2 ;;
    -h | --help) sed -n '2,/^set -u/p' "$self" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "check.sh: unknown option $1" >&2; exit 2 ;;
    *) report=$1; shift ;;
  esac
done
case $budget in '' | *[!0-9]*) echo "check.sh: --budget wants whole seconds" >&2; exit 2 ;; esac
mkdir -p "$report" && report=$(cd "$report" && pwd) || exit 2
REPORT_FILES="summary.txt logs.tar.xz console.log"

if [ -z "${CTR_CHECK_START:-}" ]; then
  for f in "$report"/* "$report"/.[!.]*; do
    [ -e "$f" ] || continue
    case " $REPORT_FILES " in
      *" $(basename "$f") "*) rm -f "$f" ;;
      *) echo "check.sh: $report holds $(basename "$f"); the report folder must be empty or hold only a report" >&2
         exit 2 ;;
    esac
  done
  CTR_CHECK_START=$(date +%s)
  export CTR_CHECK_START
  "$self" "$report" --budget "$budget" ${from_build:+--from-build "$from_build"} 2>&1 | tee "$report/console.log"
  exit "${PIPESTATUS[0]}"
fi

# ---------------------------------------------------------------------------
# Programs

work=$(mktemp -d "${TMPDIR:-/tmp}/ctr-check.XXXXXX") || exit 2
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/logs" "$work/scratch" "$work/bin" "$work/tmp"
export CTR_CHECK_WORK=$work LOGS=$work/logs
if [ -n "$from_build" ]; then
  build=$(cd "$from_build" && pwd) || exit 2
  src=$(cd "$here/../.." && pwd)
  ENVSH=$here/env.sh
  # Wrappers as the bundle's, over the build's programs.
  wrap() {
    printf '#!/bin/sh\n. "%s"\nctr_gpu_env ""\n%bexec "%s" "$@"\n' "$ENVSH" "$3" "$2" > "$work/bin/$1"
    chmod +x "$work/bin/$1"
  }
  wrap ctr "$build/tools/ctr" ""
  wrap test_gpu "$build/tests/test_gpu" ""
  wrap test_plugin "$build/tests/test_plugin" "CTR_PLUGIN_PATH=\"$build/tests\"; export CTR_PLUGIN_PATH\n"
  wrap equiv_train "$build/tests/equiv_train" ""
  bin=$work/bin
  RANKS_PY=$src/tests/gpu/test_gpu_ranks.py BENCH_PY=$src/tools/bench/bench_gpu.py BUNDLE_INFO=""
  CTR_CHECK_SOURCE="build tree $build"
else
  ENVSH=$here/env.sh bin=$here
  RANKS_PY=$here/test_gpu_ranks.py BENCH_PY=$here/py/bench/bench_gpu.py BUNDLE_INFO=$here/BUNDLE.txt
  CTR_CHECK_SOURCE="bundle $here"
fi
CTR=$bin/ctr TEST_GPU=$bin/test_gpu TEST_PLUGIN=$bin/test_plugin EQUIV=$bin/equiv_train
DEVICE=${CTR_CHECK_DEVICE:-cuda}
export ENVSH RANKS_PY BENCH_PY BUNDLE_INFO CTR_CHECK_SOURCE CTR TEST_GPU TEST_PLUGIN EQUIV DEVICE
# The GPU suite and the two-ranks test read their device from here.
[ "$DEVICE" = cuda ] || export CTR_TEST_DEVICE=$DEVICE
# NVIDIA's tools where CUDA is installed but not on PATH.
for d in ${CUDA_HOME:+"$CUDA_HOME/bin"} /usr/local/cuda/bin; do
  [ -d "$d" ] && PATH=$PATH:$d
done
export PATH
[ -n "$BUNDLE_INFO" ] && [ -f "$BUNDLE_INFO" ] && cp "$BUNDLE_INFO" "$LOGS/"

# ---------------------------------------------------------------------------
# Running stages inside the budget

deadline=$(( CTR_CHECK_START + budget ))
reserve=15   # packing the logs and writing the summary
: > "$work/results"
left() { echo $(( deadline - reserve - $(date +%s) )); }
elapsed() { echo $(( $(date +%s) - CTR_CHECK_START )); }

# stage NAME NEED LIMIT [gpu]: runs stage_NAME for at most LIMIT seconds, if at
# least NEED seconds of the budget are left; gpu stages need a usable GPU.
stage() {
  local name=$1 need=$2 limit=$3 kind=${4:-} result secs rc t0 why=""
  rm -f "$work/note.$name"
  if [ "$kind" = gpu ] && [ -s "$work/gpu_reason" ]; then
    why="no usable GPU: $(cat "$work/gpu_reason")"
  elif [ -n "${skip_why:-}" ]; then
    why=$skip_why
  elif [ "$(left)" -lt "$need" ]; then
    why="budget: $(left) s left, the stage needs $need s"
  fi
  if [ -n "$why" ]; then
    printf '%s|SKIP|0|%s\n' "$name" "$why" >> "$work/results"
    printf '[%4d s] %-11s SKIP (%s)\n' "$(elapsed)" "$name" "$why"
    skip_why=""
    write_summary
    return 0
  fi
  [ "$(left)" -lt "$limit" ] && limit=$(left)
  printf '[%4d s] %-11s started (limit %d s)\n' "$(elapsed)" "$name" "$limit"
  t0=$(date +%s)
  # The stages' temporary files go with the check's own (TMPDIR).
  CTR_CHECK_LIMIT=$limit TMPDIR=$work/tmp timeout -k 10 "$limit" "$self" --stage "$name" > "$LOGS/stage_$name.out" 2>&1
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  case $rc in
    0) result=PASS ;;
    77) result=SKIP ;;
    124 | 137) result=TIMEOUT ;;
    *) result=FAIL ;;
  esac
  local what
  what=$(cat "$work/note.$name" 2>/dev/null | head -n 1)
  [ $result = TIMEOUT ] && what="stopped after $limit s${what:+; $what}"
  [ $result = FAIL ] && [ -z "$what" ] && what="exit $rc: $(log_tail "$LOGS/stage_$name.out" 1)"
  [ $result = FAIL ] && [ $rc -ne 1 ] && what="exit $rc: $what"
  [ -s "$LOGS/stage_$name.out" ] || rm -f "$LOGS/stage_$name.out"
  printf '%s|%s|%s|%s\n' "$name" "$result" "$secs" "$what" >> "$work/results"
  printf '[%4d s] %-11s %s in %d s%s\n' "$(elapsed)" "$name" "$result" "$secs" "${what:+ ($what)}"
  write_summary
  [ $result = PASS ]
}

write_summary() {
  {
    echo "libctr GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ): $(elapsed) s of a $budget s budget"
    echo
    [ -f "$LOGS/probe.txt" ] && sed 's/^/  /' "$LOGS/probe.txt" && echo
    printf '%-11s %-7s %5s  %s\n' stage result secs note
    while IFS='|' read -r n r s w; do
      printf '%-11s %-7s %5s  %s\n' "$n" "$r" "$s" "$w"
    done < "$work/results"
    if [ -s "$work/failing" ]; then
      echo
      echo "failing GPU tests:"
      sed 's/^/  /' "$work/failing"
    fi
    if [ -f "$LOGS/kernels.txt" ]; then
      echo
      echo "per-kernel times (ncu --clock-control none, gpu__time_duration.sum):"
      head -n 42 "$LOGS/kernels.txt"
    fi
    if [ -f "$LOGS/bench.log" ] && grep -q '^run ' "$LOGS/bench.log"; then
      echo
      echo "benchmark (tools/bench/bench_gpu.py):"
      sed -n '/ on .*(batch/,$p' "$LOGS/bench.log"
    fi
    echo
    echo "logs.tar.xz: every stage's log; console.log: this run's output"
  } > "$report/summary.txt"
}

echo "check: $CTR_CHECK_SOURCE -> $report, budget $budget s$([ "$DEVICE" = cuda ] || echo ", device $DEVICE in place of cuda")"
echo "the probe did not finish" > "$work/gpu_reason"
stage probe 20 150
stage plugin 10 60
stage smoke 20 90 gpu
gpu_ok=0; [ -s "$work/gpu_reason" ] || gpu_ok=1
stage gpu_suite 60 240 gpu
# After a timeout the stage could not list its failures itself.
[ -f "$LOGS/gpu_suite.log" ] && [ ! -f "$work/failing" ] && failing_tests "$LOGS/gpu_suite.log" > "$work/failing"
# Why the failing tests cannot be run again, if they cannot.
rerun_why() {
  local suite
  suite=$(awk -F'|' '$1 == "gpu_suite" {print $2}' "$work/results")
  if [ "$suite" = SKIP ]; then echo "the GPU suite did not run"
  elif [ ! -s "$work/failing" ] && [ "$suite" = PASS ]; then echo "no failing GPU tests"
  elif [ ! -s "$work/failing" ]; then echo "the GPU suite named no failing test (see its log)"
  fi
}
[ $gpu_ok = 1 ] && skip_why=$(rerun_why)
stage rerun 20 90 gpu
[ $gpu_ok = 1 ] && skip_why=$(rerun_why)
if [ $gpu_ok = 1 ] && [ -z "$skip_why" ] && ! command -v compute-sanitizer >/dev/null; then
  skip_why="compute-sanitizer not found"
fi
stage memcheck 40 150 gpu
stage gpt2_small 40 120 gpu
if [ $gpu_ok = 1 ] && ! command -v ncu >/dev/null; then skip_why="ncu not found"; fi
stage kernels 60 150 gpu
if [ $gpu_ok = 1 ] && ! py; then skip_why="python3 not found"; fi
stage ranks 60 180 gpu
if [ $gpu_ok = 1 ] && ! py; then skip_why="python3 not found"
elif [ $gpu_ok = 1 ] && [ "$DEVICE" != cuda ]; then skip_why="bench_gpu.py measures device cuda only"; fi
stage bench 90 240 gpu

# ---------------------------------------------------------------------------
# Report: the summary, the logs (each cut to 2 MiB), the console log

for f in "$LOGS"/*; do
  [ -f "$f" ] || continue
  if [ "$(stat -c %s "$f")" -gt 2097152 ]; then
    { head -c 262144 "$f"; printf '\n[... cut to its first 256 KiB and last 1.75 MiB ...]\n'; tail -c 1835008 "$f"; } \
      > "$f.cut" && mv "$f.cut" "$f"
  fi
done
write_summary
if command -v xz >/dev/null; then
  tar -C "$work" -cf - logs | xz -6 -T1 > "$report/logs.tar.xz"
else
  python3 -c 'import sys, tarfile
with tarfile.open(sys.argv[1], "w:xz") as t: t.add(sys.argv[2], "logs")' "$report/logs.tar.xz" "$LOGS"
fi
status=0
grep -qE '^[^|]*\|(FAIL|TIMEOUT)\|' "$work/results" && status=1
echo "check: $(grep -c '|PASS|' "$work/results") passed, $(grep -c '|FAIL|' "$work/results") failed," \
  "$(grep -c '|TIMEOUT|' "$work/results") timed out, $(grep -c '|SKIP|' "$work/results") skipped in $(elapsed) s"
echo "check: report $report: summary.txt $(stat -c %s "$report/summary.txt") bytes," \
  "logs.tar.xz $(stat -c %s "$report/logs.tar.xz") bytes, console.log"
exit $status
