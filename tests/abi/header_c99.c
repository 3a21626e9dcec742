/* The public header must compile alone as strict C99, and its basic calls must
 * link against libctr.so and behave. */
#include "ctr/ctr.h"

#include <stdio.h>
#include <string.h>

int main(void) {
  ctr_options *o = NULL;
  ctr_mesh *m = NULL;
  ctr_step_metrics met;
  if (ctr_abi_version() != CTR_ABI_VERSION) return 1;
  if (strcmp(ctr_status_string(CTR_STATUS_OK), "ok") != 0) return 2;
  if (ctr_options_create(&o) != CTR_STATUS_OK) return 3;
  if (ctr_options_set_int(o, "bogus", 1) != CTR_STATUS_OK) return 4;
  if (ctr_mesh_create(o, &m) != CTR_STATUS_INVALID_OPTION || m != NULL) return 5;
  if (strstr(ctr_last_error(), "bogus") == NULL) return 6;
  ctr_options_free(o);
  met.size = sizeof met;
  (void)met;
  printf("libctr %s abi %d\n", ctr_version(), ctr_abi_version());
  return 0;
}
