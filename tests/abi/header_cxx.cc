// The public header compiles alone as C++ and declares everything extern "C".
#include "ctr/ctr.h"

#include <type_traits>

static_assert(std::is_standard_layout_v<ctr_step_metrics>);
static_assert(CTR_STATUS_OK == 0);

int main() {
  ctr_graph *g = nullptr;
  ctr_status s = ctr_graph_load_file("/nonexistent.ctrg", &g);
  return (s == CTR_STATUS_IO_ERROR && g == nullptr) ? 0 : 1;
}
