/* The bf16 encoding of a parameter buffer, made once and shared by all of
 * the replies sending it.
 *
 * In sync mode all W workers get the same parameter buffer back, and with
 * --wire-dtype bf16 each reply used to convert it again: W passes over the
 * parameters per step for one result. Now the first reply that needs bf16
 * converts the whole buffer into one encoding, counted against
 * max_staging_bytes, and every reply sends slices of it. A published
 * buffer never changes (fps_snap_t's rule), so its encoding stays right for
 * as long as the buffer lives.
 *
 * The encoding lives while replies use it, not as long as the buffer: a
 * tensor's current parameters may stay for hours without a step, and an
 * encoding kept with them would hold half their size of the staging limit
 * that pushes need (a push refused where it was not before). Each reply
 * and each slice over the encoding holds a reference; the last one frees
 * it and clears the buffer's field, so a later reply converts afresh. The
 * encoding holds a reference to its buffer.
 *
 * One mutex guards every buffer's field and every encoding's count. It is
 * a leaf (nothing is locked inside it) held for a few instructions, never
 * while converting: the converting thread marks the field BUSY, and a
 * reply that finds BUSY converts its own message instead of waiting,
 * which would stall a gRPC poller for a whole conversion.
 *
 * An update whose replies will send bf16 (a sync round with bf16 members,
 * an async bf16 push) makes the encoding itself, in its pass C
 * (fps_adafactor_step_to_bf16), with one reference per such reply, and
 * attaches it to the new buffer before publishing it: the replies find it
 * made and nobody converts. Same staging count, same lifetime (the last
 * reply's reference frees it); if it cannot be allocated the update runs
 * without it and the replies convert as before. */
#include "alloc.h"
#include "internal.h"

struct fps_snap_bf16_s {
  int refs;                   /* guarded by fps__bf16_mu */
  fps_shard_t *sh;            /* whose staging bytes it counts in */
  fps_snap_t *snap;           /* the buffer it encodes (one reference) */
  uint64_t floats;            /* its size in fps_tbuf_alloc()'s units */
  uint8_t data[];             /* snap->numel little-endian bf16 */
};

static pthread_mutex_t fps__bf16_mu = PTHREAD_MUTEX_INITIALIZER;
/* The BUSY mark: an address no encoding can have. */
static fps_snap_bf16_t fps__bf16_busy;

/* Header and data in one staging buffer: the header's bytes count too. */
static uint64_t fps__bf16_floats(uint64_t numel) {
  return (sizeof(fps_snap_bf16_t) + numel * 2 + sizeof(float) - 1) / sizeof(float);
}

fps_snap_bf16_t *fps__snap_bf16_new(fps_shard_t *sh, uint64_t numel, int refs) {
  uint64_t floats = fps__bf16_floats(numel);
  bool over = false;
  fps_snap_bf16_t *e = (fps_snap_bf16_t *)(void *)fps_tbuf_alloc(sh, floats, &over);
  if (!e) return NULL;
  e->refs = refs;
  e->sh = sh;
  e->snap = NULL;
  e->floats = floats;
  return e;
}

uint8_t *fps__snap_bf16_buf(fps_snap_bf16_t *e) { return e->data; }

void fps__snap_bf16_attach(fps_snap_bf16_t *e, fps_snap_t *s) {
  fps_snap_ref(s);
  e->snap = s;
  pthread_mutex_lock(&fps__bf16_mu);
  s->bf16 = e;
  pthread_mutex_unlock(&fps__bf16_mu);
}

void fps__snap_bf16_discard(fps_snap_bf16_t *e) {
  if (e) fps_tbuf_free(e->sh, (float *)(void *)e, e->floats);
}

fps_snap_bf16_t *fps_snap_bf16_get(fps_shard_t *sh, fps_snap_t *s) {
  pthread_mutex_lock(&fps__bf16_mu);
  fps_snap_bf16_t *e = s->bf16;
  if (e == &fps__bf16_busy) {
    pthread_mutex_unlock(&fps__bf16_mu);
    return NULL;
  }
  if (e) {
    e->refs++;
    pthread_mutex_unlock(&fps__bf16_mu);
    return e;
  }
  s->bf16 = &fps__bf16_busy;
  pthread_mutex_unlock(&fps__bf16_mu);

  e = fps__snap_bf16_new(sh, s->numel, 1);
  if (e) {
    fps_dtype_encode(FPS_DTYPE_BF16, s->data, s->numel, e->data);
    fps_snap_ref(s);
    e->snap = s;
  }
  pthread_mutex_lock(&fps__bf16_mu);
  s->bf16 = e; /* NULL after a failure: a later reply may try again */
  pthread_mutex_unlock(&fps__bf16_mu);
  return e;
}

const uint8_t *fps_snap_bf16_data(const fps_snap_bf16_t *e) { return e->data; }

void fps_snap_bf16_ref(fps_snap_bf16_t *e) {
  pthread_mutex_lock(&fps__bf16_mu);
  e->refs++;
  pthread_mutex_unlock(&fps__bf16_mu);
}

void fps_snap_bf16_unref(fps_snap_bf16_t *e) {
  if (!e) return;
  pthread_mutex_lock(&fps__bf16_mu);
  bool last = --e->refs == 0;
  if (last) e->snap->bf16 = NULL;
  pthread_mutex_unlock(&fps__bf16_mu);
  if (!last) return;
  fps_snap_t *s = e->snap;
  fps_tbuf_free(e->sh, (float *)(void *)e, e->floats);
  fps_snap_unref(s);
}
