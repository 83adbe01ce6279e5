/* Stand-in for libFuzzer's driver when the compiler has none (gcc, or a
 * build without FPS_FUZZ): runs the target once on every file named on the
 * command line (a directory: every file in it), so each build replays the
 * seed corpora and the reproducers of fixed crashes as a plain test, under
 * whatever sanitizers the build uses. Exit 0 when every input ran. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "replay: cannot open %s\n", path);
    return -1;
  }
  uint8_t *buf = NULL;
  size_t len = 0, cap = 0;
  for (;;) {
    if (len == cap) {
      cap = cap ? cap * 2 : 4096;
      uint8_t *nb = realloc(buf, cap);
      if (!nb) {
        free(buf);
        fclose(f);
        return -1;
      }
      buf = nb;
    }
    size_t got = fread(buf + len, 1, cap - len, f);
    len += got;
    if (got == 0) break;
  }
  int bad = ferror(f);
  fclose(f);
  if (bad) {
    free(buf);
    fprintf(stderr, "replay: cannot read %s\n", path);
    return -1;
  }
  /* An exact-size copy, so ASan catches a read one past the input. */
  uint8_t *in = malloc(len ? len : 1);
  if (!in) {
    free(buf);
    return -1;
  }
  memcpy(in, buf, len);
  free(buf);
  LLVMFuzzerTestOneInput(in, len);
  free(in);
  return 0;
}

int main(int argc, char **argv) {
  size_t ran = 0;
  for (int i = 1; i < argc; i++) {
    struct stat st;
    if (stat(argv[i], &st) != 0) {
      fprintf(stderr, "replay: %s does not exist\n", argv[i]);
      return 1;
    }
    if (!S_ISDIR(st.st_mode)) {
      if (run_file(argv[i]) < 0) return 1;
      ran++;
      continue;
    }
    struct dirent **names;
    int n = scandir(argv[i], &names, NULL, alphasort);
    if (n < 0) {
      fprintf(stderr, "replay: cannot list %s\n", argv[i]);
      return 1;
    }
    int rc = 0;
    for (int k = 0; k < n; k++) {
      char path[4096];
      snprintf(path, sizeof path, "%s/%s", argv[i], names[k]->d_name);
      if (rc == 0 && stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
        if (run_file(path) < 0) rc = 1;
        else ran++;
      }
      free(names[k]);
    }
    free(names);
    if (rc) return rc;
  }
  if (ran == 0) {
    fprintf(stderr, "replay: no input files\n");
    return 1;
  }
  printf("replay: %zu inputs ran without a crash\n", ran);
  return 0;
}
