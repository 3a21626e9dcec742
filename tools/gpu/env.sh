# Library path of libctr's programs on a GPU machine; sourced (POSIX sh) by the
# bundle's wrappers (tools/gpu/wrapper.sh) and by check.sh, never run.
#
# The bundle carries every library its programs need except the system's own
# (glibc, libstdc++, libgcc_s, the loader) and the CUDA ones, which belong to
# the target's driver and CUDA installation: cuBLASLt (libctr-cuda.so links it),
# NCCL (the plugin loads it for transport "nccl") and cuDNN (the plugin loads
# it for attention, else attention takes the own kernels). They are looked for, in
# order, in $CUDA_HOME/lib64, /usr/local/cuda/lib64, the system's library cache,
# then PyTorch's CUDA wheels in python3's site directories: nvidia/cu13/lib
# (CUDA 13 wheels), then nvidia/*/lib (older ones: nvidia/cublas/lib,
# nvidia/nccl/lib, nvidia/cudnn/lib). Only the program a wrapper starts (and
# what it starts in turn) sees the path; the caller's shell keeps its own.

# Site directories of python3 (a virtual environment's when one is active).
ctr_gpu_site_dirs() {
  if [ -z "${ctr_gpu_sites+set}" ]; then
    ctr_gpu_sites=$(python3 -c 'import site, sys
dirs = list(getattr(site, "getsitepackages", lambda: [])()) + [site.getusersitepackages()]
print("\n".join(d for d in dirs + sys.path if d.endswith(("site-packages", "dist-packages"))))' 2>/dev/null | awk '!seen[$0]++')
  fi
  printf '%s\n' "$ctr_gpu_sites"
}

# The CUDA installation's library directories, most preferred first.
ctr_gpu_candidates() {
  for d in ${CUDA_HOME:+"$CUDA_HOME/lib64"} ${CUDA_PATH:+"$CUDA_PATH/lib64"} /usr/local/cuda/lib64 \
    /usr/local/cuda/targets/x86_64-linux/lib; do
    printf '%s\n' "$d"
  done
}

# ctr_gpu_find FILE: the directory holding FILE (e.g. libcublasLt.so.13), and
# where it was found, as "DIR<tab>WHERE"; nothing when it is nowhere.
ctr_gpu_find() {
  for d in $(ctr_gpu_candidates); do
    if [ -e "$d/$1" ]; then printf '%s\t%s\n' "$d" "CUDA installation"; return 0; fi
  done
  ldc=$( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null | awk -v f="$1" '$1 == f && $NF ~ /^\// {print $NF; exit}')
  if [ -n "$ldc" ]; then printf '%s\t%s\n' "$(dirname "$ldc")" "system library cache"; return 0; fi
  ctr_gpu_site_dirs | while read -r sp; do
    [ -n "$sp" ] || continue
    for d in "$sp"/nvidia/cu13/lib "$sp"/nvidia/*/lib; do
      if [ -e "$d/$1" ]; then printf '%s\t%s\n' "$d" "python wheel"; return 0; fi
    done
  done
}

# ctr_gpu_env LIBDIR: exports LD_LIBRARY_PATH (LIBDIR, then the directories of
# cuBLASLt, NCCL and cuDNN, then the caller's path), UCX_MODULE_DIR and
# CTR_PLUGIN_PATH (LIBDIR/ucx and LIBDIR) for one program. An empty LIBDIR
# (check.sh --from-build) adds the CUDA directories only.
ctr_gpu_env() {
  ctr_gpu_path=${1:-}
  for f in libcublasLt.so.13 libnccl.so.2 libcudnn.so.9; do
    d=$(ctr_gpu_find "$f" | cut -f1)
    case ":$ctr_gpu_path:" in
      *":$d:"*) ;;
      *) [ -n "$d" ] && ctr_gpu_path=${ctr_gpu_path:+$ctr_gpu_path:}$d ;;
    esac
  done
  LD_LIBRARY_PATH=$ctr_gpu_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export LD_LIBRARY_PATH
  if [ -n "${1:-}" ]; then
    UCX_MODULE_DIR=$1/ucx
    CTR_PLUGIN_PATH=$1
    export UCX_MODULE_DIR CTR_PLUGIN_PATH
  fi
}
