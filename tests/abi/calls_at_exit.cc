// ctr_* calls keep working while the host process exits: a call made from a
// static destructor (after this thread's thread_local objects are destroyed)
// records and returns its error as at any other time. Also: an error message
// longer than the last-error buffer comes back cut, and says so.

#include <ctr/ctr.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unistd.h>

namespace {

// Creates a mesh from one "mesh" option value; returns the status.
ctr_status mesh_with_axes(const char *axes) {
  ctr_options *o = nullptr;
  if (ctr_options_create(&o) != CTR_STATUS_OK) return CTR_STATUS_INTERNAL;
  ctr_options_set_string(o, "mesh", axes);
  ctr_mesh *m = nullptr;
  ctr_status st = ctr_mesh_create(o, &m);
  ctr_options_free(o);
  ctr_mesh_free(m);
  return st;
}

bool expect_error(const char *axes, const char *want, const char *when) {
  ctr_status st = mesh_with_axes(axes);
  const char *err = ctr_last_error();
  if (st != CTR_STATUS_INVALID_OPTION || err == nullptr || std::strstr(err, want) == nullptr) {
    std::fprintf(stderr, "%s: mesh '%.60s' gave status %d, error '%.200s'; wanted '%s'\n", when, axes,
                 static_cast<int>(st), err ? err : "(null)", want);
    return false;
  }
  return true;
}

struct CallsAtExit {
  ~CallsAtExit() {
    if (!expect_error("xp=1", "unknown axis 'xp'", "static destructor")) _exit(1);
    std::fprintf(stderr, "static destructor: the error came back intact\n");
  }
} calls_at_exit;

}  // namespace

int main() {
  bool ok = expect_error("dp=2,fsdp=3", "multiply to 6", "main");
  // Four axes of 2^20: the product is past every world size and must not overflow.
  ok = ok && expect_error("dp=1048576,fsdp=1048576,ep=1048576,tp=1048576", "multiply to more than", "main");
  // A message longer than the buffer is cut and marked.
  std::string huge = std::string(40000, 'q') + "=1";
  ok = ok && expect_error(huge.c_str(), "(message cut)", "main");
  if (ok && std::strlen(ctr_last_error()) >= 16384) {
    std::fprintf(stderr, "main: a cut message is %zu bytes long\n", std::strlen(ctr_last_error()));
    ok = false;
  }
  return ok ? 0 : 1;
}
