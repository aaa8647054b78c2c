/* A planted allocation failure for the GPU failure scenario "told": preloaded
 * (LD_PRELOAD) into one rank's process only, it makes ncclMemAlloc refuse
 * every request of JCG_PLANT_ALLOC_FAIL_FROM bytes or more, as a GPU out of
 * memory does, and passes smaller ones to NCCL. Built by the test:
 *   cc -shared -fPIC -o plant.so plant_alloc_failure.c -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

typedef int ncclResult_t; /* nccl.h's enum: 0 success, 1 unhandled CUDA error */

ncclResult_t ncclMemAlloc(void** ptr, size_t size) {
  static ncclResult_t (*real)(void**, size_t) = NULL;
  if (real == NULL) real = (ncclResult_t (*)(void**, size_t))dlsym(RTLD_NEXT, "ncclMemAlloc");
  const char* from = getenv("JCG_PLANT_ALLOC_FAIL_FROM");
  if (from != NULL && size >= strtoull(from, NULL, 10)) {
    fprintf(stderr, "plant_alloc_failure: refusing ncclMemAlloc of %zu bytes\n", size);
    return 1;
  }
  return real == NULL ? 1 : real(ptr, size);
}
