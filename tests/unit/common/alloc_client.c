/* common/alloc.c compiled as libfactorps compiles it: the library's own
 * allocation domain (common/alloc.h), for test_alloc's domain test. */
#define FPS_BUILDING_CLIENT
#include "alloc.c"
