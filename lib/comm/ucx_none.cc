// Builds without UCX (-Ducx=disabled or no libucx-dev): multi-rank meshes fail
// with a clear message instead of the library failing to link.

#include "comm/comm.h"
#include "core/status.h"

namespace ctr {

bool ucx_available() { return false; }

Comm ucx_comm_create(Store &, int, int world, int64_t) {
  fail(CTR_STATUS_UNSUPPORTED,
       strformat("a mesh of %d ranks needs the UCX communicator, and this libctr was built "
                 "without UCX (install libucx-dev and rebuild with -Ducx=enabled)",
                 world));
}

}  // namespace ctr
