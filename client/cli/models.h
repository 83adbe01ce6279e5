/* The synthetic models of `factorps load` and `factorps plan`. */
#ifndef FPS_CLI_MODELS_H
#define FPS_CLI_MODELS_H

#include <stddef.h>
#include <stdint.h>

#include "factorps/client.h"

typedef struct fps_cli_model_s {
  fps_tensor_def_t *defs;              /* n_tensors, names point into `names` */
  char (*names)[64];
  size_t n_tensors;
  uint64_t total;                      /* elements */
} fps_cli_model_t;

/* The GPT-like stack of about `params` parameters (see models.c). 0, or
 * the exit code after printing "<prog>: ..." to stderr: 2 for sizes no
 * model has, 1 out of memory. Free with fps_cli_model_free(). */
int fps_cli_model_gpt(fps_cli_model_t *m, unsigned long long params, const char *prog);
/* The torch.distributed.rpc peer benchmark's shapes, `tensors` (7..3073)
 * tensors. As fps_cli_model_gpt(). */
int fps_cli_model_peer(fps_cli_model_t *m, unsigned long long params, unsigned long long tensors,
                       const char *prog);
/* NULL-safe; zeroes *m. */
void fps_cli_model_free(fps_cli_model_t *m);

#endif
