/* libFuzzer target: a split tensor's partial sums as a peer shard sends
 * them (common/adafactor_split.h), decoded and combined with this shard's
 * own block's. A shard will parse these from the network, so no input may
 * crash the decoder or the combine, whatever its numbers (NaN, Inf,
 * negative sums, a column state that disagrees).
 *
 * Input: byte 0 picks the tensor (bits 0-1: [7], [3, 5], [2, 3, 4] or
 * [64, 33]), the flavor (bit 2: torch, else hf), the phase the input is
 * decoded as (bit 3: u2, else stats) and tiny gradients (bit 4, so that
 * torch takes its u2 phase); byte 1 picks where the two blocks meet; the
 * rest is block 0's partials in their wire form. Block 1 is stepped for
 * real. Seeds: tests/fuzz/corpus/fuzz_split_partials (valid partials of
 * each tensor, written by this target's FPS_FUZZ_WRITE_SEEDS mode). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adafactor_split.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAXN (64 * 33)

typedef struct pair_s {
  fps_adafactor_hparams_t hp;
  fps_split_geom_t g[2];
  fps_split_state_t st[2];
  float param[MAXN], grad[MAXN];
  fps_split_step_t *s[2];
} pair_t;

static const fps_shape_t shapes[4] = {
    {.ndim = 1, .dim = {7}},
    {.ndim = 2, .dim = {3, 5}},
    {.ndim = 3, .dim = {2, 3, 4}},
    {.ndim = 2, .dim = {64, 33}},
};

/* Both blocks begun; 0, or -1 if the selectors make no valid split. */
static int pair_begin(pair_t *p, uint8_t sel, uint8_t cut_sel) {
  memset(p, 0, sizeof *p);
  fps_adafactor_defaults(&p->hp, sel & 4 ? FPS_FLAVOR_TORCH : FPS_FLAVOR_HF);
  const fps_shape_t *shape = &shapes[sel & 3];
  uint64_t rows = fps_split_total_rows(shape);
  uint64_t cut = 1 + cut_sel % (rows - 1);
  uint64_t b[3] = {0, cut, rows};
  float scale = sel & 16 ? 1e-6f : 1.0f;
  for (int i = 0; i < MAXN; i++) {
    p->param[i] = 0.01f * (float)(i % 13) - 0.06f;
    p->grad[i] = (0.02f * (float)(i % 7) - 0.07f) * scale;
  }
  for (int i = 0; i < 2; i++) {
    if (fps_split_geom_init(&p->g[i], shape, b[i], b[i + 1], NULL, 0)) abort();
    if (fps_split_state_init(&p->st[i], &p->g[i], &p->hp)) abort();
    uint64_t off = b[i] * p->g[i].cols;
    if (fps_split_step_begin(NULL, &p->hp, &p->st[i], p->param + off, p->grad + off, NULL,
                             &p->s[i]))
      abort();
  }
  return 0;
}

static void pair_end(pair_t *p) {
  for (int i = 0; i < 2; i++) {
    fps_split_step_free(p->s[i]);
    fps_split_state_destroy(&p->st[i]);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 2) return 0;
  static pair_t p;
  pair_begin(&p, data[0], data[1]);
  const int phase = data[0] & 8 ? FPS_SPLIT_PHASE_U2 : FPS_SPLIT_PHASE_STATS;
  fps_split_partials_t peer;
  char why[512];
  /* The geometry-free check runs on everything; whatever decodes against a
   * real block must pass it too. */
  int checked = fps_split_partials_check(data + 2, size - 2, phase, NULL, NULL, 0);
  if (fps_split_partials_decode(data + 2, size - 2, &p.g[0], phase, &peer, why, sizeof why)) {
    pair_end(&p);
    return 0;
  }
  if (checked) abort();
  /* Block 1 combines the peer's partials with its own (and block 0's real
   * stats partials when the input is the u2 phase's). */
  fps_split_partials_t parts[2] = {*fps_split_step_partials(p.s[0]),
                                   *fps_split_step_partials(p.s[1])};
  if (phase == FPS_SPLIT_PHASE_STATS) parts[0] = peer;
  int rc = fps_split_step_combine(p.s[1], parts, 2, why, sizeof why);
  if (rc == 0 && fps_split_step_needs_u2(p.s[1])) {
    if (phase == FPS_SPLIT_PHASE_U2) {
      const fps_split_partials_t *own = fps_split_step_u2(p.s[1]);
      if (!own) abort();
      fps_split_partials_t u2[2] = {peer, *own};
      rc = fps_split_step_combine_u2(p.s[1], u2, 2, why, sizeof why);
    } else {
      rc = -1; /* no u2 input: the step stays unapplied, as a step whose peer went quiet */
    }
  }
  if (rc == 0 && fps_split_step_apply(p.s[1], NULL)) abort();
  fps_split_partials_free(&peer);
  pair_end(&p);
  return 0;
}

#ifdef FPS_FUZZ_WRITE_SEEDS
/* Writes valid inputs (each tensor and flavor, both phases) to DIR. */
int main(int argc, char **argv) {
  if (argc != 2) return 2;
  int n = 0;
  for (unsigned sel = 0; sel < 32; sel++) {
    if ((sel & 8) && !((sel & 4) && (sel & 16))) continue; /* u2 only where torch takes it */
    static pair_t p;
    pair_begin(&p, (uint8_t)sel, 1);
    const int phase = sel & 8 ? FPS_SPLIT_PHASE_U2 : FPS_SPLIT_PHASE_STATS;
    const fps_split_partials_t *own = fps_split_step_partials(p.s[0]);
    if (phase == FPS_SPLIT_PHASE_U2) {
      fps_split_partials_t parts[2] = {*own, *fps_split_step_partials(p.s[1])};
      if (fps_split_step_combine(p.s[0], parts, 2, NULL, 0) || !fps_split_step_needs_u2(p.s[0])) {
        pair_end(&p);
        continue;
      }
      own = fps_split_step_u2(p.s[0]);
    }
    static uint8_t buf[2 + 64 + 64 * (16 + 20 * 33)];
    buf[0] = (uint8_t)sel;
    buf[1] = 1;
    size_t len = fps_split_partials_encode(own, buf + 2, sizeof buf - 2);
    char path[4096];
    snprintf(path, sizeof path, "%s/seed-%02u", argv[1], sel);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(buf, 1, len + 2, f) != len + 2 || fclose(f)) return 1;
    n++;
    pair_end(&p);
  }
  printf("%d seeds\n", n);
  return 0;
}
#endif
