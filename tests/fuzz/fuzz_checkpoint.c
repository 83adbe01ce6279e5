/* libFuzzer target: the checkpoint reader (common/checkpoint_read.c) on
 * arbitrary file contents. Build with -DFUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
 * so that wrong SHA-256s do not stop mutations at the digest check (a
 * hostile file can carry valid digests anyway). Built by tests/fuzz/CMakeLists.txt
 * (that define included); seed: tests/fuzz/corpus/fuzz_checkpoint, written by
 * `ckpt_sample write DIR` (sample-5-tensors) and `ckpt_sample write-blocks DIR`
 * (sample-2-blocks, row blocks of split tensors). Run with tests/fuzz/run.sh.
 * The reader takes a path, so each input goes through a file in /dev/shm. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char dir[64], path[96];

/* Leaves nothing behind in /dev/shm (the corpus replay runs in every build). */
static void cleanup(void) {
  unlink(path);
  rmdir(dir);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!dir[0]) {
    snprintf(dir, sizeof dir, "/dev/shm/fps-fuzz-%d", (int)getpid());
    snprintf(path, sizeof path, "%s/ckpt-1.safetensors", dir);
    mkdir(dir, 0700);
    atexit(cleanup);
  }
  FILE *f = fopen(path, "wb");
  if (!f) abort();
  if (size && fwrite(data, 1, size, f) != size) abort();
  if (fclose(f) != 0) abort();
  char why[FPS_CKPT_WHY_MAX];
  fps_ckpt_t *c = NULL;
  fps_ckpt_info_t info;
  fps_ckpt_verify_file(path, NULL, &info, why, sizeof why);
  fps_ckpt_load_file(path, NULL, &c, why, sizeof why);
  fps_ckpt_destroy(c);
  return 0;
}
