/* The synthetic models of `factorps load` (and `factorps plan`): tensor
 * lists of about N parameters, every tensor torch-flavored, no init. */
#include "alloc.h"
#include "models.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void fps_cli_model_free(fps_cli_model_t *m) {
  if (!m) return;
  fps_free(m->defs);
  fps_free(m->names);
  memset(m, 0, sizeof *m);
}

static void def_add(fps_cli_model_t *m, const char *name, uint32_t ndim, uint64_t d0, uint64_t d1) {
  fps_tensor_def_t *d = &m->defs[m->n_tensors];
  memset(d, 0, sizeof *d);
  snprintf(m->names[m->n_tensors], sizeof m->names[0], "%s", name);
  d->name = m->names[m->n_tensors];
  d->ndim = ndim;
  d->shape[0] = d0;
  d->shape[1] = d1;
  d->optim.flavor = FPS_OPTIM_TORCH;
  m->total += ndim == 1 ? d0 : d0 * d1;
  m->n_tensors++;
}

/* A GPT-like stack: token embedding [vocab, d]; per layer ln1 [d],
 * attn.qkv [3d, d], attn.out [d, d], ln2 [d], mlp.up [4d, d],
 * mlp.down [d, 4d]; a final ln [d]. d grows with N (sqrt(N/100), a
 * multiple of 8), the layers take about 70% of N and the vocabulary fills
 * the rest, so the total lands within one embedding row of N. */
int fps_cli_model_gpt(fps_cli_model_t *m, unsigned long long params, const char *prog) {
  memset(m, 0, sizeof *m);
  uint64_t n = params;
  uint64_t d = (uint64_t)(sqrt((double)n / 100.0) / 8.0 + 0.5) * 8;
  if (d < 8) d = 8;
  uint64_t per_layer = 12 * d * d + 2 * d;
  uint64_t layers = (uint64_t)((double)n * 0.7 / (double)per_layer);
  if (layers < 1) layers = 1;
  if (layers > 512) layers = 512;
  if (layers * per_layer + d + d > n) {
    fprintf(stderr, "%s: --params %llu is too small for a model (need >= %llu)\n",
            prog, (unsigned long long)n, (unsigned long long)(per_layer + 2 * d));
    return 2;
  }
  uint64_t vocab = (n - layers * per_layer - d) / d;
  size_t cap = 2 + 6 * layers;
  m->defs = fps_calloc(cap, sizeof *m->defs);
  m->names = fps_calloc(cap, sizeof *m->names);
  if (!m->defs || !m->names) {
    fprintf(stderr, "%s: out of memory for the model\n", prog);
    fps_cli_model_free(m);
    return 1;
  }
  char name[64];
  def_add(m, "embed.tok", 2, vocab, d);
  for (uint64_t l = 0; l < layers; l++) {
#define L(suffix, nd, a, b)                                                                \
  snprintf(name, sizeof name, "layer%03llu.%s", (unsigned long long)l, suffix);           \
  def_add(m, name, nd, a, b)
    L("ln1", 1, d, 0);
    L("attn.qkv", 2, 3 * d, d);
    L("attn.out", 2, d, d);
    L("ln2", 1, d, 0);
    L("mlp.up", 2, 4 * d, d);
    L("mlp.down", 2, d, 4 * d);
#undef L
  }
  def_add(m, "ln_f", 1, d, 0);
  return 0;
}

/* --model peer: the shapes of the torch.distributed.rpc parameter server
 * we benchmark against (tests/bench/side_by_side.sh), so both move the
 * same tensors. K tensors: L = (K-1)/6 layers of Wqkv [3h, h], Wo [h, h],
 * W1 [4h, h], W2 [h, 4h], b_qkv [3h], b_1 [4h]; h is the largest multiple
 * of 64 (at least 64) with 12 L h^2 <= 0.88 N; an embedding [V, h] first,
 * V = (N - the rest) / h, takes the remainder, and K - 1 - 6L vectors [h]
 * at the end make the count exactly K. (10M: h 256, 10 layers; 100M:
 * h 832, embedding 20279 x 832.) */
int fps_cli_model_peer(fps_cli_model_t *m, unsigned long long params, unsigned long long tensors,
                       const char *prog) {
  memset(m, 0, sizeof *m);
  uint64_t n = params, k = tensors;
  if (k < 7 || k > 6 * 512 + 1) {
    fprintf(stderr, "%s: --model peer needs --tensors in [7, 3073], not %llu\n",
            prog, (unsigned long long)k);
    return 2;
  }
  uint64_t layers = (k - 1) / 6, extra = k - 1 - 6 * layers;
  uint64_t h = (uint64_t)floor(sqrt(0.88 * (double)n / (double)(12 * layers)) / 64.0) * 64;
  if (h < 64) h = 64;
  uint64_t used = layers * (12 * h * h + 7 * h) + extra * h;
  uint64_t vocab = n > used + h ? (n - used) / h : 1;
  m->defs = fps_calloc(k, sizeof *m->defs);
  m->names = fps_calloc(k, sizeof *m->names);
  if (!m->defs || !m->names) {
    fprintf(stderr, "%s: out of memory for the model\n", prog);
    fps_cli_model_free(m);
    return 1;
  }
  char name[64];
  def_add(m, "embed", 2, vocab, h);
  for (uint64_t l = 0; l < layers; l++) {
#define L(suffix, nd, a, b)                                                                \
  snprintf(name, sizeof name, "layer%03llu.%s", (unsigned long long)l, suffix);           \
  def_add(m, name, nd, a, b)
    L("wqkv", 2, 3 * h, h);
    L("wo", 2, h, h);
    L("w1", 2, 4 * h, h);
    L("w2", 2, h, 4 * h);
    L("b_qkv", 1, 3 * h, 0);
    L("b_1", 1, 4 * h, 0);
#undef L
  }
  for (uint64_t i = 0; i < extra; i++) {
    snprintf(name, sizeof name, "norm%llu", (unsigned long long)i);
    def_add(m, name, 1, h, 0);
  }
  return 0;
}
