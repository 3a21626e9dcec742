/* A stand-in for libcudnn.so.9 in the loader's tests (tests/unit/test_cudnn_load.cc):
 * built once with cudnnGetVersion alone (the symbols the loader needs are
 * missing) and once with every symbol it needs and an old version (8.9.7).
 * Nothing here is ever called beyond cudnnGetVersion. */
#include <stddef.h>

size_t cudnnGetVersion(void) { return 8907; }

#if defined(CTR_FAKE_CUDNN_ALL)
int cudnnGetErrorString(void) { return 0; }
int cudnnGetLastErrorString(void) { return 0; }
int cudnnCreate(void) { return 0; }
int cudnnDestroy(void) { return 0; }
int cudnnSetStream(void) { return 0; }
int cudnnBackendCreateDescriptor(void) { return 0; }
int cudnnBackendDestroyDescriptor(void) { return 0; }
int cudnnBackendFinalize(void) { return 0; }
int cudnnBackendSetAttribute(void) { return 0; }
int cudnnBackendGetAttribute(void) { return 0; }
int cudnnBackendExecute(void) { return 0; }
#endif
