/* fps_client_push_pull() and fps_client_pull().
 *
 * One streaming call per shard that holds any of the named tensors. The
 * request side walks the shard's tensors in the caller's order and cuts
 * them into slices so that no message exceeds max_message_bytes; small
 * tensors share a message. Messages are built without copying gradients:
 * small header slices interleaved with slices over the caller's floats,
 * which gRPC writes to the socket directly; two messages at most are built
 * ahead per shard.
 * The reply side decodes each message as it arrives, in the buffers gRPC
 * received it in (wire.c), and decodes each parameter slice straight from
 * them into the caller's buffer at its offset: one pass per byte. After an
 * OK status every tensor must have been covered exactly once and have a
 * version, or the call fails with DATA_LOSS: a caller never sees a
 * half-written tensor reported as success.
 *
 * Aliasing params[i] == grads[i] is safe: a shard can only answer for a
 * tensor after it received all of its gradient, so the bytes gRPC read
 * from the caller's buffer were on the wire before the reply overwrites
 * them.
 *
 * A split tensor is one item per row block: block b's part of
 * the caller's arrays (elements [lo*C, hi*C)) goes to and comes from its
 * shard at block-local offsets. All of a tensor's blocks must report the
 * same version; see check_versions(). */
#include <grpc/byte_buffer.h>
#include <grpc/slice.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "alloc.h"
#include "dtype.h"
#include "factorps/v1/factorps.pb-c.h"
#include <stdatomic.h>
#include <sys/random.h>
#include <unistd.h>

#include "internal.h"
#include "tsan.h"

/* One tensor, or one row block of a split tensor, on one shard. */
typedef struct pp_item_s {
  const fps__tensor_t *t;               /* in the client's list */
  size_t idx;                           /* index in the caller's arrays */
  int shard;
  uint32_t block;                       /* block index (0: whole) */
  uint64_t base;                        /* its first element in the caller's arrays */
  uint64_t numel;                       /* its elements */
  /* The reply (reset for a retry). */
  uint64_t received;                    /* elements */
  uint64_t version;
  int got_version;
} pp_item_t;

typedef struct pp_job_s {
  fps_client_t *c;
  const float *const *grads;            /* NULL for Pull */
  float *const *params;
  uint64_t *versions;
  uint32_t worker_id;
  uint64_t step;
  uint32_t num_workers;                 /* 0: unchecked */
  int expect_mode;                      /* 0: any */
  const fps_tensor_push_t *per;         /* per caller index, or NULL */
  uint64_t push_id;                     /* idempotency key of this push, 0: none */
  int dtype;                            /* gradients' wire dtype (FPS_DTYPE_*) */
  uint64_t esz;                         /* its bytes per element */
  pthread_mutex_t mu;                   /* guards live_slices */
  pthread_cond_t cv;
  size_t live_slices;                   /* data slices gRPC still holds */
} pp_job_t;

/* One run of a tensor's elements in one request message. */
typedef struct pp_run_s {
  const struct pp_item_s *it;
  uint64_t off, count;
} pp_run_t;

/* One call: a Pull's or an unchunked push's whole shard, or one chunk of
 * a push to a shard (see plan_chunks()). */
typedef struct pp_call_s {
  fps__stream_t s;
  pp_job_t *job;
  pp_item_t *items;                     /* its tensors, in sending order */
  pp_item_t **by_name;                  /* the same, sorted by name */
  size_t n;
  uint64_t push_id;                     /* its idempotency key, 0: none */
  size_t chunk;                         /* its index among its shard's calls */
  size_t pos;                           /* request cursor: item */
  uint64_t off;                         /* request cursor: element */
  int skip_params;                      /* no params wanted from this call */
  pp_run_t *plan;                       /* scratch, n entries */
  grpc_slice *slices;                   /* scratch, 2n + 1 entries */
} pp_call_t;

/* Zero-copy: a data slice points at the caller's gradient. Its destroy
 * callback counts it released, and the call does not return before every
 * such slice is released, so gRPC never reads caller memory after
 * fps_client_push_pull() returns (an early error status can end a call
 * while a write is still in flight). */
static void data_slice_released(void *user) {
  pp_job_t *job = user;
  FPS_TSAN_ACQUIRE(job); /* gRPC may drop the slice on any thread */
  pthread_mutex_lock(&job->mu);
  if (--job->live_slices == 0) pthread_cond_broadcast(&job->cv);
  pthread_mutex_unlock(&job->mu);
}

static int push_next(fps__stream_t *s, grpc_byte_buffer **out, int *last) {
  pp_call_t *pc = s->ctx;
  pp_job_t *job = pc->job;
  uint64_t budget = job->c->opts.max_message_bytes, used = FPS__MESSAGE_OVERHEAD;
  size_t k = 0, hdr_cap = 56;

  /* Plan this message: which runs of which tensors it carries. A tensor's
   * TensorPush travels with its first run (a count-0 run for no_grad). */
  while (pc->pos < pc->n) {
    const pp_item_t *it = &pc->items[pc->pos];
    size_t name_len = strlen(it->t->name);
    const fps_tensor_push_t *tp = job->per ? &job->per[it->idx] : NULL;
    if (tp && !(tp->has_lr || tp->has_weight_decay || tp->no_grad || tp->has_step || tp->skip_step)) tp = NULL;
    uint64_t tp_over = tp && pc->off == 0 ? FPS__WIRE_TENSOR_PUSH_MAX(name_len) : 0;
    if (tp && tp->no_grad) {
      if (k > 0 && used + tp_over > budget) break; /* the message is full */
      pc->plan[k++] = (pp_run_t){it, 0, 0};
      hdr_cap += tp_over;
      used += tp_over;
      pc->pos++;
      continue;
    }
    uint64_t over = FPS_WIRE_SLICE_HEADER_MAX(name_len, it->t->ndim) + tp_over;
    uint64_t room = budget > used + over ? (budget - used - over) / job->esz : 0;
    uint64_t left = it->numel - pc->off;
    uint64_t count = left < room ? left : room;
    if (count == 0) break; /* the message is full (k > 0: budget >= 64 KiB) */
    pc->plan[k++] = (pp_run_t){it, pc->off, count};
    hdr_cap += over;
    used += over + count * job->esz;
    pc->off += count;
    if (pc->off == it->numel) {
      pc->pos++;
      pc->off = 0;
    }
  }
  /* Encode: the request's scalar fields, then per run a header slice and a
   * slice over the caller's floats. All headers share one allocation. */
  grpc_slice hdr = grpc_slice_malloc(hdr_cap);
  uint8_t *h = GRPC_SLICE_START_PTR(hdr);
  size_t hn = 0, n_sl = 0;
  grpc_slice *sl = pc->slices;
  if (job->worker_id) hn += fps_wire_put_varint_field(h + hn, 1, job->worker_id);
  if (job->step) hn += fps_wire_put_varint_field(h + hn, 2, job->step);
  if (pc->skip_params) hn += fps_wire_put_varint_field(h + hn, 4, 1);
  if (job->num_workers) hn += fps_wire_put_varint_field(h + hn, 6, job->num_workers);
  if (job->expect_mode) hn += fps_wire_put_varint_field(h + hn, 7, (uint64_t)job->expect_mode);
  if (pc->push_id) hn += fps_wire_put_varint_field(h + hn, 8, pc->push_id);
  size_t mark = 0;
  for (size_t i = 0; i < k; i++) {
    const pp_run_t *r = &pc->plan[i];
    const fps__tensor_t *t = r->it->t;
    const fps_tensor_push_t *tp = job->per ? &job->per[r->it->idx] : NULL;
    if (tp && r->off == 0 &&
        (tp->has_lr || tp->has_weight_decay || tp->no_grad || tp->has_step || tp->skip_step))
      hn += fps__wire_tensor_push(h + hn, 5, t->name, strlen(t->name), tp);
    if (r->count == 0 && tp && tp->no_grad) continue; /* settings only */
    hn += fps_wire_slice_header(h + hn, 3, t->name, strlen(t->name), job->dtype, t->ndim, t->shape, r->off,
                                (size_t)(r->count * job->esz));
    sl[n_sl++] = grpc_slice_sub(hdr, mark, hn);
    mark = hn;
    if (job->dtype == FPS_DTYPE_BF16) {
      /* bf16 needs a converted copy (one SIMD pass, half the bytes); it
       * belongs to gRPC, so the caller's gradient is free at once. */
      grpc_slice d = grpc_slice_malloc((size_t)r->count * 2);
      fps_dtype_encode(FPS_DTYPE_BF16, job->grads[r->it->idx] + r->it->base + r->off, r->count,
                       GRPC_SLICE_START_PTR(d));
      sl[n_sl++] = d;
      continue;
    }
    pthread_mutex_lock(&job->mu);
    job->live_slices++;
    pthread_mutex_unlock(&job->mu);
    FPS_TSAN_RELEASE(job);
    sl[n_sl++] = grpc_slice_new_with_user_data((void *)(job->grads[r->it->idx] + r->it->base + r->off),
                                               (size_t)r->count * 4, data_slice_released, job);
  }
  if (mark < hn || n_sl == 0) sl[n_sl++] = grpc_slice_sub(hdr, mark, hn);
  *out = grpc_raw_byte_buffer_create(sl, n_sl);
  for (size_t i = 0; i < n_sl; i++) grpc_slice_unref(sl[i]);
  grpc_slice_unref(hdr);
  *last = pc->pos == pc->n;
  return 0;
}

static int pull_next(fps__stream_t *s, grpc_byte_buffer **out, int *last) {
  pp_call_t *pc = s->ctx;
  char **names = fps_malloc(pc->n * sizeof *names);
  if (!names) return fps__stream_fail(s, FPS_CODE_RESOURCE_EXHAUSTED, "out of memory");
  for (size_t i = 0; i < pc->n; i++) names[i] = pc->items[i].t->name;
  Factorps__V1__PullRequest req = FACTORPS__V1__PULL_REQUEST__INIT;
  req.n_names = pc->n;
  req.names = names;
  req.dtype = FACTORPS__V1__DTYPE__DTYPE_F32;
  *out = fps__pack(&req);
  fps_free(names);
  *last = 1;
  return 0;
}

/* Finds the item of a reply's tensor name (not NUL-terminated). */
static pp_item_t *find_item(const pp_call_t *pc, const char *name, size_t len) {
  size_t lo = 0, hi = pc->n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    const char *m = pc->by_name[mid]->t->name;
    int cmp = strncmp(name, m, len);
    if (cmp == 0 && m[len] != '\0') cmp = -1;
    if (cmp == 0) return pc->by_name[mid];
    if (cmp < 0)
      hi = mid;
    else
      lo = mid + 1;
  }
  return NULL;
}

static int on_slice(void *ctx, const fps_wire_tslice_t *sl) {
  pp_call_t *pc = ctx;
  pp_job_t *job = pc->job;
  char name_buf[FPS__WIRE_NAME_MAX];
  size_t name_len = sl->name_len < sizeof name_buf ? (size_t)sl->name_len : sizeof name_buf;
  fps_wreader_t nr = sl->name;
  const char *name = (const char *)fps_wr_bytes(&nr, name_len, (uint8_t *)name_buf);
  pp_item_t *it = find_item(pc, name, name_len);
  if (!it)
    return fps__stream_fail(&pc->s, FPS_CODE_INTERNAL, "reply carries tensor '%.*s', not asked for",
                            (int)(name_len > 256 ? 256 : name_len), name);
  const fps__tensor_t *t = it->t;
  /* The shard answers in the dtype of a tensor's first pushed slice (bf16
   * with wire_dtype bf16, f32 otherwise and for tensors sent no data). */
  if (sl->dtype != FACTORPS__V1__DTYPE__DTYPE_F32 && sl->dtype != FACTORPS__V1__DTYPE__DTYPE_BF16)
    return fps__stream_fail(&pc->s, FPS_CODE_INTERNAL, "tensor '%s': reply dtype %d, not f32 or bf16",
                            t->name, (int)sl->dtype);
  /* The shape first: a client whose list names another shape (a Create
   * that failed, ALREADY_EXISTS, still replaced the list) is told so,
   * whichever of the two is larger. */
  if (sl->n_shape != t->ndim || memcmp(sl->shape, t->shape, t->ndim * sizeof *t->shape) != 0)
    return fps__stream_fail(&pc->s, FPS_CODE_FAILED_PRECONDITION,
                            "tensor '%s': the shard's shape differs from the client's", t->name);
  const size_t esz = fps_dtype_size(sl->dtype);
  if (sl->data_len % esz || sl->offset > it->numel || sl->data_len / esz > it->numel - sl->offset)
    return fps__stream_fail(&pc->s, FPS_CODE_INTERNAL,
                            "tensor '%s'%s: reply slice [%llu, +%llu bytes) outside %llu elements",
                            t->name, t->blocks ? " (a row block)" : "", (unsigned long long)sl->offset,
                            (unsigned long long)sl->data_len, (unsigned long long)it->numel);
  /* Straight from gRPC's buffers into the caller's array: one pass (bf16
   * with non-temporal stores: the array is not read again this call). */
  float *dst = job->params[it->idx];
  if (dst) {
    fps_welems_t el;
    fps_welems_init(&el, &sl->data, esz);
    const uint8_t *p;
    uint64_t k, at = it->base + sl->offset;
    while ((k = fps_welems_next(&el, &p)) > 0) {
      fps_dtype_decode_out(sl->dtype, p, k, dst + at);
      at += k;
    }
  }
  it->received += sl->data_len / esz;
  return 0;
}

static int on_version(void *ctx, const char *name, size_t len, uint64_t version) {
  pp_call_t *pc = ctx;
  pp_item_t *it = find_item(pc, name, len);
  if (!it)
    return fps__stream_fail(&pc->s, FPS_CODE_INTERNAL, "reply versions tensor '%.*s', not asked for",
                            (int)(len > 256 ? 256 : len), name);
  it->got_version = 1;
  it->version = version;
  return 0;
}

static int pp_reply(fps__stream_t *s, const fps_wspan_t *spans, size_t n) {
  pp_call_t *pc = s->ctx;
  char err[128];
  fps__wire_sink_t sink = {on_slice, on_version, pc};
  int rc = fps__wire_parse_params(spans, n, &sink, err, sizeof err);
  if (rc < 0) return fps__stream_fail(s, fps__code_from_err(rc), "%s", err);
  return rc;
}

static void pull_reset(fps__stream_t *s) {
  pp_call_t *pc = s->ctx;
  for (size_t i = 0; i < pc->n; i++) {
    pc->items[i].received = 0;
    pc->items[i].got_version = 0;
  }
}

/* A PushPull that failed UNAVAILABLE is sent again from its first message
 * with the same push_id: the shard applies it at most once (a retry of an
 * applied push is answered with the current params and versions). */
static void push_reset(fps__stream_t *s) {
  pp_call_t *pc = s->ctx;
  pc->pos = 0;
  pc->off = 0;
  pull_reset(s);
}
static const fps__stream_ops_t push_ops = {push_next, NULL, push_reset, pp_reply};

/* A process-wide push_id sequence from a random start, so that workers in
 * different processes that share a worker_id (async) never share a key. */
static atomic_uint_fast64_t fps__push_seq;
static pthread_once_t fps__push_seq_once = PTHREAD_ONCE_INIT;
static void fps__push_seq_init(void) {
  uint64_t r = 0;
  if (getrandom(&r, sizeof r, 0) != (ssize_t)sizeof r) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    r = ((uint64_t)ts.tv_nsec << 32) ^ (uint64_t)ts.tv_sec ^ ((uint64_t)getpid() << 16);
  }
  atomic_store(&fps__push_seq, r >> 1); /* leaves room before wrapping */
}
static uint64_t fps__push_id_next(void) {
  pthread_once(&fps__push_seq_once, fps__push_seq_init);
  uint64_t id = atomic_fetch_add(&fps__push_seq, 1) + 1;
  return id ? id : atomic_fetch_add(&fps__push_seq, 1) + 1;
}
static const fps__stream_ops_t pull_ops = {pull_next, NULL, pull_reset, pp_reply};

/* Waits until gRPC released every slice over the caller's gradients. The
 * calls are over, so this is prompt; the bound only guards against a gRPC
 * bug turning into a hang (then it reports and returns). */
static void wait_slices_released(pp_job_t *job) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 30;
  pthread_mutex_lock(&job->mu);
  while (job->live_slices > 0)
    if (pthread_cond_timedwait(&job->cv, &job->mu, &until)) break;
  if (job->live_slices > 0)
    fprintf(stderr, "libfactorps: gRPC still holds %zu gradient slices after the call\n",
            job->live_slices);
  pthread_mutex_unlock(&job->mu);
}

static int by_item_name(const void *a, const void *b) {
  return strcmp((*(pp_item_t *const *)a)->t->name, (*(pp_item_t *const *)b)->t->name);
}

/* Checks that every item of every tensor was answered in full and that
 * all blocks of a split tensor report the same version, then writes the
 * versions. Within one shard a sync step applies to every block or to none
 * (the cross-shard step), so after a push its blocks must agree: if they
 * do not, they have diverged (DATA_LOSS). A Pull or a versions-only read
 * can meet a step that one block's shard applied and another's has not yet
 * (each applies once it holds every block's partials): *torn is then set
 * so that the caller reads again. */
static int check_versions(fps_client_t *c, pp_job_t *job, pp_call_t *pc, size_t n_calls, size_t n,
                          int is_push, int *torn, fps_status_t *status) {
  const pp_item_t **first = fps_calloc(n ? n : 1, sizeof *first);
  int rc = 0;
  *torn = 0;
  if (!first) return fps__status_err(status, FPS_ENOMEM, -1, "out of memory");
  for (size_t s = 0; s < n_calls && !rc; s++)
    for (size_t i = 0; i < pc[s].n && !rc; i++) {
      const pp_item_t *it = &pc[s].items[i];
      const fps__tensor_t *t = it->t;
      if (!it->got_version || (!pc[s].skip_params && it->received != it->numel)) {
        char blk[64] = "";
        if (t->blocks)
          snprintf(blk, sizeof blk, " block %u (rows [%llu, %llu))", it->block,
                   (unsigned long long)t->blocks[it->block].row_lo,
                   (unsigned long long)t->blocks[it->block].row_hi);
        rc = fps__status_set(status, FPS_CODE_DATA_LOSS, it->shard,
                             "shard %d (%s): tensor '%s'%s: reply had %llu of %llu elements%s",
                             it->shard, c->addrs[it->shard], t->name, blk,
                             (unsigned long long)it->received, (unsigned long long)it->numel,
                             it->got_version ? "" : " and no version");
        break;
      }
      const pp_item_t *f = first[it->idx];
      if (!f) {
        first[it->idx] = it;
        continue;
      }
      if (f->version == it->version) continue;
      if (!is_push) {
        *torn = 1;
        rc = fps__status_set(status, FPS_CODE_ABORTED, it->shard,
                             "tensor '%s': its row blocks kept reporting different versions "
                             "(%llu: block %u on shard %d (%s); %llu: block %u on shard %d "
                             "(%s)) while a step was being applied; read again",
                             t->name, (unsigned long long)f->version, f->block, f->shard,
                             c->addrs[f->shard], (unsigned long long)it->version, it->block,
                             it->shard, c->addrs[it->shard]);
      } else {
        rc = fps__status_set(status, FPS_CODE_DATA_LOSS, it->shard,
                             "tensor '%s': after this push its row blocks report different "
                             "versions (%llu: block %u on shard %d (%s); %llu: block %u on shard "
                             "%d (%s)): the blocks have diverged",
                             t->name, (unsigned long long)f->version, f->block, f->shard,
                             c->addrs[f->shard], (unsigned long long)it->version, it->block,
                             it->shard, c->addrs[it->shard]);
      }
    }
  if (!rc && job->versions)
    for (size_t i = 0; i < n; i++) job->versions[i] = first[i]->version;
  fps_free(first);
  return rc;
}

/* Attempts of a Pull whose split tensors' blocks were caught at different
 * versions, and the pause before the first repeat (doubling). */
#define PULL_TORN_ATTEMPTS 8
#define PULL_TORN_PAUSE 0.005

static void pause_s(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

/* Most calls one push makes to one shard: a larger shard gets larger
 * chunks. Bounds the calls (and the shard's push_id window, 65,536 keys,
 * that each of them takes) whatever the chunk size. */
#define PUSH_MAX_CALLS 32

static int by_tensor(const void *a, const void *b) {
  const fps__tensor_t *x = *(const fps__tensor_t *const *)a, *y = *(const fps__tensor_t *const *)b;
  return x < y ? -1 : x > y;
}

/* Sending order of a push's items to one shard: largest first (ties by
 * name, then block), independent of the caller's order, so every worker
 * of a sync job cuts the same chunks and their rounds stay independent. */
static int by_size_desc(const void *a, const void *b) {
  const pp_item_t *x = a, *y = b;
  if (x->numel != y->numel) return x->numel > y->numel ? -1 : 1;
  int k = strcmp(x->t->name, y->t->name);
  if (k) return k;
  return x->block < y->block ? -1 : x->block > y->block;
}

/* Cuts one shard's items (n of them, reordered in place) into chunks of
 * at least `target` bytes of fp32 gradient, whatever the wire dtype (what
 * a chunk costs a step is its share of the push: the way down waits for a
 * whole chunk, so bf16, with half the bytes, cuts the same chunks as
 * fp32, not chunks of twice the share; one item may exceed it alone), and
 * writes the number of items of each chunk, in sending
 * order, to len[] (room for n), returning the chunk count. Items go
 * largest first so the large replies come back while the rest still
 * uploads; the first chunk sent is the largest one of at most 2 x target
 * bytes, so that the first reply starts early too (a huge tensor first
 * would leave the way down idle while it uploads); the smallest go last,
 * so the tail after the upload is short. `tmp` has room for n items. */
static size_t plan_chunks(pp_item_t *items, size_t n, uint64_t target, pp_item_t *tmp, size_t *len) {
  const uint64_t esz = sizeof(float);
  size_t k = 0;
  uint64_t bytes = 0, total = 0;
  for (size_t i = 0; i < n; i++) total += items[i].numel * esz;
  /* A push that fits one chunk keeps the caller's order: it is the same
   * call an unchunked push makes, so a retry of its push_id matches the
   * first attempt whichever client (or chunk size) made that one. */
  if (total <= target) {
    len[0] = n;
    return 1;
  }
  if (target < total / PUSH_MAX_CALLS + 1) target = total / PUSH_MAX_CALLS + 1;
  qsort(items, n, sizeof *items, by_size_desc);
  for (size_t i = 0, start = 0; i < n; i++) {
    bytes += items[i].numel * esz;
    if (bytes >= target || i + 1 == n) {
      len[k++] = i + 1 - start;
      start = i + 1;
      bytes = 0;
    }
  }
  /* The first chunk to send: the first (largest) of at most 2 x target. */
  size_t at = 0, f = 0;
  for (; f < k; at += len[f], f++) {
    uint64_t b = 0;
    for (size_t i = at; i < at + len[f]; i++) b += items[i].numel * esz;
    if (b <= 2 * target) break;
  }
  if (f > 0 && f < k) {
    size_t lf = len[f];
    memcpy(tmp, items + at, lf * sizeof *items);
    memcpy(tmp + lf, items, at * sizeof *items);
    memcpy(items, tmp, (at + lf) * sizeof *items);
    memmove(len + 1, len, f * sizeof *len);
    len[0] = lf;
  }
  return k;
}

/* The key of chunk `j` of a push whose key is `id`: chunk 0 keeps it (an
 * unchunked push sends what it always sent), the others get a 64-bit mix
 * of (id, j), so a caller that retries with the same push_id retries every
 * chunk under its own key again and the shard applies each at most once.
 * A mixed key meeting another push's key of the same worker is as likely
 * as two random 64-bit keys meeting. */
static uint64_t chunk_push_id(uint64_t id, size_t j) {
  if (!id || j == 0) return id;
  uint64_t z = id + (uint64_t)j * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return z ? z : 1;
}

static int run(fps_client_t *c, pp_job_t *job, const char *const *names, size_t n, int is_push,
               fps_status_t *status) {
  pp_call_t *pc = NULL;
  pp_item_t *items = NULL, *sorted = NULL;
  pp_item_t **by_name = NULL;
  fps__stream_t **streams = NULL;
  size_t *count = NULL, *len = NULL, total = 0, n_calls = 0;
  int rc, locked = 0;

  if (!c || (n && (!names || (is_push && !job->grads) || !job->params)))
    return fps__status_err(status, FPS_EINVAL, -1, "NULL argument");
  job->dtype = is_push && c->opts.wire_dtype == FPS_WIRE_BF16 ? FPS_DTYPE_BF16 : FPS_DTYPE_F32;
  job->esz = fps_dtype_size(job->dtype);
  count = fps_calloc(c->n_shards, sizeof *count);
  if (!count) {
    rc = fps__status_err(status, FPS_ENOMEM, -1, "out of memory");
    goto done;
  }

  /* The read lock keeps the tensor list (and the names the messages point
   * at) alive for the whole call. */
  pthread_rwlock_rdlock(&c->lock);
  locked = 1;
  for (size_t i = 0; i < n; i++) {
    if (!names[i]) {
      rc = fps__status_err(status, FPS_EINVAL, -1, "names[%zu] is NULL", i);
      goto done;
    }
    const fps__tensor_t *t = fps__tensor_list_find(&c->tensors, names[i]);
    if (!t) {
      rc = fps__status_err(status, FPS_ENOTFOUND, -1,
                           "tensor '%s' is not in this client's tensor list", names[i]);
      goto done;
    }
    if (is_push && !job->grads[i] && !(job->per && job->per[i].no_grad)) {
      rc = fps__status_err(status, FPS_EINVAL, -1, "tensor '%s': gradient is NULL",
                           names[i]);
      goto done;
    }
    total += fps__block_count(t);
  }
  /* At most one call per item (chunks), or one per shard. */
  size_t max_calls = total + c->n_shards;
  items = fps_calloc(total ? total : 1, sizeof *items);
  sorted = fps_calloc(total ? total : 1, sizeof *sorted);
  by_name = fps_calloc(total ? total : 1, sizeof *by_name);
  len = fps_calloc(total ? total : 1, sizeof *len);
  pc = fps_calloc(max_calls, sizeof *pc);
  streams = fps_calloc(max_calls, sizeof *streams);
  if (!items || !sorted || !by_name || !len || !pc || !streams) {
    rc = fps__status_err(status, FPS_ENOMEM, -1, "out of memory");
    goto done;
  }
  /* One item per tensor, or per row block of a split one. */
  for (size_t i = 0, k = 0; i < n; i++) {
    const fps__tensor_t *t = fps__tensor_list_find(&c->tensors, names[i]);
    const uint64_t C = fps__row_elems(t);
    for (size_t b = 0; b < fps__block_count(t); b++) {
      fps__block_t blk = fps__block_at(t, b);
      sorted[k++] = (pp_item_t){.t = t, .idx = i, .shard = blk.shard, .block = (uint32_t)b,
                                .base = blk.row_lo * C, .numel = (blk.row_hi - blk.row_lo) * C};
      count[blk.shard]++;
    }
  }
  /* A tensor named twice: found before chunking could part the two. */
  {
    const fps__tensor_t **ts = fps_calloc(n ? n : 1, sizeof *ts);
    if (!ts) {
      rc = fps__status_err(status, FPS_ENOMEM, -1, "out of memory");
      goto done;
    }
    for (size_t i = 0; i < n; i++) ts[i] = fps__tensor_list_find(&c->tensors, names[i]);
    qsort(ts, n, sizeof *ts, by_tensor);
    for (size_t i = 1; i < n; i++)
      if (ts[i - 1] == ts[i]) {
        rc = fps__status_err(status, FPS_EINVAL, -1, "tensor '%s' is named twice",
                             ts[i]->name);
        fps_free(ts);
        goto done;
      }
    fps_free(ts);
  }
  /* Group by shard, keeping the caller's order within a shard. */
  {
    size_t *start = fps_calloc(c->n_shards + 1, sizeof *start);
    if (!start) {
      rc = fps__status_err(status, FPS_ENOMEM, -1, "out of memory");
      goto done;
    }
    for (size_t s = 0; s < c->n_shards; s++) start[s + 1] = start[s] + count[s];
    for (size_t i = 0; i < total; i++) items[start[sorted[i].shard]++] = sorted[i];
    fps_free(start);
  }
  /* Cut each shard's items into calls: one per shard (Pull, or a push with
   * push_chunk_bytes 0 or that fits one chunk), or chunks of a push, each
   * following the previous one's upload (fps__stream_t.after). */
  for (size_t s = 0, at = 0; s < c->n_shards; at += count[s], s++) {
    if (!count[s]) continue;
    pp_item_t *base = items + at;
    size_t k = 1;
    len[0] = count[s];
    uint64_t chunk = is_push ? c->opts.push_chunk_bytes : 0;
    if (chunk && count[s] > 1) k = plan_chunks(base, count[s], chunk, sorted, len);
    for (size_t j = 0, off = 0; j < k; off += len[j], j++) {
      pp_call_t *x = &pc[n_calls];
      x->items = base + off;
      x->by_name = by_name + at + off;
      x->n = len[j];
      x->s.shard = (int)s;
      x->s.after = j > 0 ? &pc[n_calls - 1].s : NULL;
      x->chunk = j;
      streams[n_calls++] = &x->s;
    }
  }
  if (is_push && !job->push_id) job->push_id = fps__push_id_next();
  for (size_t k = 0; k < n_calls; k++) {
    pp_call_t *x = &pc[k];
    for (size_t i = 0; i < x->n; i++) x->by_name[i] = &x->items[i];
    qsort(x->by_name, x->n, sizeof *x->by_name, by_item_name);
    x->s.ops = is_push ? &push_ops : &pull_ops;
    x->s.ctx = x;
    x->job = job;
    x->skip_params = 1;
    for (size_t i = 0; i < x->n; i++)
      if (job->params[x->items[i].idx]) x->skip_params = 0;
    if (is_push) {
      x->push_id = chunk_push_id(job->push_id, x->chunk);
      x->plan = fps_calloc(x->n, sizeof *x->plan);
      x->slices = fps_calloc(2 * x->n + 1, sizeof *x->slices);
      if (!x->plan || !x->slices) {
        rc = fps__status_err(status, FPS_ENOMEM, -1, "out of memory");
        goto done;
      }
    }
  }

  double pause = PULL_TORN_PAUSE;
  for (int attempt = 1;; attempt++) {
    int torn = 0;
    rc = fps__streams_run(c, is_push ? FPS__METHOD_PUSHPULL : FPS__METHOD_PULL, streams, n_calls,
                          FPS__RETRY_IDEMPOTENT, status);
    if (is_push) wait_slices_released(job);
    if (rc) goto done;
    rc = check_versions(c, job, pc, n_calls, n, is_push, &torn, status);
    if (!torn || attempt == PULL_TORN_ATTEMPTS) break;
    /* A Pull met a split tensor's step half applied: read again. */
    pause_s(pause);
    pause *= 2;
    for (size_t s = 0; s < n_calls; s++) pull_reset(streams[s]);
  }
  if (rc) goto done;
  fps__status_ok(status);

done:
  if (locked) pthread_rwlock_unlock(&c->lock);
  if (pc)
    for (size_t k = 0; k < n_calls; k++) {
      fps_free(pc[k].plan);
      fps_free(pc[k].slices);
    }
  fps_free(pc);
  fps_free(streams);
  fps_free(count);
  fps_free(len);
  fps_free(items);
  fps_free(sorted);
  fps_free(by_name);
  return rc;
}

int fps_client_push_pull(fps_client_t *c, uint32_t worker_id, uint64_t step,
                         const char *const *names, const float *const *grads,
                         float *const *params, uint64_t *versions, size_t n,
                         fps_status_t *status) {
  pp_job_t job = {.c = c, .grads = grads, .params = params, .versions = versions,
                  .worker_id = worker_id, .step = step};
  pthread_mutex_init(&job.mu, NULL);
  pthread_cond_init(&job.cv, NULL);
  int rc = run(c, &job, names, n, 1, status);
  pthread_cond_destroy(&job.cv);
  pthread_mutex_destroy(&job.mu);
  return rc;
}

int fps_client_push_pull_ex(fps_client_t *c, const fps_push_args_t *args, const char *const *names,
                            const float *const *grads, const fps_tensor_push_t *per, float *const *params,
                            uint64_t *versions, size_t n, fps_status_t *status) {
  if (!args) return fps__status_err(status, FPS_EINVAL, -1, "args is NULL");
  if (args->expect_mode < 0 || args->expect_mode > 3)
    return fps__status_err(status, FPS_EINVAL, -1,
                           "expect_mode %d is not a mode (0 any, 1 sync, 2 async, 3 ssp)", args->expect_mode);
  pp_job_t job = {.c = c, .grads = grads, .params = params, .versions = versions,
                  .worker_id = args->worker_id, .step = args->step, .num_workers = args->num_workers,
                  .push_id = args->push_id,
                  .expect_mode = args->expect_mode, .per = per};
  pthread_mutex_init(&job.mu, NULL);
  pthread_cond_init(&job.cv, NULL);
  int rc = run(c, &job, names, n, 1, status);
  pthread_cond_destroy(&job.cv);
  pthread_mutex_destroy(&job.mu);
  return rc;
}

int fps_client_pull(fps_client_t *c, const char *const *names, float *const *params,
                    uint64_t *versions, size_t n, fps_status_t *status) {
  pp_job_t job = {.c = c, .params = params, .versions = versions};
  return run(c, &job, names, n, 0, status);
}
