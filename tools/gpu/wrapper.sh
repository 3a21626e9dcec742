#!/bin/sh
# ctr-gpu/NAME runs ctr-gpu/bin/NAME (tools/gpu/bundle.sh copies this file once
# per program) with the bundle's libraries and the target's CUDA libraries on
# its library path (env.sh); nothing is asked of the caller's environment.
here=$(dirname "$(readlink -f "$0")")
. "$here/env.sh"
ctr_gpu_env "$here/lib"
exec "$here/bin/$(basename "$0")" "$@"
