/* A program built against an installed libfactorps with nothing but
 * `pkg-config --cflags --libs factorps`: creates one 64x32 tensor on the
 * shards named in argv[1] and prints the library it runs with, so the test
 * can check it ran without LD_LIBRARY_PATH. */
#include <factorps/client.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: installed_client HOST:PORT\n");
    return 2;
  }
  static float init[64 * 32];
  for (int i = 0; i < 64 * 32; i++) init[i] = (float)(i % 7) * 0.01f;
  const char *addrs[] = {argv[1]};
  fps_client_options_t o;
  fps_client_options_init(&o);
  o.deadline_seconds = 20;
  fps_status_t st;
  fps_client_t *c = fps_client_create(addrs, 1, &o, &st);
  if (!c) {
    fprintf(stderr, "installed_client: %s: %s\n", fps_code_name(st.code), st.message);
    return 1;
  }
  fps_tensor_def_t d;
  memset(&d, 0, sizeof d);
  d.name = "w";
  d.ndim = 2;
  d.shape[0] = 64;
  d.shape[1] = 32;
  d.optim.flavor = FPS_OPTIM_TORCH;
  d.init = init;
  int rc = fps_client_create_tensors(c, &d, 1, &st);
  if (rc) fprintf(stderr, "installed_client: %s: %s\n", fps_code_name(st.code), st.message);
  else printf("installed_client: created w 64x32\n");
  fps_client_destroy(c);
  return rc ? 1 : 0;
}
