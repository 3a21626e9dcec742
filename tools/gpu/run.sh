#!/bin/sh
# Runs the GPU suite and the GPU benchmarks from an unpacked bundle (made by
# tools/gpu/bundle.sh) and writes a report into REPORT_DIR:
#
#   tar xJf gpu-bundle.tar.xz && ctr-gpu/run.sh REPORT_DIR [--quick]
#
# REPORT_DIR receives: env.txt (GPU, driver, where cuBLASLt came from),
# plugin.log, gpu_suite.log and gpu_suite.json (GoogleTest), gpu_ranks.log,
# bench_gpu_MODEL.json and bench_MODEL.log (libctr next to PyTorch) and summary.txt. --quick runs the suite and a
# short benchmark only. cuBLASLt is taken from CUDA_HOME or /usr/local/cuda,
# else from PyTorch's nvidia-cublas wheel.
set -u
here=$(cd "$(dirname "$0")" && pwd)
report=${1:?usage: run.sh REPORT_DIR [--quick]}
quick=${2:-}
mkdir -p "$report"
report=$(cd "$report" && pwd)

cublas_dir=""
for d in "${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu; do
  if ls "$d"/libcublasLt.so.13* >/dev/null 2>&1; then cublas_dir=$d; break; fi
done
if [ -z "$cublas_dir" ]; then
  for py in python3 /usr/bin/python3; do
    d=$($py -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null) &&
      ls "$d"/libcublasLt.so.13* >/dev/null 2>&1 && cublas_dir=$d && break
  done
fi
# NCCL (transport nccl) is loaded by the plugin at run time: the CUDA
# installation's, else PyTorch's nvidia-nccl wheel, unless CTR_NCCL_PATH is set.
if [ -z "${CTR_NCCL_PATH:-}" ] && ! ls "${CUDA_HOME:-/usr/local/cuda}"/lib64/libnccl.so.2* >/dev/null 2>&1; then
  for py in python3 /usr/bin/python3; do
    d=$($py -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null) &&
      ls "$d"/libnccl.so.2* >/dev/null 2>&1 && CTR_NCCL_PATH=$d && export CTR_NCCL_PATH && break
  done
fi
LD_LIBRARY_PATH="$here/lib${cublas_dir:+:$cublas_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
UCX_MODULE_DIR="$here/lib/ucx"
CTR_PLUGIN_PATH="$here/lib"
export LD_LIBRARY_PATH UCX_MODULE_DIR CTR_PLUGIN_PATH

# The system's loader, or the bundled one when the system's C library is older.
run() { "$@"; }
if ! "$here/bin/ctr" version >/dev/null 2>&1; then
  loader=$(ls "$here"/lib/ld-linux-x86-64.so.* 2>/dev/null | head -1)
  run() { prog=$1; shift; "$loader" --library-path "$LD_LIBRARY_PATH" "$prog" "$@"; }
fi

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "bundle commit: $(cat "$here/COMMIT")"
  echo "cuBLASLt from: ${cublas_dir:-not found}"
  echo "NCCL from: ${CTR_NCCL_PATH:-the CUDA installation or the library path}"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  run "$here/bin/ctr" version 2>&1
} > "$report/env.txt"

status=0
CTR_PLUGIN_PATH="$here/lib" run "$here/bin/test_plugin" > "$report/plugin.log" 2>&1 || status=1
run "$here/bin/test_gpu" --gtest_output="json:$report/gpu_suite.json" > "$report/gpu_suite.log" 2>&1
rc=$?
[ $rc -ne 0 ] && status=1
# Two ranks on one GPU: the programs go through the bundled loader when needed.
if [ -n "${loader:-}" ]; then
  printf '#!/bin/sh\nexec "%s" --library-path "%s" "%s" "$@"\n' "$loader" "$LD_LIBRARY_PATH" "$here/bin/ctr" > "$report/ctr"
  printf '#!/bin/sh\nexec "%s" --library-path "%s" "%s" "$@"\n' "$loader" "$LD_LIBRARY_PATH" "$here/bin/equiv_train" \
    > "$report/equiv_train"
  chmod +x "$report/ctr" "$report/equiv_train"
  ctr_bin=$report/ctr equiv_bin=$report/equiv_train
else
  ctr_bin=$here/bin/ctr equiv_bin=$here/bin/equiv_train
fi
python3 "$here/test_gpu_ranks.py" "$ctr_bin" "$equiv_bin" > "$report/gpu_ranks.log" 2>&1
ranks_rc=$?
[ $ranks_rc -ne 0 ] && status=1

# Benchmarks: libctr next to PyTorch (eager and torch.compile) on this GPU,
# tokens/s and MFU (tools/bench/bench_gpu.py).
bench() {
  python3 "$here/py/bench/bench_gpu.py" --ctr "$ctr_bin" --out "$report" "$@" > "$report/bench_$2.log" 2>&1 ||
    echo "bench $2 failed: $(tail -n 1 "$report/bench_$2.log")"
  cat "$report/bench_$2.log"
}
{
  echo "gpu suite exit: $rc (0 passed, 77 skipped)"
  echo "two ranks on one GPU exit: $ranks_rc"
  tail -n 4 "$report/gpu_ranks.log"
  grep -E "^\[  (PASSED|FAILED) " "$report/gpu_suite.log" | head -40
  if [ "$quick" = --quick ]; then
    bench --model gpt2_small --steps 10 --warmup 3
  else
    bench --model gpt2_small --steps 20 --warmup 5
    bench --model llama_1b --steps 10 --warmup 3
  fi
} > "$report/summary.txt" 2>&1
cat "$report/summary.txt"
exit $status
