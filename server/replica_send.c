/* The primary's side of Replicate (replica_send.h).
 *
 * What is shipped: each changed tensor's RESULT, not the gradient that
 * made it. After an update (or a Create, replace, resume) the tensor is
 * marked; the sender takes the marked tensors' images together
 * (fps_shard_images: parameters by reference, optimizer state copied, at
 * one moment between pushes, with the keys of the pushes they hold,
 * every member of a sync round at once) and sends them as one batch that the standby installs at its
 * commit message: a push is on the standby whole, with its key, or not
 * at all. No byte of an image is copied on the way: slices over the
 * snapshot and over the state copy go to the socket. So both replicas hold the same bits by construction (no
 * second kernel run, no dependence on the kernel variant or thread
 * count), the standby spends a copy instead of an Adafactor step on the
 * same CPUs, and a step costs about the gradient's bytes (fp32 parameters
 * plus the factored state, which is small). Marks coalesce: W workers'
 * replies of one sync round wait for one image, a Create that finds a
 * tensor ready and unchanged waits for the image already marked, and an
 * image taken later covers every mark before it.
 *
 * Who waits: a call about to acknowledge registers a wait on the
 * generation it marked for each tensor (and its push's key); the reply
 * goes out when the standby acknowledged the commit of a batch carrying
 * images of at least those generations. No poller thread blocks: the
 * wait's callback sends the reply from the receiver thread.
 *
 * Alone: without a joined standby the primary answers by itself, but only
 * while its lease says "alone" (lease.h sync record): it writes that at
 * promotion and again when a stream that was "in sync" ends, before it
 * answers anything; "in sync" once a joined standby acknowledged the first
 * batch taken after its join (which holds everything answered alone).
 *
 * Threads: the sender thread owns the call (connect, hello, transfer,
 * changes, heartbeats every 100 ms); the receiver thread reads the acks
 * and wakes the waits; the recorder thread writes "in sync" (an etcd
 * lease's record is a network call of up to 2 s: on the receiver it would
 * hold up every ack behind it, on the sender every batch). rec_mu orders
 * the record's writes: "in sync" (recorder) and "alone" (sender) never
 * overlap, so the last one written is the last one decided. s->mu guards
 * everything below it in the struct; it is taken with no core lock held
 * (and after rec_mu), and core calls (images) are made with it
 * released. */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "alloc.h"
#include "metrics.h"
#include "peer.h"
#include "replica.h"
#include "replica_send.h"
#include "tsan.h"
#include "wire.h"

#define FPS_RSEND_METHOD "/factorps.v1.ParameterServer/Replicate"
/* Payload bytes of one message: as large as the standby takes (both
 * replicas run with the same --max-message-bytes), less room for the
 * header, at most 32 MiB: the standby reads one message at a time, so
 * fewer, larger messages stall the stream fewer times. */
#define FPS_RSEND_PIECE_MAX ((uint64_t)32 << 20)
static uint64_t fps__rsend_piece(const fps_server_t *srv) {
  uint64_t m = srv->cfg.max_message_bytes;
  uint64_t lim = m > 131072 ? m - 65536 : m / 2;
  return lim < FPS_RSEND_PIECE_MAX ? lim : FPS_RSEND_PIECE_MAX;
}
#define FPS_RSEND_KEYS_PER_MSG 4096
#define FPS_RSEND_HEARTBEAT_NS (INT64_C(100) * 1000000)
#define FPS_RSEND_RETRY_NS (INT64_C(200) * 1000000)

/* One tensor's marks. */
typedef struct fps_rtrack_s {
  fps_tensor_t *t;
  uint64_t gen;               /* marks so far */
  uint64_t acked;             /* the generation the standby acknowledged */
  bool dirty;                 /* marked since its last image was taken */
  bool mark_known;            /* the last mark named its version: */
  uint64_t mark_ver;          /* this one */
} fps_rtrack_t;

/* A call waiting for the ack. */
typedef struct fps_rwait_s {
  size_t n;
  fps_tensor_t **track;       /* by tensor: the track table may be rehashed */
  uint64_t *gen;              /* the generation each must reach */
  uint64_t key_ticket;        /* 0: no key */
  fps_rsend_done_fn done;
  void *arg;
  struct fps_rwait_s *next;
} fps_rwait_t;

/* A message sent and not acknowledged yet: what its ack settles. */
typedef struct fps_rflight_s {
  uint64_t seq;
  size_t n;
  fps_tensor_t **track;       /* by tensor: the track table may be rehashed */
  uint64_t *gen;
  uint64_t key_ticket;        /* keys up to this ticket, 0: none */
  struct fps_rflight_s *next;
} fps_rflight_t;

/* A key queued for the stream. */
typedef struct fps_rqkey_s {
  uint32_t worker;
  uint64_t id, tensors, ticket;
  uint32_t n;
  uint64_t *v;
  struct fps_rqkey_s *next;
} fps_rqkey_t;

struct fps_rsend_s {
  fps_server_t *srv;
  fps_rsend_owner_t own;        /* the replica (replica.c) */
  grpc_channel *ch;
  char *auth_header;
  grpc_metadata auth_md;
  grpc_completion_queue *cq;  /* pluck: the two threads take their own tags */
  pthread_t send_th, recv_th, rec_th;
  bool threads_on;
  pthread_mutex_t rec_mu;     /* held across a write of the sync record */

  pthread_mutex_t mu;
  pthread_cond_t cv;          /* CLOCK_MONOTONIC: any change below */
  bool quit;
  uint64_t want_term;         /* 0: no stream wanted */
  grpc_call *call;            /* the stream, NULL: none */
  uint64_t call_gen;          /* bumped per stream (the receiver's cue) */
  bool recv_busy;             /* the receiver uses call */
  bool streaming;             /* the stream is up: marks go to it */
  bool broken;                /* the receiver saw the stream end */
  /* The lease's sync record (lease.h): alone_ok while it says "alone"
   * (or the backend keeps none), so the primary may answer without a
   * standby; recorded once it says "in sync" for this stream. sync_seq:
   * the commit whose ack proves the standby has everything answered
   * alone before it joined (0: not sent yet); want_sync_mark: the next
   * batch is that commit. */
  bool alone_ok;
  bool recorded;
  bool record_due;            /* the recorder's cue: "in sync" for the stream */
  uint64_t record_gen;        /* of call_gen */
  bool want_sync_mark;
  uint64_t sync_seq;
  bool joined;                /* the standby acknowledged the transfer */
  uint64_t term;              /* of the stream */
  uint64_t seq;               /* last seq sent */
  uint64_t done_seq;          /* seq of transfer_done, 0: not sent */
  uint64_t acked;             /* highest seq acknowledged */
  fps_rtrack_t *tracks;       /* open addressing by tensor pointer */
  size_t ntracks, cap;
  bool any_dirty;
  fps_rqkey_t *keys, *keys_last; /* keys queued, oldest first */
  uint64_t key_ticket;        /* last ticket handed out */
  uint64_t key_acked;         /* keys acknowledged up to this ticket */
  fps_rwait_t *waits;
  fps_rflight_t *flight, *flight_last;
};

/* ------------------------------------------------------------- tracks */

static size_t fps__track_hash(const fps_tensor_t *t, size_t cap) {
  return (size_t)(((uintptr_t)t * UINT64_C(0x9E3779B97F4A7C15)) >> 17) & (cap - 1);
}

/* The index of t's track, made if missing; SIZE_MAX on OOM. REQUIRES mu. */
static size_t fps__track_locked(fps_rsend_t *s, fps_tensor_t *t) {
  if (2 * (s->ntracks + 1) > s->cap) {
    size_t ncap = s->cap ? 2 * s->cap : 64;
    fps_rtrack_t *nt = fps_calloc(ncap, sizeof *nt);
    if (!nt) return SIZE_MAX;
    for (size_t i = 0; i < s->cap; i++) {
      if (!s->tracks[i].t) continue;
      size_t j = fps__track_hash(s->tracks[i].t, ncap);
      while (nt[j].t) j = (j + 1) & (ncap - 1);
      nt[j] = s->tracks[i];
    }
    fps_free(s->tracks);
    s->tracks = nt;
    s->cap = ncap;
  }
  size_t j = fps__track_hash(t, s->cap);
  while (s->tracks[j].t && s->tracks[j].t != t) j = (j + 1) & (s->cap - 1);
  if (!s->tracks[j].t) {
    s->tracks[j].t = t;
    s->ntracks++;
  }
  return j;
}

/* t's track; SIZE_MAX if it has none. REQUIRES mu. */
static size_t fps__track_find_locked(const fps_rsend_t *s, const fps_tensor_t *t) {
  if (!s->cap) return SIZE_MAX;
  size_t j = fps__track_hash(t, s->cap);
  while (s->tracks[j].t && s->tracks[j].t != t) j = (j + 1) & (s->cap - 1);
  return s->tracks[j].t ? j : SIZE_MAX;
}

/* ---------------------------------------------------------- the waits */

typedef struct fps_rdone_s {
  fps_rsend_done_fn done;
  void *arg;
  struct fps_rdone_s *next;
} fps_rdone_t;

static bool fps__wait_met_locked(const fps_rsend_t *s, const fps_rwait_t *w) {
  for (size_t k = 0; k < w->n; k++) {
    size_t j = fps__track_find_locked(s, w->track[k]);
    if (j == SIZE_MAX || s->tracks[j].acked < w->gen[k]) return false;
  }
  return w->key_ticket <= s->key_acked;
}

static void fps__wait_free(fps_rwait_t *w) {
  fps_free(w->track);
  fps_free(w->gen);
  fps_free(w);
}

/* Unlinks the waits that are met (all: every one), returns them. */
static fps_rwait_t *fps__waits_take_locked(fps_rsend_t *s, bool all) {
  fps_rwait_t *out = NULL, **pp = &s->waits;
  while (*pp) {
    fps_rwait_t *w = *pp;
    if (all || fps__wait_met_locked(s, w)) {
      *pp = w->next;
      w->next = out;
      out = w;
    } else {
      pp = &w->next;
    }
  }
  return out;
}

static void fps__waits_run(fps_rwait_t *list, int err, const char *why) {
  while (list) {
    fps_rwait_t *w = list;
    list = w->next;
    w->done(w->arg, err, why);
    fps__wait_free(w);
  }
}

int fps_rsend_wait(fps_rsend_t *s, fps_tensor_t *const *t, const uint64_t *ver, const bool *changed, size_t n,
                   const fps_rkey_t *key, fps_rsend_done_fn done, void *arg) {
  pthread_mutex_lock(&s->mu);
  if (!s->streaming && s->alone_ok) {
    pthread_mutex_unlock(&s->mu);
    return 0; /* nobody to tell: the primary answers alone */
  }
  if (!s->streaming) {
    /* The stream just ended and the lease still says "in sync": the
     * answer waits until "alone" is on record (the sender writes it). */
    fps_rwait_t *w0 = fps_calloc(1, sizeof *w0);
    if (!w0) {
      pthread_mutex_unlock(&s->mu);
      return FPS_ENOMEM;
    }
    w0->done = done;
    w0->arg = arg;
    w0->next = s->waits;
    s->waits = w0;
    pthread_mutex_unlock(&s->mu);
    return FPS_EAGAIN;
  }
  fps_rwait_t *w = s->joined ? fps_calloc(1, sizeof *w) : NULL;
  if (w) {
    w->track = fps_malloc((n ? n : 1) * sizeof *w->track);
    w->gen = fps_malloc((n ? n : 1) * sizeof *w->gen);
  }
  fps_rqkey_t *qk = key ? fps_calloc(1, sizeof *qk) : NULL;
  if (qk && key->n && !(qk->v = fps_malloc(key->n * sizeof *qk->v))) {
    fps_free(qk);
    qk = NULL;
  }
  if ((s->joined && (!w || !w->track || !w->gen)) || (key && !qk)) goto nomem;
  bool marked = false;
  for (size_t k = 0; k < n; k++) {
    size_t j = fps__track_locked(s, t[k]);
    if (j == SIZE_MAX) goto nomem;
    fps_rtrack_t *tr = &s->tracks[j];
    /* The last mark was for this very version: the image it brings
     * (taken after it, acknowledged or on its way) holds what this
     * answer reports. Any other change since (a replace) would have
     * marked it again. */
    bool named = ver && ver[k] != FPS_RSEND_UNNAMED;
    bool covered = named && !(changed && changed[k]) && tr->mark_known && tr->mark_ver == ver[k];
    if (!covered) {
      tr->gen++;
      tr->dirty = true;
      tr->mark_known = named;
      tr->mark_ver = named ? ver[k] : 0;
      marked = true;
    }
    if (w) {
      w->track[w->n] = t[k];
      w->gen[w->n++] = s->tracks[j].gen;
    }
  }
  s->any_dirty = s->any_dirty || marked;
  if (qk) {
    qk->worker = key->worker;
    qk->id = key->id;
    qk->tensors = key->tensors;
    qk->n = key->n;
    if (key->n) memcpy(qk->v, key->v, key->n * sizeof *qk->v);
    qk->ticket = ++s->key_ticket;
    if (s->keys_last) s->keys_last->next = qk;
    else s->keys = qk;
    s->keys_last = qk;
    if (w) w->key_ticket = qk->ticket;
  }
  pthread_cond_broadcast(&s->cv);
  if (!w) {
    pthread_mutex_unlock(&s->mu);
    return 0; /* a standby being brought up: it gets them, nobody waits */
  }
  if (!marked && !qk && fps__wait_met_locked(s, w)) {
    /* Covered by marks the standby already acknowledged: no ack is
     * coming for this wait to ride on. */
    pthread_mutex_unlock(&s->mu);
    fps__wait_free(w);
    return 0;
  }
  w->done = done;
  w->arg = arg;
  w->next = s->waits;
  s->waits = w;
  pthread_mutex_unlock(&s->mu);
  return FPS_EAGAIN;
nomem:
  pthread_mutex_unlock(&s->mu);
  if (w) fps__wait_free(w);
  if (qk) {
    fps_free(qk->v);
    fps_free(qk);
  }
  return FPS_ENOMEM;
}

/* ------------------------------------------------------------ sending */

/* One batch on the stream, waited for on this thread. */
static bool fps__rsend_batch(fps_rsend_t *s, grpc_call *call, grpc_op *ops, size_t n, void *tag) {
  if (grpc_call_start_batch(call, ops, n, tag, NULL) != GRPC_CALL_OK) return false;
  grpc_event ev = grpc_completion_queue_pluck(s->cq, tag, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
  return ev.type == GRPC_OP_COMPLETE && ev.success;
}

/* The next seq, for a message whose ack settles `f` (may be NULL; takes
 * it). */
static uint64_t fps__rsend_next_seq(fps_rsend_t *s, fps_rflight_t *f) {
  pthread_mutex_lock(&s->mu);
  uint64_t seq = ++s->seq;
  if (f) {
    f->seq = seq;
    if (s->flight_last) s->flight_last->next = f;
    else s->flight = f;
    s->flight_last = f;
  }
  fps_metrics_replication_lag_set(s->seq - s->acked);
  pthread_mutex_unlock(&s->mu);
  return seq;
}

/* Sends bb (NULL: out of memory; taken either way). */
static bool fps__rsend_bb(fps_rsend_t *s, grpc_call *call, grpc_byte_buffer *bb, uint64_t ops) {
  if (!bb) return false;
  size_t len = grpc_byte_buffer_length(bb);
  grpc_op op = {.op = GRPC_OP_SEND_MESSAGE};
  op.data.send_message.send_message = bb;
  bool ok = fps__rsend_batch(s, call, &op, 1, (void *)&s->send_th);
  grpc_byte_buffer_destroy(bb);
  if (ok) fps_metrics_replication_sent(len, ops);
  return ok;
}

/* Sends one ReplicateRequest with the next seq; its ack settles `f` (may
 * be NULL; takes it). */
static bool fps__rsend_msg(fps_rsend_t *s, grpc_call *call, Factorps__V1__ReplicateRequest *m, fps_rflight_t *f,
                           uint64_t ops) {
  m->seq = fps__rsend_next_seq(s, f);
  return fps__rsend_bb(s, call, fps_pack_message(m), ops);
}

/* An image's state copy, shared by the slices that send it: freed when
 * the last of them is dropped (gRPC may hold one after the send
 * completed, on any thread, as late as its teardown after the shard's:
 * so it holds nothing of the shard, fps_image_take_state). */
typedef struct fps_rstate_s {
  float *buf;
  atomic_int refs;
} fps_rstate_t;

static void fps__rstate_unref(void *p) {
  fps_rstate_t *st = p;
  FPS_TSAN_ACQUIRE(st);
  if (atomic_fetch_sub(&st->refs, 1) != 1) return;
  fps_free(st->buf);
  fps_free(st);
}

static void fps__rsend_snap_released(void *snap) {
  FPS_TSAN_ACQUIRE(snap); /* gRPC may drop the slice on any thread */
  fps_snap_unref(snap);
}

static void fps__rsend_buf_free(void *p, size_t len) {
  FPS_TSAN_ACQUIRE(p);
  (void)len;
  fps_free(p);
}

/* hparams -> AdafactorConfig with every field of the flavor present, so
 * the standby's fps_wire_hparams gives back the same struct. */
static void fps__rsend_config(const fps_adafactor_hparams_t *hp, Factorps__V1__AdafactorConfig *c) {
  factorps__v1__adafactor_config__init(c);
  bool hf = hp->flavor == FPS_FLAVOR_HF;
  c->flavor = hf ? FACTORPS__V1__FLAVOR__FLAVOR_HF : FACTORPS__V1__FLAVOR__FLAVOR_TORCH;
#define FPS__SET(field, CASE, v)                                   \
  do {                                                             \
    c->has_##field##_case = FACTORPS__V1__ADAFACTOR_CONFIG__HAS_##CASE##_##CASE; \
    c->field = (v);                                                \
  } while (0)
  if (!hf || hp->has_lr) FPS__SET(lr, LR, hp->lr);
  FPS__SET(beta2_decay, BETA2_DECAY, hp->decay);
  FPS__SET(eps1, EPS1, hp->eps1);
  FPS__SET(eps2, EPS2, hp->eps2);
  FPS__SET(clip_threshold, CLIP_THRESHOLD, hp->clip);
  FPS__SET(weight_decay, WEIGHT_DECAY, hp->weight_decay);
  if (!hf) {
    FPS__SET(maximize, MAXIMIZE, hp->maximize);
  } else {
    FPS__SET(relative_step, RELATIVE_STEP, hp->relative_step);
    FPS__SET(scale_parameter, SCALE_PARAMETER, hp->scale_parameter);
    FPS__SET(warmup_init, WARMUP_INIT, hp->warmup_init);
    if (hp->has_beta1) FPS__SET(beta1, BETA1, hp->beta1);
  }
#undef FPS__SET
}

/* A message of image pieces being put together: small tensors share one
 * message (each piece its own ReplicaTensor), a large one is cut across
 * several, so a batch is as few messages (and acks, and wakeups on both
 * sides) as the piece size allows. */
#define FPS_RSEND_PIECES_MAX 64
typedef struct fps_rmsg_s {
  size_t np;
  uint64_t bytes;             /* data bytes so far */
  uint64_t done;              /* images whose last piece is in it */
  Factorps__V1__ReplicaTensor rt[FPS_RSEND_PIECES_MAX];
  Factorps__V1__AdafactorConfig cfg[FPS_RSEND_PIECES_MAX];
  grpc_slice payload[FPS_RSEND_PIECES_MAX];
  /* A split block's map (views into its tensor, constant) and, on its
   * first piece, its last step (the partials owned here until packed). */
  Factorps__V1__SplitBlock sb[FPS_RSEND_PIECES_MAX];
  Factorps__V1__ReplicaSplitStep ss[FPS_RSEND_PIECES_MAX];
  ProtobufCBinaryData ssp[FPS_RSEND_PIECES_MAX][2];
  uint8_t *own[FPS_RSEND_PIECES_MAX][2];
} fps_rmsg_t;

static void fps__rmsg_free_own(fps_rmsg_t *q) {
  for (size_t i = 0; i < q->np; i++)
    for (int k = 0; k < 2; k++) {
      fps_free(q->own[i][k]);
      q->own[i][k] = NULL;
    }
}

static void fps__rmsg_drop(fps_rmsg_t *q) {
  for (size_t i = 0; i < q->np; i++) grpc_slice_unref(q->payload[i]);
  fps__rmsg_free_own(q);
  q->np = 0;
  q->bytes = q->done = 0;
}

/* The message as a byte buffer whose data is not copied: the framing
 * (the message's seq, each piece's ReplicaTensor without its data and
 * the key and length of its data) packed into one small buffer, cut into
 * a slice before each payload. Protobuf readers take fields in any order,
 * so the data may come last. Takes the payloads (q is empty after); NULL
 * on OOM. */
static grpc_byte_buffer *fps__rmsg_bb(fps_rmsg_t *q, uint64_t seq) {
  Factorps__V1__ReplicateRequest m = FACTORPS__V1__REPLICATE_REQUEST__INIT;
  m.seq = seq;
  size_t cap = protobuf_c_message_get_packed_size(&m.base);
  for (size_t i = 0; i < q->np; i++) cap += 32 + protobuf_c_message_get_packed_size(&q->rt[i].base);
  uint8_t *h = fps_malloc(cap);
  grpc_slice *sl = fps_malloc((2 * q->np + 1) * sizeof *sl);
  if (!h || !sl) {
    fps_free(h);
    fps_free(sl);
    fps__rmsg_drop(q);
    return NULL;
  }
  grpc_slice hdr = grpc_slice_new_with_len(h, cap, fps__rsend_buf_free);
  size_t hn = protobuf_c_message_pack(&m.base, h), mark = 0, nsl = 0;
  for (size_t i = 0; i < q->np; i++) {
    size_t len = GRPC_SLICE_LENGTH(q->payload[i]);
    size_t rt_len = protobuf_c_message_get_packed_size(&q->rt[i].base);
    uint8_t dh[16];
    size_t dhn = len ? fps_wire_put_len_field(dh, 12, len) : 0;
    hn += fps_wire_put_len_field(h + hn, 3, (uint64_t)rt_len + dhn + len);
    hn += protobuf_c_message_pack(&q->rt[i].base, h + hn);
    memcpy(h + hn, dh, dhn);
    hn += dhn;
    sl[nsl++] = grpc_slice_sub(hdr, mark, hn);
    mark = hn;
    if (len) sl[nsl++] = q->payload[i]; /* its reference goes to the buffer */
    else grpc_slice_unref(q->payload[i]);
  }
  if (nsl == 0) sl[nsl++] = grpc_slice_sub(hdr, 0, hn);
  /* After the last write into h: gRPC may free it on another thread. */
  FPS_TSAN_RELEASE(h);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(sl, nsl);
  for (size_t i = 0; i < nsl; i++) grpc_slice_unref(sl[i]);
  grpc_slice_unref(hdr);
  fps_free(sl);
  fps__rmsg_free_own(q); /* packed into h */
  q->np = 0;
  q->bytes = q->done = 0;
  return bb;
}

/* Sends q (if it holds anything) with the next seq; its ack settles f
 * (may be NULL; taken). */
static bool fps__rmsg_flush(fps_rsend_t *s, grpc_call *call, fps_rmsg_t *q, fps_rflight_t *f) {
  if (q->np == 0 && !f) return true;
  uint64_t done = q->done;
  uint64_t seq = fps__rsend_next_seq(s, f);
  return fps__rsend_bb(s, call, fps__rmsg_bb(q, seq), done);
}

/* Adds img's pieces to q, sending q whenever it is full; with f, img is
 * the only image and the message with its last piece is sent at once,
 * its ack settling f (taken; the transfer: its tensors are settled one by
 * one; the stream's images are settled by their batch's commit). No byte
 * of the image is copied: the parameters go to the socket from their
 * immutable snapshot, the state from the image's copy (taken from img,
 * shared by its pieces' slices). false: the stream failed. */
static bool fps__rsend_image(fps_rsend_t *s, grpc_call *call, fps_rmsg_t *q, fps_image_t *img, fps_rflight_t *f) {
  if (!img->params) {
    /* initialising: nothing acknowledged depends on its values yet */
    if (f) {
      fps_free(f->track);
      fps_free(f->gen);
      fps_free(f);
    }
    return true;
  }
  fps_rstate_t *st = NULL;
  if (img->state) {
    if (!(st = fps_malloc(sizeof *st))) return false;
    st->buf = fps_image_take_state(s->srv->shard, img);
    atomic_init(&st->refs, 1); /* this function's */
  }
  uint64_t pbytes = img->numel * 4, sbytes = img->total_state * 4, total = pbytes + sbytes;
  uint64_t budget = fps__rsend_piece(s->srv);
  bool ok = true;
  uint64_t off = 0;
  do {
    if (q->np == FPS_RSEND_PIECES_MAX || q->bytes >= budget) {
      if (!(ok = fps__rmsg_flush(s, call, q, NULL))) break;
    }
    /* A piece lies in the parameters or in the state, never across. */
    bool in_params = off < pbytes;
    const uint8_t *base = in_params ? (const uint8_t *)fps_snap_data(img->params)
                                    : (const uint8_t *)(st ? st->buf : NULL);
    uint64_t region_end = in_params ? pbytes : total;
    uint64_t rel = in_params ? off : off - pbytes;
    uint64_t room = budget - q->bytes;
    uint64_t len = region_end - off < room ? region_end - off : room;
    Factorps__V1__ReplicaTensor *rt = &q->rt[q->np];
    Factorps__V1__AdafactorConfig *cfg = &q->cfg[q->np];
    factorps__v1__replica_tensor__init(rt);
    q->own[q->np][0] = q->own[q->np][1] = NULL;
    fps__rsend_config(&img->hp, cfg);
    rt->name = (char *)img->name;
    rt->n_shape = img->shape->ndim;
    rt->shape = (uint64_t *)img->shape->dim;
    rt->config = cfg;
    rt->version = img->version;
    rt->step = img->step;
    rt->rms = img->rms;
    rt->last_lr = img->last_lr;
    rt->last_weight_decay = img->last_weight_decay;
    rt->n_state_elements = FPS_STATE_KINDS;
    rt->state_elements = (uint64_t *)img->n;
    rt->total_bytes = total;
    rt->offset = off;
    if (img->is_split) {
      Factorps__V1__SplitBlock *sb = &q->sb[q->np];
      factorps__v1__split_block__init(sb);
      sb->block_index = img->split.block_index;
      sb->n_bounds = img->split.n_bounds;
      sb->bounds = (uint64_t *)img->split.bounds;
      sb->n_block_shards = img->split.n_block_shards;
      sb->block_shards = (uint32_t *)img->split.block_shards;
      sb->shard_count = img->split.shard_count;
      rt->split = sb;
      rt->split_replaces = img->split_replaces;
    }
    if (img->is_split && img->xapplied && off == 0) {
      Factorps__V1__ReplicaSplitStep *ss = &q->ss[q->np];
      factorps__v1__replica_split_step__init(ss);
      ss->version = img->xversion;
      ss->attempt = img->xattempt;
      int n = img->xown[1] ? 2 : img->xown[0] ? 1 : 0;
      for (int k = 0; k < n; k++) {
        q->own[q->np][k] = img->xown[k]; /* the message's now */
        q->ssp[q->np][k] = (ProtobufCBinaryData){.len = img->xown_len[k], .data = img->xown[k]};
        img->xown[k] = NULL;
      }
      ss->n_partials = (size_t)n;
      ss->partials = q->ssp[q->np];
      rt->split_step = ss;
    }
    grpc_slice payload = grpc_empty_slice();
    if (len && in_params) {
      fps_snap_ref(img->params);
      FPS_TSAN_RELEASE(img->params);
      payload = grpc_slice_new_with_user_data((void *)(base + rel), len, fps__rsend_snap_released, img->params);
    } else if (len) {
      atomic_fetch_add(&st->refs, 1);
      FPS_TSAN_RELEASE(st);
      payload = grpc_slice_new_with_user_data((void *)(base + rel), len, fps__rstate_unref, st);
    }
    q->payload[q->np++] = payload;
    q->bytes += len;
    off += len;
  } while (off < total);
  if (ok) q->done++;
  /* The pieces hold their own references to the state copy. */
  if (st) fps__rstate_unref(st);
  if (ok && f) return fps__rmsg_flush(s, call, q, f);
  if (f) {
    fps_free(f->track);
    fps_free(f->gen);
    fps_free(f);
  }
  return ok;
}

/* The transfer's image of one tensor. */
static bool fps__rsend_tensor(fps_rsend_t *s, grpc_call *call, fps_rmsg_t *q, fps_tensor_t *t, uint64_t gen) {
  char why[FPS_WHY_MAX];
  fps_image_t img;
  int rc = fps_shard_image(s->srv->shard, t, &img, why, sizeof why);
  if (rc < 0) {
    fps_image_release(s->srv->shard, &img);
    if (rc == FPS_ESTATE) return true; /* not ready: nothing acknowledged depends on its values yet */
    FPS_LOG(FPS_LOG_WARN, "replica: %s; dropping the standby", why);
    return false;
  }
  fps_rflight_t *f = fps_calloc(1, sizeof *f);
  if (!f || !(f->track = fps_malloc(sizeof *f->track)) || !(f->gen = fps_malloc(sizeof *f->gen))) {
    if (f) fps_free(f->track);
    fps_free(f);
    fps_image_release(s->srv->shard, &img);
    return false;
  }
  f->n = 1;
  f->track[0] = t;
  f->gen[0] = gen;
  bool ok = fps__rsend_image(s, call, q, &img, f);
  fps_image_release(s->srv->shard, &img);
  return ok;
}

static void fps__rqkeys_free(fps_rqkey_t *list) {
  while (list) {
    fps_rqkey_t *nx = list->next;
    fps_free(list->v);
    fps_free(list);
    list = nx;
  }
}

/* The core's keys (fps_shard_images) put in front of *list as queued
 * keys (ticket 0: nobody waits on them); frees them. false: out of
 * memory (what was moved stays on *list). */
static bool fps__rqkeys_prepend_core(fps_rqkey_t **list, fps_key_rec_t *core) {
  bool ok = true;
  for (fps_key_rec_t *k = core; k && ok; k = k->next) {
    fps_rqkey_t *qk = fps_calloc(1, sizeof *qk);
    if (!(ok = qk != NULL)) break;
    qk->worker = k->worker;
    qk->id = k->id;
    qk->tensors = k->tensors;
    qk->n = k->n;
    qk->v = k->v;
    k->v = NULL;
    qk->next = *list;
    *list = qk;
  }
  fps_key_recs_free(core);
  return ok;
}

/* The queued keys, in messages of up to FPS_RSEND_KEYS_PER_MSG. */
static bool fps__rsend_keys(fps_rsend_t *s, grpc_call *call, fps_rqkey_t *list, bool settle) {
  bool ok = true;
  while (list && ok) {
    Factorps__V1__ReplicaKey kb[64], *kp[64];
    Factorps__V1__ReplicateRequest m = FACTORPS__V1__REPLICATE_REQUEST__INIT;
    size_t n = 0;
    uint64_t last = 0;
    fps_rqkey_t *sent = list;
    while (list && n < 64) {
      factorps__v1__replica_key__init(&kb[n]);
      kb[n].worker = list->worker;
      kb[n].push_id = list->id;
      kb[n].tensors = list->tensors;
      kb[n].n_versions = list->n;
      kb[n].versions = list->v;
      kp[n] = &kb[n];
      last = list->ticket;
      n++;
      list = list->next;
    }
    m.n_keys = n;
    m.keys = kp;
    fps_rflight_t *f = NULL;
    if (settle) {
      if (!(f = fps_calloc(1, sizeof *f))) {
        fps__rqkeys_free(sent); /* this batch and the rest after it */
        return false;
      }
      f->key_ticket = last;
    }
    ok = fps__rsend_msg(s, call, &m, f, n);
    while (sent != list) {
      fps_rqkey_t *nx = sent->next;
      fps_free(sent->v);
      fps_free(sent);
      sent = nx;
    }
  }
  fps__rqkeys_free(list);
  return ok;
}

/* The state transfer's keys: every applied key the window holds. */
typedef struct fps_rkeys_acc_s {
  fps_rqkey_t *first, *last;
  bool oom;
} fps_rkeys_acc_t;

static void fps__rsend_key_each(void *arg, uint32_t worker, uint64_t id, uint64_t tensors, const uint64_t *v,
                                uint32_t n) {
  fps_rkeys_acc_t *a = arg;
  fps_rqkey_t *k = fps_calloc(1, sizeof *k);
  if (!k || (n && !(k->v = fps_malloc(n * sizeof *k->v)))) {
    fps_free(k);
    a->oom = true;
    return;
  }
  k->worker = worker;
  k->id = id;
  k->tensors = tensors;
  k->n = n;
  if (n) memcpy(k->v, v, n * sizeof *k->v);
  if (a->last) a->last->next = k;
  else a->first = k;
  a->last = k;
}

/* The state transfer's closing cut. A push applied while the transfer
 * imaged the tensors has its key in the window the transfer sent, naming
 * versions newer than its tensors' transfer images. One cut between
 * pushes that names no tensor (fps_shard_images) images every tensor the
 * pushes applied since the transfer began changed, with their keys, and
 * goes before transfer_done: a standby that joins holds every key's
 * tensors at least at the versions the key names, so a retry after a
 * promotion is never answered from a key whose update it lacks. Part of
 * the transfer: the standby installs it at once. false: the stream
 * failed. */
static bool fps__rsend_transfer_cut(fps_rsend_t *s, grpc_call *call, fps_rmsg_t *q) {
  fps_image_t none; /* the images of no named tensor: an empty array */
  fps_key_rec_t *core_keys = NULL;
  fps_image_t *extra = NULL;
  size_t nextra = 0;
  char why[FPS_WHY_MAX];
  if (fps_shard_images(s->srv->shard, NULL, 0, &none, &core_keys, &extra, &nextra, why, sizeof why) < 0) {
    FPS_LOG(FPS_LOG_WARN, "replica: %s; dropping the standby", why);
    return false;
  }
  bool ok = true;
  for (size_t i = 0; i < nextra && ok; i++) ok = fps__rsend_image(s, call, q, &extra[i], NULL);
  if (ok) ok = fps__rmsg_flush(s, call, q, NULL);
  fps__rmsg_drop(q); /* what a failure left */
  for (size_t i = 0; i < nextra; i++) fps_image_release(s->srv->shard, &extra[i]);
  fps_free(extra);
  fps_rqkey_t *keys = NULL;
  if (!ok) {
    fps_key_recs_free(core_keys);
    return false;
  }
  if (!fps__rqkeys_prepend_core(&keys, core_keys)) {
    fps__rqkeys_free(keys);
    return false;
  }
  return fps__rsend_keys(s, call, keys, true);
}

/* Hello, the state transfer, then the changes until the stream fails or
 * is no longer wanted. */
static void fps__rsend_run_q(fps_rsend_t *s, grpc_call *call, uint64_t term, fps_rmsg_t *q) {
  fps_server_t *srv = s->srv;
  fps_shard_view_t v;
  const char *simd = "";
  bool have_view = fps_shard_view(srv->shard, false, 0, &v) == 0;
  if (have_view) simd = v.simd;
  Factorps__V1__ReplicateHello hello = FACTORPS__V1__REPLICATE_HELLO__INIT;
  hello.shard_id = srv->cfg.shard_id;
  hello.shard_count = srv->cfg.shard_count;
  hello.term = term;
  hello.mode = (Factorps__V1__Mode)srv->cfg.mode;
  hello.workers = srv->cfg.workers;
  hello.simd = (char *)simd;
  hello.primary = (char *)(*srv->cfg.replica_advertise ? srv->cfg.replica_advertise : srv->cfg.listen);
  Factorps__V1__ReplicateRequest m = FACTORPS__V1__REPLICATE_REQUEST__INIT;
  m.hello = &hello;
  bool ok = fps__rsend_msg(s, call, &m, NULL, 0);
  if (have_view) fps_shard_view_free(&v);
  if (!ok) return;

  /* The transfer. Marks made from here on are sent after it, and the
   * keys of pushes applied from here on with their images. */
  fps_shard_repl_keys(srv->shard, true);
  size_t n = fps_shard_tensors(srv->shard, NULL, 0);
  fps_tensor_t **ts = fps_malloc((n ? n : 1) * sizeof *ts);
  if (!ts) return;
  n = fps_shard_tensors(srv->shard, ts, n);
  for (size_t i = 0; i < n && ok; i++) {
    pthread_mutex_lock(&s->mu);
    size_t j = fps__track_locked(s, ts[i]);
    uint64_t gen = j == SIZE_MAX ? 0 : s->tracks[j].gen;
    if (j != SIZE_MAX) s->tracks[j].dirty = false; /* this image covers its marks */
    bool want = s->want_term == term;
    pthread_mutex_unlock(&s->mu);
    ok = want && j != SIZE_MAX && fps__rsend_tensor(s, call, q, ts[i], gen);
  }
  fps_free(ts);
  if (!ok) return;
  fps_rkeys_acc_t acc = {0};
  fps_shard_idem_each(srv->shard, fps__rsend_key_each, &acc);
  if (acc.oom) {
    fps__rqkeys_free(acc.first);
    return;
  }
  if (!fps__rsend_keys(s, call, acc.first, true) || !fps__rsend_transfer_cut(s, call, q)) return;
  Factorps__V1__ReplicateRequest done = FACTORPS__V1__REPLICATE_REQUEST__INIT;
  done.transfer_done = true;
  fps_rflight_t *f = fps_calloc(1, sizeof *f);
  if (!f) return;
  pthread_mutex_lock(&s->mu);
  s->done_seq = s->seq + 1; /* the seq this message gets */
  pthread_mutex_unlock(&s->mu);
  if (!fps__rsend_msg(s, call, &done, f, 0)) return;
  FPS_LOG(FPS_LOG_INFO, "replica: state transfer to %s sent (%zu tensors, term %" PRIu64 ")", srv->cfg.replica_peer, n,
          term);

  /* The changes. */
  for (;;) {
    pthread_mutex_lock(&s->mu);
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_nsec += FPS_RSEND_HEARTBEAT_NS;
    if (until.tv_nsec >= 1000000000L) {
      until.tv_sec++;
      until.tv_nsec -= 1000000000L;
    }
    int w = 0;
    while (s->want_term == term && s->call == call && !s->quit && !s->broken && !s->any_dirty && !s->keys &&
           !s->want_sync_mark && w == 0)
      w = pthread_cond_timedwait(&s->cv, &s->mu, &until);
    if (s->want_term != term || s->call != call || s->quit || s->broken) {
      pthread_mutex_unlock(&s->mu);
      return;
    }
    /* The dirty tensors with the generation their image will cover. */
    size_t nd = 0;
    fps_tensor_t **dt = NULL;
    uint64_t *dg = NULL;
    if (s->any_dirty) {
      dt = fps_malloc(s->ntracks * sizeof *dt);
      dg = fps_malloc(s->ntracks * sizeof *dg);
      if (dt && dg)
        for (size_t j = 0; j < s->cap; j++)
          if (s->tracks[j].t && s->tracks[j].dirty) {
            s->tracks[j].dirty = false;
            dt[nd] = s->tracks[j].t;
            dg[nd++] = s->tracks[j].gen;
          }
      s->any_dirty = !(dt && dg);
    }
    fps_rqkey_t *keys = s->keys;
    bool had_keys = keys != NULL;
    bool mark = s->want_sync_mark; /* this batch's commit is sync_seq */
    s->want_sync_mark = false;
    s->keys = s->keys_last = NULL;
    pthread_mutex_unlock(&s->mu);
    /* Images first, then the keys: a retry answered from a key finds the
     * tensors it names at least at the versions the key records. */
    uint64_t ticket = 0;
    for (fps_rqkey_t *k = keys; k; k = k->next) ticket = k->ticket;
    /* One cut of all the batch's tensors, between pushes, with the keys
     * of the pushes it holds and the tensors they changed
     * (fps_shard_images). */
    fps_image_t *imgs = nd ? fps_calloc(nd, sizeof *imgs) : NULL, *extra = NULL;
    size_t nextra = 0;
    fps_key_rec_t *core_keys = NULL;
    char why[FPS_WHY_MAX];
    if (nd && !imgs) ok = false;
    if (ok && nd) {
      int rc = fps_shard_images(srv->shard, dt, nd, imgs, &core_keys, &extra, &nextra, why, sizeof why);
      if (rc < 0) {
        FPS_LOG(FPS_LOG_WARN, "replica: %s; dropping the standby", why);
        ok = false;
      }
    }
    /* Tensors of the core's keys that no mark named yet: their state goes
     * with the keys, and counts as a mark of the version imaged, settled
     * by this batch's commit: the answers that come for that version
     * (fps_rsend_wait's ver) wait for it instead of imaging them again. */
    fps_tensor_t **xt = NULL;
    uint64_t *xg = NULL;
    size_t nx = 0;
    if (ok && nextra) {
      xt = fps_malloc(nextra * sizeof *xt);
      xg = fps_malloc(nextra * sizeof *xg);
      pthread_mutex_lock(&s->mu);
      for (size_t i = 0; xt && xg && i < nextra; i++) {
        size_t j = extra[i].params ? fps__track_locked(s, extra[i].t) : SIZE_MAX;
        if (j == SIZE_MAX) continue; /* not marked: an answer for it images it again */
        fps_rtrack_t *tr = &s->tracks[j];
        tr->gen++;
        tr->mark_known = true;
        tr->mark_ver = extra[i].version;
        xt[nx] = extra[i].t;
        xg[nx++] = tr->gen;
      }
      pthread_mutex_unlock(&s->mu);
    }
    for (size_t i = 0; i < nd && ok; i++) ok = fps__rsend_image(s, call, q, &imgs[i], NULL);
    for (size_t i = 0; i < nextra && ok; i++) ok = fps__rsend_image(s, call, q, &extra[i], NULL);
    if (ok) ok = fps__rmsg_flush(s, call, q, NULL);
    fps__rmsg_drop(q); /* what a failure left */
    for (size_t i = 0; imgs && i < nd; i++) fps_image_release(srv->shard, &imgs[i]);
    for (size_t i = 0; i < nextra; i++) fps_image_release(srv->shard, &extra[i]);
    fps_free(imgs);
    fps_free(extra);
    /* The core's keys as queued keys (ticket 0: nobody waits on them). */
    if (core_keys) {
      had_keys = true;
      if (ok) ok = fps__rqkeys_prepend_core(&keys, core_keys);
      else fps_key_recs_free(core_keys);
    }
    if (ok && keys) ok = fps__rsend_keys(s, call, keys, false);
    else fps__rqkeys_free(keys);
    if (ok && (nd || had_keys || mark)) {
      /* The batch takes effect on the standby at once: what one push
       * changed is there entirely or not at all. Its ack settles it. */
      fps_rflight_t *cf = fps_calloc(1, sizeof *cf);
      if (cf && nd + nx) {
        cf->track = fps_malloc((nd + nx) * sizeof *cf->track);
        cf->gen = fps_malloc((nd + nx) * sizeof *cf->gen);
      }
      if (!cf || (nd + nx && (!cf->track || !cf->gen))) {
        if (cf) {
          fps_free(cf->track);
          fps_free(cf->gen);
        }
        fps_free(cf);
        ok = false;
      } else {
        for (size_t i = 0; i < nd; i++) {
          cf->track[i] = dt[i];
          cf->gen[i] = dg[i];
        }
        for (size_t i = 0; i < nx; i++) {
          cf->track[nd + i] = xt[i];
          cf->gen[nd + i] = xg[i];
        }
        cf->n = nd + nx;
        cf->key_ticket = ticket;
        Factorps__V1__ReplicateRequest cm = FACTORPS__V1__REPLICATE_REQUEST__INIT;
        cm.commit = true;
        ok = fps__rsend_msg(s, call, &cm, cf, 0);
        if (ok && mark) {
          pthread_mutex_lock(&s->mu);
          s->sync_seq = cm.seq;
          pthread_mutex_unlock(&s->mu);
        }
      }
    }
    fps_free(dt);
    fps_free(xt);
    fps_free(xg);
    fps_free(dg);
    if (ok && nd == 0 && !had_keys && w != 0) {
      Factorps__V1__ReplicateRequest hb = FACTORPS__V1__REPLICATE_REQUEST__INIT;
      ok = fps__rsend_msg(s, call, &hb, NULL, 0);
    }
    if (!ok) return;
  }
}

static void fps__rsend_run(fps_rsend_t *s, grpc_call *call, uint64_t term) {
  fps_rmsg_t *q = fps_malloc(sizeof *q);
  if (!q) return;
  q->np = 0;
  q->bytes = q->done = 0;
  fps__rsend_run_q(s, call, term, q);
  fps__rmsg_drop(q);
  fps_free(q);
}

/* ---------------------------------------------------------- receiving */

/* An ack: settles the flights up to it, wakes the waits it met. */
static void fps__rsend_acked(fps_rsend_t *s, grpc_call *call, uint64_t acked) {
  pthread_mutex_lock(&s->mu);
  if (s->call != call || acked <= s->acked || acked > s->seq) {
    pthread_mutex_unlock(&s->mu);
    return;
  }
  s->acked = acked;
  while (s->flight && s->flight->seq <= acked) {
    fps_rflight_t *f = s->flight;
    s->flight = f->next;
    if (!s->flight) s->flight_last = NULL;
    for (size_t k = 0; k < f->n; k++) {
      size_t j = fps__track_find_locked(s, f->track[k]);
      if (j != SIZE_MAX && s->tracks[j].acked < f->gen[k]) s->tracks[j].acked = f->gen[k];
    }
    if (f->key_ticket > s->key_acked) s->key_acked = f->key_ticket;
    fps_free(f->track);
    fps_free(f->gen);
    fps_free(f);
  }
  bool joined_now = !s->joined && s->done_seq && acked >= s->done_seq;
  if (joined_now) {
    s->joined = true;
    s->want_sync_mark = true; /* the next batch's ack proves it caught up */
    pthread_cond_broadcast(&s->cv);
  }
  if (!s->recorded && !s->record_due && s->sync_seq && acked >= s->sync_seq) {
    s->record_due = true; /* the recorder writes "in sync" */
    s->record_gen = s->call_gen;
    pthread_cond_broadcast(&s->cv);
  }
  fps_rwait_t *met = fps__waits_take_locked(s, false);
  uint64_t term = s->term;
  fps_metrics_replication_lag_set(s->seq - s->acked);
  pthread_mutex_unlock(&s->mu);
  if (joined_now) {
    fps_role_primary_joined(s->own.role, term, true);
    s->own.publish(s->own.arg);
    FPS_LOG(FPS_LOG_INFO, "replica: standby %s joined (term %" PRIu64 ")", s->srv->cfg.replica_peer, term);
  }
  fps__waits_run(met, 0, NULL);
}

/* "term T is older than U": the standby has seen a newer primary. */
static uint64_t fps__rsend_newer_term(const char *details) {
  const char *p = strstr(details, "is older than ");
  return p ? strtoull(p + sizeof "is older than " - 1, NULL, 10) : 0;
}

static void *fps__rsend_recv_main(void *arg) {
  fps_rsend_t *s = arg;
  uint64_t seen_gen = 0;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->quit && (s->call == NULL || s->call_gen == seen_gen)) pthread_cond_wait(&s->cv, &s->mu);
    if (s->quit) break;
    grpc_call *call = s->call;
    seen_gen = s->call_gen;
    s->recv_busy = true;
    pthread_mutex_unlock(&s->mu);
    grpc_metadata_array init_md;
    grpc_metadata_array_init(&init_md);
    bool ended = false;
    for (bool first = true;; first = false) {
      grpc_byte_buffer *bb = NULL;
      /* The first receive takes the initial metadata with it: the C core
       * wants it received before a message. */
      grpc_op ops[2] = {{.op = GRPC_OP_RECV_INITIAL_METADATA}, {.op = GRPC_OP_RECV_MESSAGE}};
      ops[0].data.recv_initial_metadata.recv_initial_metadata = &init_md;
      ops[1].data.recv_message.recv_message = &bb;
      bool ok = fps__rsend_batch(s, call, first ? ops : ops + 1, first ? 2 : 1, (void *)&s->recv_th);
      if (!ok || !bb) {
        ended = true; /* the standby (or the transport) ended it: its status says why */
        break;
      }
      uint8_t *flat = NULL;
      size_t len = 0;
      Factorps__V1__ReplicateResponse *resp = NULL;
      if (fps_bb_flatten(bb, 1 << 20, &flat, &len) == 0)
        resp = factorps__v1__replicate_response__unpack(&fps_wire_allocator, len, flat);
      fps_free(flat);
      grpc_byte_buffer_destroy(bb);
      if (!resp) break;
      uint64_t acked = resp->acked, term = resp->term;
      protobuf_c_message_free_unpacked(&resp->base, &fps_wire_allocator);
      if (term > s->term && fps_role_fence(s->own.role, term)) break;
      fps__rsend_acked(s, call, acked);
    }
    grpc_metadata_array_destroy(&init_md);
    /* The stream is over: why? */
    grpc_metadata_array trail;
    grpc_metadata_array_init(&trail);
    grpc_status_code status = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    grpc_op op = {.op = GRPC_OP_RECV_STATUS_ON_CLIENT};
    op.data.recv_status_on_client.trailing_metadata = &trail;
    op.data.recv_status_on_client.status = &status;
    op.data.recv_status_on_client.status_details = &details;
    /* Cancelled only when this side ends it: a cancel before the status
     * is read would replace the standby's own (a newer term's refusal). */
    if (!ended) grpc_call_cancel(call, NULL);
    bool got = fps__rsend_batch(s, call, &op, 1, (void *)&s->recv_th);
    char msg[512];
    char *d = grpc_slice_to_c_string(details);
    snprintf(msg, sizeof msg, "%s", got && d ? d : "the stream ended");
    gpr_free(d);
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(&trail);
    uint64_t newer = got && status == GRPC_STATUS_FAILED_PRECONDITION ? fps__rsend_newer_term(msg) : 0;
    if (newer && fps_role_fence(s->own.role, newer))
      FPS_LOG(FPS_LOG_WARN, "replica: the standby has seen term %" PRIu64 ": this primary steps down", newer);
    else if (got && status != GRPC_STATUS_OK && status != GRPC_STATUS_CANCELLED)
      FPS_LOG(FPS_LOG_WARN, "replica: standby %s refused the stream: %s", s->srv->cfg.replica_peer, msg);
    pthread_mutex_lock(&s->mu);
    s->recv_busy = false;
    if (s->call == call) s->broken = true;
    pthread_cond_broadcast(&s->cv);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

/* Writes "in sync" when an ack proved the standby caught up (record_due),
 * for that stream only. */
static void *fps__rsend_rec_main(void *arg) {
  fps_rsend_t *s = arg;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->quit && !s->record_due) pthread_cond_wait(&s->cv, &s->mu);
    if (s->quit) break;
    s->record_due = false;
    uint64_t gen = s->record_gen;
    pthread_mutex_unlock(&s->mu);
    pthread_mutex_lock(&s->rec_mu);
    pthread_mutex_lock(&s->mu);
    bool write = s->call && s->call_gen == gen && s->streaming && !s->recorded;
    if (write) {
      s->recorded = true;
      s->alone_ok = false; /* from now on no answer without the standby */
    }
    pthread_mutex_unlock(&s->mu);
    if (write && s->own.set_sync(s->own.arg, true) < 0) {
      /* Maybe not on record (an etcd write that timed out may still have
       * been applied): tried again at the next ack, and alone_ok stays
       * off, so a stream that ends meanwhile puts "alone" on record
       * before anything is answered alone. */
      pthread_mutex_lock(&s->mu);
      if (s->call_gen == gen) s->recorded = false;
      pthread_mutex_unlock(&s->mu);
    }
    pthread_mutex_unlock(&s->rec_mu);
    pthread_mutex_lock(&s->mu);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

/* The stream went away: the waits are released (the primary goes on
 * alone while it may acknowledge) and the marks start over. REQUIRES mu;
 * returns the waits to run. */
static fps_rwait_t *fps__rsend_reset_locked(fps_rsend_t *s) {
  fps_shard_repl_keys(s->srv->shard, false); /* a leaf lock of the core */
  s->streaming = false;
  s->joined = false;
  s->done_seq = 0;
  s->recorded = false;
  s->record_due = false;
  s->want_sync_mark = false;
  s->sync_seq = 0;
  s->seq = s->acked = 0;
  while (s->flight) {
    fps_rflight_t *f = s->flight;
    s->flight = f->next;
    fps_free(f->track);
    fps_free(f->gen);
    fps_free(f);
  }
  s->flight_last = NULL;
  fps__rqkeys_free(s->keys);
  s->keys = s->keys_last = NULL;
  s->key_acked = s->key_ticket;
  for (size_t j = 0; j < s->cap; j++) {
    s->tracks[j].dirty = false;
    s->tracks[j].mark_known = false;
    s->tracks[j].acked = s->tracks[j].gen;
  }
  s->any_dirty = false;
  fps_metrics_replication_lag_set(0);
  return fps__waits_take_locked(s, true);
}

static void *fps__rsend_send_main(void *arg) {
  fps_rsend_t *s = arg;
  pthread_mutex_lock(&s->mu);
  while (!s->quit) {
    if (s->want_term == 0) {
      pthread_cond_wait(&s->cv, &s->mu);
      continue;
    }
    uint64_t term = s->want_term;
    pthread_mutex_unlock(&s->mu);
    grpc_call *call = grpc_channel_create_call(s->ch, NULL, GRPC_PROPAGATE_DEFAULTS, s->cq,
                                               grpc_slice_from_static_string(FPS_RSEND_METHOD), NULL,
                                               gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    bool ok = call != NULL;
    if (ok) {
      grpc_op op = {.op = GRPC_OP_SEND_INITIAL_METADATA};
      op.data.send_initial_metadata.count = s->auth_header ? 1 : 0;
      op.data.send_initial_metadata.metadata = s->auth_header ? &s->auth_md : NULL;
      ok = fps__rsend_batch(s, call, &op, 1, (void *)&s->send_th);
    }
    pthread_mutex_lock(&s->mu);
    if (ok && s->want_term == term && !s->quit) {
      s->call = call;
      s->call_gen++;
      s->term = term;
      s->streaming = true; /* marks from now on go to this stream */
      s->broken = false;
      pthread_cond_broadcast(&s->cv);
      pthread_mutex_unlock(&s->mu);
      fps__rsend_run(s, call, term);
      pthread_mutex_lock(&s->mu);
    }
    /* Over. If the standby ended the stream, the receiver reads its
     * status first (a newer term's refusal must not turn into a local
     * CANCELLED), within 0.5 s; then the call is cancelled, the receiver
     * lets go of it, and it is freed. */
    if (call && s->call == call) {
      struct timespec until;
      clock_gettime(CLOCK_MONOTONIC, &until);
      until.tv_nsec += 500 * 1000000L;
      if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
      }
      while (!s->broken && s->recv_busy && s->want_term == term && !s->quit &&
             pthread_cond_timedwait(&s->cv, &s->mu, &until) == 0) {
      }
    }
    if (call) grpc_call_cancel(call, NULL);
    while (s->call == call && call && s->recv_busy) pthread_cond_wait(&s->cv, &s->mu);
    bool was = s->call == call && call;
    s->call = NULL;
    fps_rwait_t *released = was ? fps__rsend_reset_locked(s) : NULL;
    pthread_mutex_unlock(&s->mu);
    if (was) {
      fps_role_primary_joined(s->own.role, term, false);
      s->own.publish(s->own.arg);
    }
    if (call) grpc_call_unref(call);
    /* No stream (dropped, or none came up): before anything is answered
     * alone, the lease says so ("alone"), so that the standby, if it is
     * promoted later without what is answered from now on, knows it
     * (REPLICA.md CHANGED 08:15). Then the waits go: answered alone, or
     * refused if this process may not answer or the record failed. */
    pthread_mutex_lock(&s->rec_mu); /* after an "in sync" being written */
    pthread_mutex_lock(&s->mu);
    bool need = !s->alone_ok && s->want_term == term && !s->quit;
    pthread_mutex_unlock(&s->mu);
    char why[512] = "";
    int err = 0;
    if (need) {
      if (s->own.set_sync(s->own.arg, false) < 0) {
        err = FPS_EUNAVAILABLE;
        snprintf(why, sizeof why, "shard %u lost its standby and cannot record that in its lease; not answering "
                 "alone", s->srv->cfg.shard_id);
      } else {
        FPS_LOG(FPS_LOG_WARN, "replica: standby %s dropped; answering alone (recorded in the lease)",
                s->srv->cfg.replica_peer);
        pthread_mutex_lock(&s->mu);
        s->alone_ok = true;
        pthread_mutex_unlock(&s->mu);
      }
    }
    pthread_mutex_unlock(&s->rec_mu);
    pthread_mutex_lock(&s->mu);
    fps_rwait_t *more = !s->streaming ? fps__waits_take_locked(s, true) : NULL;
    pthread_mutex_unlock(&s->mu);
    if (err == 0 && (released || more)) err = s->own.refusal(s->own.arg, why, sizeof why);
    fps__waits_run(released, err, why);
    fps__waits_run(more, err, why);
    pthread_mutex_lock(&s->mu);
    if (s->want_term == term && !s->quit) {
      struct timespec until;
      clock_gettime(CLOCK_MONOTONIC, &until);
      until.tv_nsec += FPS_RSEND_RETRY_NS;
      if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
      }
      while (s->want_term == term && !s->quit && pthread_cond_timedwait(&s->cv, &s->mu, &until) == 0) {
      }
    }
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

/* ------------------------------------------------------------ control */

int fps_rsend_create(fps_server_t *srv, const fps_rsend_owner_t *owner, fps_rsend_t **out) {
  *out = NULL;
  fps_rsend_t *s = fps_calloc(1, sizeof *s);
  if (!s) return FPS_ENOMEM;
  s->srv = srv;
  s->own = *owner;
  pthread_mutex_init(&s->mu, NULL);
  pthread_mutex_init(&s->rec_mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->cv, &ca);
  pthread_condattr_destroy(&ca);
  int rc = fps_peer_channel(&srv->cfg, srv->cfg.replica_peer, &s->ch, &s->auth_header);
  if (rc < 0) goto fail;
  if (s->auth_header) {
    s->auth_md.key = grpc_slice_from_static_string("authorization");
    s->auth_md.value = grpc_slice_from_static_string(s->auth_header);
  }
  rc = FPS_ENOMEM;
  if (!(s->cq = grpc_completion_queue_create_for_pluck(NULL))) goto fail;
  if (pthread_create(&s->send_th, NULL, fps__rsend_send_main, s) != 0) goto fail;
  bool recv_on = pthread_create(&s->recv_th, NULL, fps__rsend_recv_main, s) == 0;
  if (!recv_on || pthread_create(&s->rec_th, NULL, fps__rsend_rec_main, s) != 0) {
    pthread_mutex_lock(&s->mu);
    s->quit = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->send_th, NULL);
    if (recv_on) pthread_join(s->recv_th, NULL);
    goto fail;
  }
  s->threads_on = true;
  *out = s;
  return 0;
fail:
  if (s->cq) grpc_completion_queue_destroy(s->cq);
  if (s->ch) grpc_channel_destroy(s->ch);
  fps_free(s->auth_header);
  pthread_mutex_destroy(&s->mu);
  pthread_mutex_destroy(&s->rec_mu);
  pthread_cond_destroy(&s->cv);
  fps_free(s);
  return rc;
}

void fps_rsend_start_stream(fps_rsend_t *s, uint64_t term) {
  pthread_mutex_lock(&s->mu);
  s->want_term = term;
  s->alone_ok = true; /* the promotion put "alone" on record */
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

void fps_rsend_stop_stream(fps_rsend_t *s, const char *why) {
  if (!s) return;
  pthread_mutex_lock(&s->mu);
  s->want_term = 0;
  /* The waits fail now: whatever the stream does next, they may not be
   * acknowledged by a process that is stepping down. */
  fps_rwait_t *w = fps__waits_take_locked(s, true);
  if (s->call) grpc_call_cancel(s->call, NULL);
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  fps__waits_run(w, FPS_EUNAVAILABLE, why);
}

void fps_rsend_destroy(fps_rsend_t *s) {
  if (!s) return;
  fps_rsend_stop_stream(s, "the shard is shutting down");
  pthread_mutex_lock(&s->mu);
  s->quit = true;
  if (s->call) grpc_call_cancel(s->call, NULL);
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  if (s->threads_on) {
    pthread_join(s->send_th, NULL);
    pthread_join(s->recv_th, NULL);
    pthread_join(s->rec_th, NULL);
  }
  /* Both threads took every completion of their batches: nothing is
   * left on the queue. */
  grpc_completion_queue_shutdown(s->cq);
  grpc_completion_queue_destroy(s->cq);
  grpc_channel_destroy(s->ch);
  fps_free(s->auth_header);
  fps__rqkeys_free(s->keys);
  fps_free(s->tracks);
  pthread_mutex_destroy(&s->mu);
  pthread_mutex_destroy(&s->rec_mu);
  pthread_cond_destroy(&s->cv);
  fps_free(s);
}
