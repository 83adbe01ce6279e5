/* The cross-shard step of split tensors (server/shard/xstep.c): 2, 3 and
 * 4 shard cores in one process, each core's sender wired to the others'
 * fps_shard_exchange_receive() through a queue that one thread drains (a
 * receive never runs inside a sender), with links that can hold, refuse or
 * lose the acknowledgement of a message. Sync mode, fake clock.
 *
 * Exactness: every golden case with >= 2 rows, split over 2, 3 and 4
 * cores (a block of one row among them) and pushed by W = 1 and 2
 * workers, must give on every core bit for bit what common's split math
 * gives for the same blocks and the mean gradient (the same arithmetic:
 * the W gradients summed in fp32 in worker order, divided by W), and match
 * the unsplit core (one shard, whole tensor) within check_vectors.py's
 * tolerances (param scaled 1e-5; row/col/var relative 1e-4; mom scaled
 * 1e-5). Then the failures: a peer that never answers, a refused send, a
 * lost acknowledgement, early / duplicate / different / stale / ahead
 * partials, a set {block, whole tensor}, a member cancelled mid-exchange,
 * and shutdown: nothing applied anywhere on a failure, every member told
 * UNAVAILABLE naming the tensor and the peer. */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "alloc.h"
#include "golden.h"
#include "metrics.h"
#include "shard_fixture.h"
#include "simd/kernels.h"

#define MAXS 4
#define MAXW 2
#define XDEADLINE_S 5.0
#define PTOL 1e-5
#define STOL 1e-4

/* ------------------------------------------------------------ the net */

enum { LINK_OK = 0, LINK_HOLD, LINK_REFUSE, LINK_PEER_ERR, LINK_LOSE_ACK };

typedef struct qmsg_s {
  uint32_t from, to;
  char *name;
  fps_xmsg_t m;
  uint8_t *partials;
  fps_xsend_done_fn done;
  void *arg;
  int retries;                /* LINK_LOSE_ACK: deliveries before the ack */
  struct qmsg_s *next;
} qmsg_t;

static fps_shard_t core[MAXS + 1]; /* core[MAXS]: a standby's, when a test makes one */
static uint32_t ncores;
static uint32_t node_id[MAXS + 1];
/* Which core serves each shard id (a standby replica taking over: the
 * identity otherwise). */
static uint32_t route[MAXS];
/* [from][to]; atomic: the tests change links while the pump and the
 * cores' threads read them. */
static _Atomic int link_mode[MAXS][MAXS];
static pthread_mutex_t qmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t qcv = PTHREAD_COND_INITIALIZER;
static qmsg_t *qhead, *qtail, *held;
static bool pump_busy, pump_stop;
static pthread_t pump;
static unsigned sends_total;
static int last_rc[MAXS][MAXS];       /* the receive's result per link */
static char last_why[MAXS][MAXS][FPS_WHY_MAX];

static void q_push_locked(qmsg_t *q) {
  q->next = NULL;
  if (qtail) qtail->next = q;
  else qhead = q;
  qtail = q;
  pthread_cond_broadcast(&qcv);
}

static void qmsg_free(qmsg_t *q) {
  free(q->name);
  free(q->partials);
  free(q);
}

static int net_send(void *ctx, uint32_t to, const fps_xmsg_t *m, int64_t deadline_ns, fps_xsend_done_fn done,
                    void *arg) {
  (void)deadline_ns;
  uint32_t from = *(const uint32_t *)ctx;
  assert_true(to < ncores && to != from);
  int mode = link_mode[from][to];
  if (mode == LINK_REFUSE) return FPS_EUNAVAILABLE;
  qmsg_t *q = calloc(1, sizeof *q);
  assert_non_null(q);
  q->from = from;
  q->to = to;
  q->name = strdup(m->name);
  q->partials = malloc(m->len ? m->len : 1); /* a COMMIT carries nothing */
  assert_non_null(q->name);
  assert_non_null(q->partials);
  if (m->len) memcpy(q->partials, m->partials, m->len); /* a COMMIT: len 0, partials NULL */
  q->m = *m;
  q->m.name = q->name;
  q->m.partials = q->partials;
  q->done = done;
  q->arg = arg;
  q->retries = mode == LINK_LOSE_ACK ? 1 : 0;
  pthread_mutex_lock(&qmu);
  sends_total++;
  if (mode == LINK_HOLD) {
    q->next = held;
    held = q;
  } else {
    q_push_locked(q);
  }
  pthread_mutex_unlock(&qmu);
  return 0;
}

static void *pump_main(void *u) {
  (void)u;
  pthread_mutex_lock(&qmu);
  for (;;) {
    while (!qhead && !pump_stop) pthread_cond_wait(&qcv, &qmu);
    if (!qhead) break;
    qmsg_t *q = qhead;
    qhead = q->next;
    if (!qhead) qtail = NULL;
    pump_busy = true;
    int mode = link_mode[q->from][q->to];
    pthread_mutex_unlock(&qmu);
    char why[FPS_WHY_MAX] = "";
    fps_xreply_t reply = {0};
    int rc;
    if (mode == LINK_PEER_ERR) {
      rc = FPS_ESTATE;
      snprintf(why, sizeof why, "peer shard %u refused: test refusal", q->to);
    } else {
      rc = fps_shard_exchange_receive(&core[route[q->to]], &q->m, &reply, why, sizeof why);
    }
    /* The answers to the step's own messages (the blocks' VERSIONS after
     * a failure, xrecover.c, are not what these tests look at). */
    if (q->m.phase != FPS_XPHASE_VERSIONS) {
      last_rc[q->from][q->to] = rc;
      snprintf(last_why[q->from][q->to], FPS_WHY_MAX, "%s", why);
    }
    if (rc == 0 && q->retries > 0) {
      /* The acknowledgement is lost: the sender's transport retries. */
      fps_xreply_free(&reply);
      q->retries--;
      pthread_mutex_lock(&qmu);
      q_push_locked(q);
      pump_busy = false;
      continue;
    }
    q->done(q->arg, rc, why, rc == 0 ? &reply : NULL);
    fps_xreply_free(&reply);
    qmsg_free(q);
    pthread_mutex_lock(&qmu);
    pump_busy = false;
    pthread_cond_broadcast(&qcv);
  }
  pthread_mutex_unlock(&qmu);
  return NULL;
}

static void net_idle(void) {
  pthread_mutex_lock(&qmu);
  while (qhead || pump_busy) pthread_cond_wait(&qcv, &qmu);
  pthread_mutex_unlock(&qmu);
}

/* The held messages: delivered (err 0) or failed with err at the sender. */
static void net_release(int err) {
  pthread_mutex_lock(&qmu);
  qmsg_t *h = held;
  held = NULL;
  pthread_mutex_unlock(&qmu);
  while (h) {
    qmsg_t *n = h->next;
    if (err) {
      h->done(h->arg, err, "the peer did not answer within the deadline", NULL);
      qmsg_free(h);
    } else {
      pthread_mutex_lock(&qmu);
      q_push_locked(h);
      pthread_mutex_unlock(&qmu);
    }
    h = n;
  }
  net_idle();
}

static void cores_up(uint32_t n, uint32_t W) {
  const fps_kernels_t *k;
  char why[256];
  assert_int_equal(fps_kernels_by_name("auto", &k, why, sizeof why), 0);
  fps__log_level = -1;
  ncores = n;
  /* The exchange counters are the process's metrics registry, shared by
   * every core here: start it afresh for each scenario. */
  fps_metrics_config_t mc = {.shard_id = 0};
  assert_int_equal(fps_metrics_init(&mc), 0);
  for (int i = 0; i < MAXS; i++)
    for (int j = 0; j < MAXS; j++) link_mode[i][j] = LINK_OK;
  memset(last_rc, 0, sizeof last_rc);
  sends_total = 0;
  for (uint32_t i = 0; i < n; i++) {
    fps_shard_opts_t o = {.shard_id = i, .shard_count = n, .mode = FPS_MODE_SYNC, .workers = W,
                          .deadline = FX_DEADLINE_S, .max_tensors = 64, .max_bytes = 64u << 20,
                          .max_staging_bytes = 64u << 20, .apply_log = 8, .checkpoint_dir = ""};
    assert_int_equal(fps_shard_init(&core[i], &o, k, NULL), 0);
    node_id[i] = i;
    route[i] = i;
    fps_shard_set_exchange(&core[i], net_send, &node_id[i], XDEADLINE_S);
  }
  pump_stop = false;
  assert_int_equal(pthread_create(&pump, NULL, pump_main, NULL), 0);
}

static void cores_down(void) {
  net_release(FPS_EUNAVAILABLE);
  net_idle();
  pthread_mutex_lock(&qmu);
  pump_stop = true;
  pthread_cond_broadcast(&qcv);
  pthread_mutex_unlock(&qmu);
  pthread_join(pump, NULL);
  for (uint32_t i = 0; i < ncores; i++) fps_shard_destroy(&core[i]);
  ncores = 0;
}

/* --------------------------------------------------------- the tensors */

/* Block idx (of nb, block b on core b) of tensor name on sh, with its
 * rows of the whole tensor's initial values: a real Create of the block
 * (TensorCreate.split). */
static void blk_create(fps_shard_t *sh, const char *name, const fps_shape_t *shape, const fps_adafactor_hparams_t *hp,
                       const uint64_t *bounds, uint32_t nb, uint32_t idx, const float *whole) {
  char why[FPS_WHY_MAX];
  fps_split_geom_t g;
  assert_int_equal(fps_split_geom_init(&g, shape, bounds[idx], bounds[idx + 1], why, sizeof why), 0);
  uint32_t shards[MAXS];
  for (uint32_t k = 0; k < nb; k++) shards[k] = k;
  fps_split_map_t map = {.block_index = idx, .bounds = bounds, .n_bounds = nb + 1, .block_shards = shards,
                         .n_block_shards = nb, .shard_count = sh->cfg.shard_count};
  fps_slice_t s = {.dtype = FPS_DTYPE_F32, .offset = 0, .data = (const uint8_t *)(whole + g.row_lo * g.cols),
                   .len = g.block_numel * 4};
  fps_create_item_t it = {.name = name, .dims = shape->dim, .ndim = shape->ndim, .init = &s, .hp = *hp,
                          .split = &map};
  fps_create_info_t info;
  uint64_t rx;
  int rc = fps_shard_create(sh, sh->cfg.shard_id, sh->cfg.shard_count, &it, 1, &info, &rx, why, sizeof why);
  if (rc) print_error("create block %u of %s: %s\n", idx, name, why);
  assert_int_equal(rc, 0);
  fps_tensor_t *t = fps_store_find(&sh->store, name);
  assert_non_null(t);
  assert_non_null(t->split);
  assert_true(t->ready);
  assert_int_equal(t->numel, g.block_numel);
}

/* A whole tensor with initial values and settings hp. */
static void whole_create(fps_shard_t *sh, const char *name, const fps_shape_t *shape,
                         const fps_adafactor_hparams_t *hp, const float *init) {
  uint64_t numel = 1;
  for (uint32_t i = 0; i < shape->ndim; i++) numel *= shape->dim[i];
  fps_slice_t s = {.dtype = FPS_DTYPE_F32, .offset = 0, .data = (const uint8_t *)init, .len = numel * 4};
  fps_create_item_t it = {.name = name, .dims = shape->dim, .ndim = shape->ndim, .init = &s, .hp = *hp};
  fps_create_info_t info;
  uint64_t rx;
  char why[FPS_WHY_MAX];
  int rc = fps_shard_create(sh, sh->cfg.shard_id, sh->cfg.shard_count, &it, 1, &info, &rx, why, sizeof why);
  if (rc) print_error("create %s: %s\n", name, why);
  assert_int_equal(rc, 0);
}

static fps_tensor_t *find(fps_shard_t *sh, const char *name) {
  fps_tensor_t *t = fps_store_find(&sh->store, name);
  assert_non_null(t);
  return t;
}

/* One worker's push of the named tensors' gradients (g[i]: that core's
 * numel floats of tensor names[i]). */
typedef struct wpush_s {
  fps_push_t *p;
  fx_done_t d;
  int rc;                     /* the commit's */
  char why[FPS_WHY_MAX];
} wpush_t;

static void push_start(wpush_t *w, fps_shard_t *sh, uint32_t worker, uint64_t step, size_t n, const char *const *names,
                       const float *const *g) {
  w->p = fx_push_new(sh, worker, step, INT64_MAX, &w->d);
  for (size_t i = 0; i < n; i++) {
    fps_tensor_t *t = find(sh, names[i]);
    int rc = fx_push_grad(w->p, names[i], g[i], t->numel, 1, NULL);
    assert_int_equal(rc, 0);
  }
  w->rc = fps_push_commit(w->p, w->why, sizeof w->why);
}

/* How a push ended: its commit's result, or its done callback's. */
static int push_result(wpush_t *w, char *why, size_t wl) {
  if (w->rc != FPS_EAGAIN) {
    if (w->rc == 0) return fps_push_result(w->p, why, wl);
    snprintf(why, wl, "%s", w->why);
    return w->rc;
  }
  assert_int_equal(w->d.calls, 1);
  snprintf(why, wl, "%s", w->d.why);
  return w->d.err;
}

static void push_end(wpush_t *w) {
  fps_push_destroy(w->p);
  w->p = NULL;
}

/* ------------------------------------------- the reference: common's math */

typedef struct ref_s {
  fps_split_geom_t g[MAXS];
  fps_split_state_t st[MAXS];
  float *param;               /* whole */
  unsigned u2_steps;
} ref_t;

static void ref_init(ref_t *r, const fps_shape_t *shape, const fps_adafactor_hparams_t *hp, const uint64_t *bounds,
                     uint32_t nb, const float *init, uint64_t numel) {
  memset(r, 0, sizeof *r);
  for (uint32_t b = 0; b < nb; b++) {
    assert_int_equal(fps_split_geom_init(&r->g[b], shape, bounds[b], bounds[b + 1], NULL, 0), 0);
    assert_int_equal(fps_split_state_init(&r->st[b], &r->g[b], hp), 0);
  }
  r->param = malloc(numel * sizeof(float));
  assert_non_null(r->param);
  memcpy(r->param, init, numel * sizeof(float));
}

/* One step of every block with the whole gradient g (the mean). */
static void ref_step(ref_t *r, const fps_adafactor_hparams_t *hp, uint32_t nb, const float *g) {
  fps_split_step_t *s[MAXS] = {0};
  fps_split_partials_t parts[MAXS];
  for (uint32_t b = 0; b < nb; b++) {
    uint64_t off = r->g[b].row_lo * r->g[b].cols;
    assert_int_equal(fps_split_step_begin(NULL, hp, &r->st[b], r->param + off, g + off, NULL, &s[b]), 0);
  }
  char why[512];
  for (uint32_t b = 0; b < nb; b++) parts[b] = *fps_split_step_partials(s[b]);
  for (uint32_t b = 0; b < nb; b++) assert_int_equal(fps_split_step_combine(s[b], parts, nb, why, sizeof why), 0);
  if (fps_split_step_needs_u2(s[0])) {
    r->u2_steps++;
    for (uint32_t b = 0; b < nb; b++) parts[b] = *fps_split_step_u2(s[b]);
    for (uint32_t b = 0; b < nb; b++)
      assert_int_equal(fps_split_step_combine_u2(s[b], parts, nb, why, sizeof why), 0);
  }
  for (uint32_t b = 0; b < nb; b++) {
    assert_int_equal(fps_split_step_apply(s[b], NULL), 0);
    fps_split_step_free(s[b]);
  }
}

static void ref_free(ref_t *r, uint32_t nb) {
  for (uint32_t b = 0; b < nb; b++) fps_split_state_destroy(&r->st[b]);
  free(r->param);
}

/* Core b's block of `name` equals the reference's bit for bit (params,
 * state, step, RMS, version). */
static void expect_block_on_equals_ref(fps_shard_t *sh, uint32_t b, const char *name, const ref_t *r,
                                      uint64_t version) {
  fps_tensor_t *t = find(sh, name);
  pthread_mutex_lock(&t->mu);
  const fps_split_state_t *a = &t->split->st, *e = &r->st[b];
  const fps_split_geom_t *g = &r->g[b];
  assert_int_equal(t->version, version);
  assert_memory_equal(t->param, r->param + g->row_lo * g->cols, g->block_numel * sizeof(float));
  if (g->factored) {
    assert_memory_equal(a->row, e->row, (g->row_hi - g->row_lo) * sizeof(float));
    assert_memory_equal(a->col, e->col, g->nmat * g->cols * sizeof(float));
  } else {
    assert_memory_equal(a->var, e->var, g->block_numel * sizeof(float));
  }
  if (e->mom) assert_memory_equal(a->mom, e->mom, g->block_numel * sizeof(float));
  assert_int_equal(a->step, e->step);
  assert_memory_equal(&a->rms, &e->rms, sizeof(float));
  pthread_mutex_unlock(&t->mu);
}

static void expect_block_equals_ref(uint32_t b, const char *name, const ref_t *r, uint64_t version) {
  expect_block_on_equals_ref(&core[b], b, name, r, version);
}

/* ------------------------------------------------ tolerance vs unsplit */

static double param_scaled(const float *a, const float *ref, const float *prev, uint64_t n) {
  double maxd = 0, maxref = 0, upd = 0;
  for (uint64_t i = 0; i < n; i++) {
    if (!isfinite(a[i]) || !isfinite(ref[i])) {
      if (!(isnan(a[i]) && isnan(ref[i])) && a[i] != ref[i]) return INFINITY;
      continue;
    }
    double d = fabs((double)a[i] - ref[i]), r = fabs((double)ref[i]), u = fabs((double)ref[i] - prev[i]);
    if (d > maxd) maxd = d;
    if (r > maxref) maxref = r;
    if (isfinite(u) && u > upd) upd = u;
  }
  double den = maxref > upd ? maxref : upd;
  return den > 0 ? maxd / den : (maxd == 0 ? 0 : INFINITY);
}

static double state_rel(const float *a, const float *ref, uint64_t n) {
  double mx = 0, worst = 0;
  for (uint64_t i = 0; i < n; i++)
    if (isfinite(ref[i]) && fabs(ref[i]) > mx) mx = fabs(ref[i]);
  double floor = mx * 1e-6 > 1e-300 ? mx * 1e-6 : 1e-300;
  for (uint64_t i = 0; i < n; i++) {
    if (isfinite(a[i]) != isfinite(ref[i])) return INFINITY;
    if (!isfinite(a[i])) continue;
    double r = fabs((double)ref[i]);
    double e = fabs((double)a[i] - ref[i]) / (r > floor ? r : floor);
    if (e > worst) worst = e;
  }
  return worst;
}

/* ------------------------------------------------------------ golden */

static void make_bounds(uint64_t N, uint32_t nb, int layout, uint64_t *b) {
  /* layout 0: first block one row; 1: last block one row; 2: even. */
  b[0] = 0;
  b[nb] = N;
  for (uint32_t k = 1; k < nb; k++) {
    if (layout == 0) b[k] = k == 1 ? 1 : 1 + (N - 1) * (k - 1) / (nb - 1);
    else if (layout == 1) b[k] = k == nb - 1 ? N - 1 : (N - 1) * k / (nb - 1);
    else b[k] = N * k / nb;
    if (b[k] <= b[k - 1]) b[k] = b[k - 1] + 1;
  }
}

/* One golden case split over nb cores with W workers: bit for bit against
 * the reference, within tolerance of the unsplit core. */
static int golden_one(const fps_golden_case_t *c, uint32_t nb, uint32_t W, int layout, unsigned *u2) {
  const uint64_t n = c->numel;
  uint64_t N = fps_split_total_rows(&c->shape);
  uint64_t bounds[MAXS + 1];
  make_bounds(N, nb, layout, bounds);
  char path[8192], why[512];
  float *init = malloc(n * 4), *grad = malloc(n * 4), *gw[MAXW], *mean = malloc(n * 4), *whole = malloc(n * 4),
        *prev = malloc(n * 4);
  for (uint32_t w = 0; w < MAXW; w++) gw[w] = malloc(n * 4);
  snprintf(path, sizeof path, "%s/param_0.bin", c->dir);
  assert_int_equal(fps_golden_read_f32(path, init, n, why, sizeof why), 0);

  cores_up(nb, W);
  fps_shard_t uns; /* the unsplit core */
  fx_shard(&uns, FPS_MODE_SYNC, W, 0);
  whole_create(&uns, "x", &c->shape, &c->hp, init);
  for (uint32_t b = 0; b < nb; b++) blk_create(&core[b], "x", &c->shape, &c->hp, bounds, nb, b, init);
  ref_t r;
  ref_init(&r, &c->shape, &c->hp, bounds, nb, init, n);
  int fails = 0;
  for (unsigned s = 1; s <= c->steps; s++) {
    snprintf(path, sizeof path, "%s/grad_%u.bin", c->dir, s);
    assert_int_equal(fps_golden_read_f32(path, grad, n, why, sizeof why), 0);
    for (uint64_t i = 0; i < n; i++) {
      gw[0][i] = grad[i];
      if (W > 1) gw[1][i] = grad[i] * 0.375f - 0.001f * (float)(i % 3);
      mean[i] = W > 1 ? (gw[0][i] + gw[1][i]) / 2.0f : grad[i];
    }
    ref_step(&r, &c->hp, nb, mean);
    /* The unsplit core. */
    wpush_t wp[MAXS][MAXW];
    const char *nm[] = {"x"};
    for (uint32_t w = 0; w < W; w++) {
      const float *gg[] = {gw[w]};
      push_start(&wp[0][w], &uns, w, s - 1, 1, nm, gg);
    }
    for (uint32_t w = 0; w < W; w++) {
      assert_int_equal(push_result(&wp[0][w], why, sizeof why), 0);
      push_end(&wp[0][w]);
    }
    /* The split cores: workers push each core's rows, the cores in turn. */
    for (uint32_t b = 0; b < nb; b++)
      for (uint32_t w = 0; w < W; w++) {
        const float *gg[] = {gw[w] + r.g[b].row_lo * r.g[b].cols};
        push_start(&wp[b][w], &core[b], w, s - 1, 1, nm, gg);
      }
    net_idle();
    for (uint32_t b = 0; b < nb; b++)
      for (uint32_t w = 0; w < W; w++) {
        int rc = push_result(&wp[b][w], why, sizeof why);
        if (rc) print_error("%s nb %u W %u step %u core %u: %s\n", c->name, nb, W, s, b, why);
        assert_int_equal(rc, 0);
        fps_push_out_t o;
        fps_push_take(wp[b][w].p, 0, &o);
        assert_int_equal(o.version, s);
        assert_non_null(o.snap);
        assert_memory_equal(o.snap->data, r.param + r.g[b].row_lo * r.g[b].cols, r.g[b].block_numel * 4);
        fps_snap_unref(o.snap);
        push_end(&wp[b][w]);
      }
    for (uint32_t b = 0; b < nb; b++) expect_block_equals_ref(b, "x", &r, s);
    /* Within the tolerances of the unsplit core's update. */
    fps_tensor_t *ut = find(&uns, "x");
    memcpy(whole, ut->param, n * 4);
    double ps = param_scaled(r.param, whole, s == 1 ? init : prev, n);
    if (ps > PTOL) {
      print_error("%s nb %u W %u step %u: param scaled %.3e vs unsplit\n", c->name, nb, W, s, ps);
      fails++;
    }
    memcpy(prev, whole, n * 4);
  }
  /* State vs unsplit. */
  fps_tensor_t *ut = find(&uns, "x");
  for (uint32_t b = 0; b < nb; b++) {
    const fps_split_state_t *st = &r.st[b];
    const fps_split_geom_t *g = &r.g[b];
    double e = 0;
    if (g->factored) {
      e = fmax(e, state_rel(st->row, ut->st.row + g->row_lo, g->row_hi - g->row_lo));
      e = fmax(e, state_rel(st->col, ut->st.col + g->mtx_lo * g->cols, g->nmat * g->cols));
    } else {
      e = fmax(e, state_rel(st->var, ut->st.var + g->row_lo, g->block_numel));
    }
    if (e > STOL) {
      print_error("%s nb %u W %u block %u: state rel %.3e vs unsplit\n", c->name, nb, W, b, e);
      fails++;
    }
    assert_int_equal(st->step, ut->st.step);
  }
  *u2 += r.u2_steps;
  /* Every exchange was counted: one step each on every core (the counters
   * are the process's, summed over the nb cores here), nb - 1 sends per
   * step. */
  for (uint32_t b = 0; b < nb; b++) {
    fps_shard_view_t v;
    assert_int_equal(fps_shard_view(&core[b], false, 0, &v), 0);
    assert_int_equal(v.xsteps, (uint64_t)nb * c->steps);
    assert_int_equal(v.xfailures, 0);
    assert_true(v.xbytes_sent > 0 && v.xbytes_received > 0);
    fps_shard_view_free(&v);
  }
  ref_free(&r, nb);
  fx_shard_free(&uns);
  cores_down();
  for (uint32_t w = 0; w < MAXW; w++) free(gw[w]);
  free(init);
  free(grad);
  free(mean);
  free(whole);
  free(prev);
  return fails;
}

static void golden_split_over_cores(void **u) {
  (void)u;
  const char *dir = getenv("FPS_VECTORS_DIR");
  assert_non_null(dir);
  char **names;
  size_t nn;
  char why[512];
  assert_int_equal(fps_golden_list(dir, &names, &nn, why, sizeof why), 0);
  int fails = 0, runs = 0, single = 0;
  unsigned u2 = 0, wseen = 0;
  for (size_t i = 0; i < nn; i++) {
    fps_golden_case_t c;
    assert_int_equal(fps_golden_load(dir, names[i], &c, why, sizeof why), 0);
    uint64_t N = fps_split_total_rows(&c.shape);
    if (N < 2) continue;
    for (uint32_t nb = 2; nb <= MAXS && nb <= N; nb++) {
      /* W and the layout rotate over the runs (every (nb, W) pair and
       * every layout many times; all of them for every case would triple
       * the sanitizer runs' time): a block of one row first, last, or
       * even blocks. */
      uint32_t W = 1 + (uint32_t)((i + nb) % MAXW);
      int layout = (int)((i / 2 + nb) % 3);
      fails += golden_one(&c, nb, W, layout, &u2);
      runs++;
      single += layout < 2;
      wseen |= 1u << (W - 1);
    }
  }
  fps_golden_list_free(names, nn);
  print_message("golden over cores: %d runs (%d with a one-row block), %u u2 steps, %d failures\n", runs, single,
                u2, fails);
  assert_true(runs > 100 && single > 0 && u2 > 0 && wseen == 3);
  assert_int_equal(fails, 0);
}

/* ------------------------------------------------ scenarios, 2-3 cores */

#define SR 6
#define SC 5

typedef struct scen_s {
  uint32_t nb;
  fps_shape_t shape;
  fps_adafactor_hparams_t hp;
  uint64_t bounds[MAXS + 1];
  float init[SR * SC], g[SR * SC];
  ref_t r;
} scen_t;

static uint32_t scen_workers = 1; /* W of the next scen_up() */

static void scen_up(scen_t *s, uint32_t nb, bool tiny) {
  memset(s, 0, sizeof *s);
  s->nb = nb;
  s->shape.ndim = 2;
  s->shape.dim[0] = SR;
  s->shape.dim[1] = SC;
  fps_adafactor_defaults(&s->hp, FPS_FLAVOR_TORCH);
  make_bounds(SR, nb, 0, s->bounds);
  fx_fill(s->init, SR * SC, 7);
  fx_fill(s->g, SR * SC, 11);
  if (tiny)
    for (int i = 0; i < SR * SC; i++) s->g[i] *= 1e-6f;
  cores_up(nb, scen_workers);
  for (uint32_t b = 0; b < nb; b++) blk_create(&core[b], "e", &s->shape, &s->hp, s->bounds, nb, b, s->init);
  ref_init(&s->r, &s->shape, &s->hp, s->bounds, nb, s->init, SR * SC);
}

static void scen_down(scen_t *s) {
  ref_free(&s->r, s->nb);
  cores_down();
}

static const float *blk_grad(scen_t *s, uint32_t b) { return s->g + s->r.g[b].row_lo * SC; }

/* Worker 0 pushes "e" at step on every core (in order), without waiting. */
static void push_all(scen_t *s, wpush_t *wp, uint64_t step) {
  const char *nm[] = {"e"};
  for (uint32_t b = 0; b < s->nb; b++) {
    const float *gg[] = {blk_grad(s, b)};
    push_start(&wp[b], &core[b], 0, step, 1, nm, gg);
  }
}

/* Nothing changed anywhere: every block as initialised, version 0. */
static void expect_untouched(scen_t *s) {
  for (uint32_t b = 0; b < s->nb; b++) {
    fps_tensor_t *t = find(&core[b], "e");
    pthread_mutex_lock(&t->mu);
    assert_int_equal(t->version, 0);
    assert_memory_equal(t->param, s->init + s->r.g[b].row_lo * SC, s->r.g[b].block_numel * 4);
    assert_int_equal(t->split->st.step, 0);
    for (uint64_t i = 0; i < t->split->st.g.nmat * SC; i++) assert_true(t->split->st.col[i] == 0.0f);
    assert_null(t->split->xs);
    assert_false(t->round.open);
    pthread_mutex_unlock(&t->mu);
  }
}

static void expect_all_fail(scen_t *s, wpush_t *wp, const char *needle) {
  char why[FPS_WHY_MAX];
  for (uint32_t b = 0; b < s->nb; b++) {
    int rc = push_result(&wp[b], why, sizeof why);
    assert_int_equal(rc, FPS_EUNAVAILABLE);
    assert_non_null(strstr(why, "tensor 'e'"));
    if (needle && !strstr(why, needle)) print_error("core %u: '%s' lacks '%s'\n", b, why, needle);
    if (needle) assert_non_null(strstr(why, needle));
    assert_non_null(strstr(why, "nothing"));
    push_end(&wp[b]);
  }
}

static void expect_all_ok(scen_t *s, wpush_t *wp, uint64_t version) {
  char why[FPS_WHY_MAX];
  for (uint32_t b = 0; b < s->nb; b++) {
    int rc = push_result(&wp[b], why, sizeof why);
    if (rc) print_error("core %u: %s\n", b, why);
    assert_int_equal(rc, 0);
    push_end(&wp[b]);
    expect_block_equals_ref(b, "e", &s->r, version);
  }
}

static void u2_phase_tiny_gradients(void **u) {
  (void)u;
  for (uint32_t nb = 2; nb <= 3; nb++) {
    scen_t s;
    scen_up(&s, nb, true);
    wpush_t wp[MAXS];
    for (uint64_t step = 0; step < 3; step++) {
      ref_step(&s.r, &s.hp, nb, s.g);
      push_all(&s, wp, step);
      net_idle();
      expect_all_ok(&s, wp, step + 1);
    }
    assert_int_equal(s.r.u2_steps, 3); /* every step took the second exchange */
    /* STATS and U2 per peer per step, and COMMIT with 3+ blocks. */
    assert_int_equal(sends_total, 3 * (nb > 2 ? 3 : 2) * nb * (nb - 1));
    scen_down(&s);
  }
}

static void peer_never_answers(void **u) {
  (void)u;
  scen_t s;
  scen_up(&s, 2, false);
  link_mode[1][0] = LINK_HOLD; /* shard 1's partials never reach shard 0 */
  wpush_t wp[MAXS];
  push_all(&s, wp, 0);
  net_idle();
  /* Shard 1 holds shard 0's partials but waits for its acknowledgement;
   * shard 0 waits for shard 1's partials. Nobody applies. */
  for (uint32_t b = 0; b < 2; b++) assert_int_equal(wp[b].d.calls, 0);
  fps_fake_clock_advance((int64_t)(XDEADLINE_S * 1e9) - 1000);
  for (uint32_t b = 0; b < 2; b++) fps_shard_expire(&core[b], fps_fake_now_ns);
  for (uint32_t b = 0; b < 2; b++) assert_int_equal(wp[b].d.calls, 0); /* not yet */
  fps_fake_clock_advance(2000);
  for (uint32_t b = 0; b < 2; b++) fps_shard_expire(&core[b], fps_fake_now_ns);
  char why[FPS_WHY_MAX];
  assert_int_equal(push_result(&wp[0], why, sizeof why), FPS_EUNAVAILABLE);
  assert_non_null(strstr(why, "no partials from shard 1"));
  assert_int_equal(push_result(&wp[1], why, sizeof why), FPS_EUNAVAILABLE);
  assert_non_null(strstr(why, "no acknowledgement from shard 0"));
  expect_all_fail(&s, wp, "timed out");
  expect_untouched(&s);
  /* The transport gives up on the held send later: ignored. */
  net_release(FPS_EUNAVAILABLE);
  expect_untouched(&s);
  fps_shard_view_t v;
  assert_int_equal(fps_shard_view(&core[0], false, 0, &v), 0);
  assert_int_equal(v.xfailures, 2); /* the process's: both cores failed the step */
  assert_int_equal(v.xsteps, 0);
  fps_shard_view_free(&v);
  /* The link is back: the retried step applies everywhere. */
  link_mode[1][0] = LINK_OK;
  ref_step(&s.r, &s.hp, 2, s.g);
  push_all(&s, wp, 0);
  net_idle();
  expect_all_ok(&s, wp, 1);
  scen_down(&s);
}

/* The exchange's deadline: --exchange-deadline from the step's start,
 * cut by the members' call deadlines (less their margin, so they hear
 * UNAVAILABLE before their transport gives up), not by how long the round
 * waited for its workers. */
static void exchange_deadline_bounds(void **u) {
  (void)u;
  const int64_t S = INT64_C(1000000000);
  {
    /* A call with 2 s left: margin 0.5 s, so the exchange ends at 1.5 s. */
    scen_t s;
    scen_up(&s, 2, false);
    link_mode[1][0] = LINK_HOLD;
    wpush_t wp[MAXS];
    for (uint32_t b = 0; b < 2; b++) {
      wp[b].p = fx_push_new(&core[b], 0, 0, fps_fake_now_ns + 2 * S, &wp[b].d);
      assert_int_equal(fx_push_grad(wp[b].p, "e", blk_grad(&s, b), s.r.g[b].block_numel, 1, NULL), 0);
      wp[b].rc = fps_push_commit(wp[b].p, wp[b].why, sizeof wp[b].why);
      assert_int_equal(wp[b].rc, FPS_EAGAIN);
    }
    net_idle();
    fps_fake_clock_advance(3 * S / 2 - 1000);
    for (uint32_t b = 0; b < 2; b++) fps_shard_expire(&core[b], fps_fake_now_ns);
    for (uint32_t b = 0; b < 2; b++) assert_int_equal(wp[b].d.calls, 0);
    fps_fake_clock_advance(2000);
    for (uint32_t b = 0; b < 2; b++) fps_shard_expire(&core[b], fps_fake_now_ns);
    expect_all_fail(&s, wp, "timed out");
    expect_untouched(&s);
    scen_down(&s);
  }
  {
    /* Two workers, the second 9.5 s after the first (--deadline 10 s):
     * the exchange still gets its 5 s. */
    scen_workers = 2;
    scen_t s;
    scen_up(&s, 2, false);
    scen_workers = 1;
    link_mode[1][0] = LINK_HOLD;
    wpush_t wp[MAXS][2];
    const char *nm[] = {"e"};
    for (uint32_t b = 0; b < 2; b++) {
      const float *gg[] = {blk_grad(&s, b)};
      push_start(&wp[b][0], &core[b], 0, 0, 1, nm, gg);
    }
    fps_fake_clock_advance(19 * S / 2);
    for (uint32_t b = 0; b < 2; b++) {
      const float *gg[] = {blk_grad(&s, b)};
      push_start(&wp[b][1], &core[b], 1, 0, 1, nm, gg);
    }
    net_idle();
    fps_fake_clock_advance(4 * S);
    for (uint32_t b = 0; b < 2; b++) fps_shard_expire(&core[b], fps_fake_now_ns);
    for (uint32_t b = 0; b < 2; b++)
      for (int w = 0; w < 2; w++) assert_int_equal(wp[b][w].d.calls, 0);
    net_release(0);
    ref_step(&s.r, &s.hp, 2, s.g); /* the mean of two equal gradients */
    char why[FPS_WHY_MAX];
    for (uint32_t b = 0; b < 2; b++)
      for (int w = 0; w < 2; w++) {
        int rc = push_result(&wp[b][w], why, sizeof why);
        if (rc) print_error("core %u worker %d: %s\n", b, w, why);
        assert_int_equal(rc, 0);
        push_end(&wp[b][w]);
      }
    for (uint32_t b = 0; b < 2; b++) expect_block_equals_ref(b, "e", &s.r, 1);
    scen_down(&s);
  }
}

static void refused_send(void **u) {
  (void)u;
  for (int variant = 0; variant < 2; variant++) {
    scen_t s;
    scen_up(&s, 3, false);
    /* Shard 2's send to shard 0 is refused at once, or shard 0 refuses. */
    link_mode[2][0] = variant ? LINK_HOLD : LINK_REFUSE;
    wpush_t wp[MAXS];
    push_all(&s, wp, 0);
    net_idle();
    if (variant) {
      /* Shard 0 refuses block 2's partials after every other message
       * went through. */
      link_mode[2][0] = LINK_PEER_ERR;
      net_release(0);
    }
    char why[FPS_WHY_MAX];
    /* Shard 2 failed at once (the refusal came inside its commit). */
    assert_int_equal(push_result(&wp[2], why, sizeof why), FPS_EUNAVAILABLE);
    assert_non_null(strstr(why, "exchange with shard 0 failed"));
    if (variant) assert_non_null(strstr(why, "test refusal"));
    /* Shard 0 never gets block 2's partials: its deadline. */
    fps_fake_clock_advance((int64_t)(XDEADLINE_S * 1e9) + 1000);
    for (uint32_t b = 0; b < 3; b++) fps_shard_expire(&core[b], fps_fake_now_ns);
    assert_int_equal(push_result(&wp[0], why, sizeof why), FPS_EUNAVAILABLE);
    assert_non_null(strstr(why, "no partials from shard 2"));
    push_end(&wp[0]);
    push_end(&wp[2]);
    if (!variant) {
      /* Refused at once: shard 2 stopped sending (its step had failed), so
       * shard 1 lacks block 2's partials and times out too. */
      assert_int_equal(push_result(&wp[1], why, sizeof why), FPS_EUNAVAILABLE);
      assert_non_null(strstr(why, "no partials from shard 2"));
      push_end(&wp[1]);
      expect_untouched(&s);
    } else {
      /* Shard 2's partials reached shard 1 before shard 0's refusal, so
       * shard 1 held every block's partials and every acknowledgement;
       * it still applies nothing: its COMMIT reached shard 2, whose step
       * failed, and no COMMIT came from shards 0 and 2 (a commit round:
       * no block applies unless every block does). */
      assert_int_equal(push_result(&wp[1], why, sizeof why), FPS_EUNAVAILABLE);
      assert_non_null(strstr(why, "commit"));
      push_end(&wp[1]);
      expect_untouched(&s);
    }
    scen_down(&s);
  }
}

static void refused_send_two_shards(void **u) {
  (void)u;
  /* With two shards a refused send leaves nobody able to apply. */
  scen_t s;
  scen_up(&s, 2, false);
  link_mode[1][0] = LINK_REFUSE;
  wpush_t wp[MAXS];
  push_all(&s, wp, 0);
  net_idle();
  char why[FPS_WHY_MAX];
  assert_int_equal(push_result(&wp[1], why, sizeof why), FPS_EUNAVAILABLE);
  assert_non_null(strstr(why, "shard 0"));
  assert_non_null(strstr(why, "refused at once"));
  fps_fake_clock_advance((int64_t)(XDEADLINE_S * 1e9) + 1000);
  fps_shard_expire(&core[0], fps_fake_now_ns);
  expect_all_fail(&s, wp, NULL);
  expect_untouched(&s);
  scen_down(&s);
}

static void lost_ack_then_retry(void **u) {
  (void)u;
  scen_t s;
  scen_up(&s, 2, false);
  link_mode[0][1] = LINK_LOSE_ACK;
  wpush_t wp[MAXS];
  ref_step(&s.r, &s.hp, 2, s.g);
  push_all(&s, wp, 0);
  net_idle();
  /* Shard 1 applied on the first delivery of shard 0's partials (it had
   * its own acknowledged); the retry found that step over and the same
   * bytes: OK, and shard 0 applied too. */
  assert_int_equal(last_rc[0][1], 0);
  expect_all_ok(&s, wp, 1);
  /* And the next step works on top. */
  link_mode[0][1] = LINK_OK;
  ref_step(&s.r, &s.hp, 2, s.g);
  push_all(&s, wp, 1);
  net_idle();
  expect_all_ok(&s, wp, 2);
  scen_down(&s);
}

/* The partials block b of scenario s would send at its current state
 * (fresh: step 0), with gradient g: wire form into buf. */
static size_t craft(scen_t *s, uint32_t b, const float *g, int phase, uint8_t *buf, size_t cap) {
  fps_split_state_t st;
  assert_int_equal(fps_split_state_init(&st, &s->r.g[b], &s->hp), 0);
  float p[SR * SC];
  memcpy(p, s->init + s->r.g[b].row_lo * SC, s->r.g[b].block_numel * 4);
  fps_split_step_t *step;
  assert_int_equal(fps_split_step_begin(NULL, &s->hp, &st, p, g + s->r.g[b].row_lo * SC, NULL, &step), 0);
  assert_int_equal(phase, FPS_SPLIT_PHASE_STATS);
  size_t n = fps_split_partials_encode(fps_split_step_partials(step), buf, cap);
  assert_true(n > 0);
  fps_split_step_free(step);
  fps_split_state_destroy(&st);
  return n;
}

static void expect_in(const char *why, const char *needle) {
  if (needle && !strstr(why, needle)) print_error("'%s' lacks '%s'\n", why, needle);
  if (needle) assert_non_null(strstr(why, needle));
}

static void receive_checks_in_order(void **u) {
  (void)u;
  scen_t s;
  scen_up(&s, 3, false);
  fps_adafactor_hparams_t hp = s.hp;
  whole_create(&core[0], "w", &s.shape, &hp, s.init);
  uint8_t buf[4096], other[4096];
  size_t len = craft(&s, 1, s.g, FPS_SPLIT_PHASE_STATS, buf, sizeof buf);
  char why[FPS_WHY_MAX];
  fps_xmsg_t m = {.name = "e", .version = 0, .from_shard = 1, .shard_count = 3, .block_index = 1,
                  .phase = FPS_SPLIT_PHASE_STATS, .partials = buf, .len = len};
  fps_xmsg_t x;
#define RECV(mod, code, needle)                                                  \
  do {                                                                           \
    x = m;                                                                       \
    mod;                                                                         \
    why[0] = 0;                                                                  \
    int rc_ = fps_shard_exchange_receive(&core[0], &x, NULL, why, sizeof why);         \
    if (rc_ != (code)) print_error("got %d (%s), want %d\n", rc_, why, (code));  \
    assert_int_equal(rc_, (code));                                               \
    expect_in(why, (needle));                                                    \
  } while (0)
  RECV(x.name = "", FPS_EINVAL, "name");
  RECV(x.phase = 0, FPS_EINVAL, "phase 0");
  RECV(x.shard_count = 4, FPS_ESTATE, "one of 4 shards");
  RECV(x.from_shard = 0, FPS_EINVAL, "not another shard");
  RECV(x.from_shard = 3, FPS_EINVAL, "not another shard");
  RECV(x.len = len - 1, FPS_EINVAL, "from shard 1");
  RECV(x.name = "nope", FPS_ENOTFOUND, "no row block");
  RECV(x.name = "w", FPS_ESTATE, "whole");
  RECV(x.block_index = 0, FPS_ESTATE, "not in this shard's map");
  RECV(x.block_index = 2, FPS_ESTATE, "not in this shard's map");
  RECV(x.block_index = 7, FPS_ESTATE, "not in this shard's map");
  RECV(x.version = 2, FPS_ESTATE, "version 2, more than one step ahead of this shard's block (version 0, 2 steps");
  /* A version of all ones reads as what it is, not as 20 digits. */
  RECV(x.version = UINT64_MAX, FPS_ESTATE, "the step from version 2^64 - 1, more than one step ahead");
  expect_in(why, "(version 0, 2^64 - 1 steps behind them)");
  assert_null(strstr(why, "18446744073709551615"));
  /* Block 2's partials sent as block 2 from shard 1: not its map. */
  size_t len2 = craft(&s, 2, s.g, FPS_SPLIT_PHASE_STATS, other, sizeof other);
  RECV((x.partials = other, x.len = len2), FPS_ESTATE, "do not fit block 1");
  /* A column state other than ours (before step 0 it is zero). */
  memcpy(other, buf, len);
  float one = 1.0f;
  /* col_old of matrix 0, first column: after rsum, rmin, colsum[C], s[C]. */
  memcpy(other + FPS_SPLIT_PARTIALS_HEADER + 16 + 16 * SC, &one, 4);
  RECV(x.partials = other, FPS_ESTATE, "column state");
  /* Early partials (version 0 before our step; version 1: one ahead) are
   * kept; an identical retry is OK, different ones are not. */
  RECV((void)0, 0, NULL);
  RECV((void)0, 0, NULL);
  memcpy(other, buf, len);
  other[FPS_SPLIT_PARTIALS_HEADER - 9] ^= 1; /* the u2 field's last byte */
  RECV(x.partials = other, FPS_EEXISTS, "already received");
  expect_in(why, "for the step from version 0 (attempt 0 (pushes without a push_id))");
  RECV(x.version = 1, 0, NULL);
  RECV(x.version = 1, 0, NULL);
  RECV((x.version = 1, x.partials = other), FPS_EEXISTS, "already received");
  /* Nothing above changed the block. */
  expect_untouched(&s);
  /* The early partials of block 1 are used by the step. */
  ref_step(&s.r, &s.hp, 3, s.g);
  wpush_t wp[MAXS];
  push_all(&s, wp, 0);
  net_idle();
  expect_all_ok(&s, wp, 1);
  /* Now block 1's version-0 partials are an identical retry of the step
   * just finished (OK); anything else of version 0 is over. */
  RECV((void)0, 0, NULL);
  RECV(x.partials = other, FPS_ESTATE, "that step is over");
  /* The version-1 partials kept earlier carry the column state before
   * step 0: checked when step 1 starts, they fail it at once (nothing
   * sent, nothing applied). */
  wpush_t w1;
  const char *nm[] = {"e"};
  const float *gg[] = {blk_grad(&s, 0)};
  push_start(&w1, &core[0], 0, 1, 1, nm, gg);
  assert_int_equal(push_result(&w1, why, sizeof why), FPS_EUNAVAILABLE);
  assert_non_null(strstr(why, "diverged"));
  push_end(&w1);
  expect_block_equals_ref(0, "e", &s.r, 1);
  scen_down(&s);
#undef RECV
}

static void early_partials_from_faster_peers(void **u) {
  (void)u;
  scen_t s;
  scen_up(&s, 3, false);
  wpush_t wp[MAXS];
  const char *nm[] = {"e"};
  ref_step(&s.r, &s.hp, 3, s.g);
  /* Shards 2 and 1 step first: their partials wait in shard 0's mail. */
  for (uint32_t b = 3; b-- > 1;) {
    const float *gg[] = {blk_grad(&s, b)};
    push_start(&wp[b], &core[b], 0, 0, 1, nm, gg);
    net_idle();
  }
  fps_tensor_t *t0 = find(&core[0], "e");
  pthread_mutex_lock(&t0->mu);
  assert_non_null(t0->split->mail);
  assert_null(t0->split->xs);
  pthread_mutex_unlock(&t0->mu);
  assert_int_equal(wp[1].d.calls, 0);
  const float *gg[] = {blk_grad(&s, 0)};
  push_start(&wp[0], &core[0], 0, 0, 1, nm, gg);
  net_idle();
  expect_all_ok(&s, wp, 1);
  scen_down(&s);
}

static void set_of_block_and_whole_tensor(void **u) {
  (void)u;
  for (int fail = 0; fail < 2; fail++) {
    scen_t s;
    scen_up(&s, 2, false);
    /* Shard 0 also holds "w" whole; worker 0's call there names both. */
    float winit[SR * SC], wg[SR * SC];
    fx_fill(winit, SR * SC, 3);
    fx_fill(wg, SR * SC, 5);
    whole_create(&core[0], "w", &s.shape, &s.hp, winit);
    fps_shard_t lone; /* "w" alone, for its expected result */
    fx_shard(&lone, FPS_MODE_SYNC, 1, 0);
    whole_create(&lone, "w", &s.shape, &s.hp, winit);
    if (fail) link_mode[1][0] = LINK_HOLD;
    wpush_t wp[MAXS];
    const char *nm2[] = {"e", "w"}, *nm1[] = {"e"};
    const float *g0[] = {blk_grad(&s, 0), wg}, *g1[] = {blk_grad(&s, 1)};
    push_start(&wp[0], &core[0], 0, 0, 2, nm2, g0);
    push_start(&wp[1], &core[1], 0, 0, 1, nm1, g1);
    net_idle();
    char why[FPS_WHY_MAX];
    if (fail) {
      fps_fake_clock_advance((int64_t)(XDEADLINE_S * 1e9) + 1000);
      for (uint32_t b = 0; b < 2; b++) fps_shard_expire(&core[b], fps_fake_now_ns);
      assert_int_equal(push_result(&wp[0], why, sizeof why), FPS_EUNAVAILABLE);
      assert_non_null(strstr(why, "'w'")); /* the linked rounds are named */
      expect_all_fail(&s, wp, NULL);
      expect_untouched(&s);
      float now[SR * SC];
      assert_int_equal(fx_params(&core[0], "w", now), 0);
      assert_memory_equal(now, winit, sizeof now);
    } else {
      ref_step(&s.r, &s.hp, 2, s.g);
      wpush_t lw;
      const char *nw[] = {"w"};
      const float *gw[] = {wg};
      push_start(&lw, &lone, 0, 0, 1, nw, gw);
      assert_int_equal(push_result(&lw, why, sizeof why), 0);
      push_end(&lw);
      expect_all_ok(&s, wp, 1);
      float a[SR * SC], b[SR * SC];
      assert_int_equal(fx_params(&core[0], "w", a), 1);
      assert_int_equal(fx_params(&lone, "w", b), 1);
      assert_memory_equal(a, b, sizeof a);
    }
    fx_shard_free(&lone);
    scen_down(&s);
  }
}

/* One call naming two split tensors on every core: one group exchanges
 * both; each matches its own reference, and a failure of either's
 * exchange fails both. */
static void two_split_tensors_in_one_call(void **u) {
  (void)u;
  for (int fail = 0; fail < 2; fail++) {
    scen_t s;
    scen_up(&s, 3, false);
    /* "f": 1-D, 7 elements, other bounds; fresh reference of its own. */
    fps_shape_t fs = {.ndim = 1, .dim = {7}};
    uint64_t fb[] = {0, 3, 4, 7};
    float finit[7], fg[7];
    fx_fill(finit, 7, 21);
    fx_fill(fg, 7, 22);
    for (uint32_t b = 0; b < 3; b++) blk_create(&core[b], "f", &fs, &s.hp, fb, 3, b, finit);
    ref_t fr;
    ref_init(&fr, &fs, &s.hp, fb, 3, finit, 7);
    if (fail) link_mode[2][1] = LINK_HOLD;
    wpush_t wp[MAXS];
    const char *nm[] = {"e", "f"};
    for (uint32_t b = 0; b < 3; b++) {
      const float *gg[] = {blk_grad(&s, b), fg + fb[b]};
      push_start(&wp[b], &core[b], 0, 0, 2, nm, gg);
    }
    net_idle();
    if (fail) {
      fps_fake_clock_advance((int64_t)(XDEADLINE_S * 1e9) + 1000);
      for (uint32_t b = 0; b < 3; b++) fps_shard_expire(&core[b], fps_fake_now_ns);
      char why[FPS_WHY_MAX];
      /* 2 -> 1 is held: shard 1 lacks block 2's partials and shard 2
       * shard 1's acknowledgement, so neither applies either tensor.
       * Shard 0 has everything and every acknowledgement, but no COMMIT
       * from shards 1 and 2: it applies nothing either. */
      assert_int_equal(push_result(&wp[0], why, sizeof why), FPS_EUNAVAILABLE);
      assert_non_null(strstr(why, "no commit from shard 1, 2"));
      for (uint32_t b = 0; b < 3; b++) {
        assert_int_equal(push_result(&wp[b], why, sizeof why), FPS_EUNAVAILABLE);
        fps_tensor_t *te = find(&core[b], "e"), *tf = find(&core[b], "f");
        assert_int_equal(te->version, 0);
        assert_int_equal(tf->version, 0);
        assert_memory_equal(tf->param, finit + fb[b], (fb[b + 1] - fb[b]) * 4);
      }
      for (uint32_t b = 0; b < 3; b++) push_end(&wp[b]);
    } else {
      ref_step(&s.r, &s.hp, 3, s.g);
      ref_step(&fr, &s.hp, 3, fg);
      expect_all_ok(&s, wp, 1);
      for (uint32_t b = 0; b < 3; b++) expect_block_equals_ref(b, "f", &fr, 1);
    }
    ref_free(&fr, 3);
    scen_down(&s);
  }
}

static void member_cancelled_mid_exchange(void **u) {
  (void)u;
  scen_t s;
  scen_up(&s, 2, false);
  link_mode[1][0] = LINK_HOLD;
  wpush_t wp[MAXS];
  push_all(&s, wp, 0);
  net_idle();
  /* Shard 0's member goes away while its set exchanges: the exchange goes
   * on (shard 1 may apply with our partials: failing alone would
   * diverge), and a retry of that push meanwhile is told to wait. */
  fps_push_cancel(wp[0].p);
  assert_int_equal(wp[0].d.calls, 0);
  wpush_t again;
  const char *nm[] = {"e"};
  const float *gg[] = {blk_grad(&s, 0)};
  push_start(&again, &core[0], 0, 0, 1, nm, gg);
  char why[FPS_WHY_MAX];
  assert_int_equal(push_result(&again, why, sizeof why), FPS_EUNAVAILABLE);
  assert_non_null(strstr(why, "exchanging partials"));
  push_end(&again);
  ref_step(&s.r, &s.hp, 2, s.g);
  net_release(0);
  expect_all_ok(&s, wp, 1);
  scen_down(&s);
}

static void stale_and_ahead_pushes(void **u) {
  (void)u;
  scen_t s;
  scen_up(&s, 2, false);
  wpush_t wp[MAXS];
  ref_step(&s.r, &s.hp, 2, s.g);
  push_all(&s, wp, 0);
  net_idle();
  expect_all_ok(&s, wp, 1);
  char why[FPS_WHY_MAX];
  wpush_t w;
  const char *nm[] = {"e"};
  const float *gg[] = {blk_grad(&s, 0)};
  w.p = fx_push_new(&core[0], 0, 0, INT64_MAX, &w.d);
  assert_int_equal(fx_push_grad(w.p, "e", gg[0], s.r.g[0].block_numel, 1, NULL), FPS_ESTALE);
  push_end(&w);
  w.p = fx_push_new(&core[0], 0, 5, INT64_MAX, &w.d);
  assert_int_equal(fx_push_grad(w.p, "e", gg[0], s.r.g[0].block_numel, 1, NULL), FPS_EAHEAD);
  push_end(&w);
  (void)why;
  (void)nm;
  expect_block_equals_ref(0, "e", &s.r, 1);
  scen_down(&s);
}

static void shutdown_fails_exchange(void **u) {
  (void)u;
  scen_t s;
  scen_up(&s, 2, false);
  link_mode[1][0] = LINK_HOLD;
  wpush_t wp[MAXS];
  push_all(&s, wp, 0);
  net_idle();
  fps_shard_fail_waiting(&core[0], FPS_EUNAVAILABLE, "the shard is shutting down");
  fps_shard_fail_waiting(&core[1], FPS_EUNAVAILABLE, "the shard is shutting down");
  expect_all_fail(&s, wp, "shutting down");
  expect_untouched(&s);
  scen_down(&s);
}

/* Every allocation of a step (commits, pass A, partials, receives,
 * combine, U2, apply) fails in turn, on whichever core makes it: after the
 * deadline, every core is at the same version, with the reference's
 * params there if it applied and its initial ones if not: an allocation
 * that fails never lets one block apply without the others. */
static void oom_sweep_stays_consistent(void **u) {
  (void)u;
  for (int tiny = 0; tiny < 2; tiny++) {
    uint64_t calls = 0;
    unsigned applied = 0, failed = 0;
    for (uint64_t nth = 0;; nth++) {
      scen_t s;
      scen_up(&s, 2, tiny);
      wpush_t wp[MAXS];
      for (uint32_t b = 0; b < 2; b++) {
        wp[b].p = fx_push_new(&core[b], 0, 0, INT64_MAX, &wp[b].d);
        assert_int_equal(fx_push_grad(wp[b].p, "e", blk_grad(&s, b), s.r.g[b].block_numel, 1, NULL), 0);
      }
      /* Both steps start before any partials travel: the same allocations
       * in the same order every time. */
      link_mode[0][1] = link_mode[1][0] = LINK_HOLD;
      fps_alloc_fault_arm(nth, 0);
      for (uint32_t b = 0; b < 2; b++) wp[b].rc = fps_push_commit(wp[b].p, wp[b].why, sizeof wp[b].why);
      link_mode[0][1] = link_mode[1][0] = LINK_OK;
      net_release(0);
      if (nth == 0) calls = fps_alloc_calls();
      fps_alloc_fault_disarm();
      fps_fake_clock_advance((int64_t)(XDEADLINE_S * 1e9) + 1000);
      for (uint32_t b = 0; b < 2; b++) fps_shard_expire(&core[b], fps_fake_now_ns);
      net_idle();
      char why[FPS_WHY_MAX];
      int rc0 = push_result(&wp[0], why, sizeof why), rc1 = push_result(&wp[1], why, sizeof why);
      for (uint32_t b = 0; b < 2; b++) push_end(&wp[b]);
      uint64_t v0 = find(&core[0], "e")->version, v1 = find(&core[1], "e")->version;
      if (v0 != v1) print_error("nth %llu: versions %llu and %llu\n", (unsigned long long)nth,
                                (unsigned long long)v0, (unsigned long long)v1);
      assert_int_equal(v0, v1);
      assert_int_equal(rc0 == 0, v0 == 1);
      assert_int_equal(rc1 == 0, v1 == 1);
      if (v0 == 1) {
        ref_step(&s.r, &s.hp, 2, s.g);
        for (uint32_t b = 0; b < 2; b++) expect_block_equals_ref(b, "e", &s.r, 1);
        applied++;
      } else {
        expect_untouched(&s);
        failed++;
      }
      scen_down(&s);
      if (nth > 0 && nth >= calls) break;
    }
    print_message("oom sweep (%s): %llu allocations, %u applied, %u failed\n", tiny ? "u2" : "stats",
                  (unsigned long long)calls, applied, failed);
    /* Most failures fail the step; one that hits a partial's send or
     * receive may be retried within the deadline and the step applies on
     * every block. Either is right: what the loop above checks is that
     * the blocks never part. */
    assert_true(calls > 10 && failed > calls / 2 && applied + failed == calls + 1);
  }
}

/* Worker 0 pushes "e" at step on every core with push_id id and the whole
 * gradient g (each core its block's rows), without waiting. */
static void push_all_id(scen_t *s, wpush_t *wp, uint64_t step, uint64_t id, const float *g) {
  char why[FPS_WHY_MAX];
  for (uint32_t b = 0; b < s->nb; b++) {
    wp[b].p = fx_push_new(&core[b], 0, step, INT64_MAX, &wp[b].d);
    assert_int_equal(fps_push_set_id(wp[b].p, id, why, sizeof why), 0);
    assert_int_equal(fx_push_grad(wp[b].p, "e", g + s->r.g[b].row_lo * SC, s->r.g[b].block_numel, 1, NULL), 0);
    wp[b].rc = fps_push_commit(wp[b].p, wp[b].why, sizeof wp[b].why);
  }
}

/* One worker's push of "e" with push_id id, on core b alone. */
static void push_one_id(scen_t *s, wpush_t *w, uint32_t b, uint64_t step, uint64_t id, const float *g) {
  char why[FPS_WHY_MAX];
  w->p = fx_push_new(&core[b], 0, step, INT64_MAX, &w->d);
  assert_int_equal(fps_push_set_id(w->p, id, why, sizeof why), 0);
  assert_int_equal(fx_push_grad(w->p, "e", g + s->r.g[b].row_lo * SC, s->r.g[b].block_numel, 1, NULL), 0);
  w->rc = fps_push_commit(w->p, w->why, sizeof w->why);
}

/* A peer's real early partials cannot be pushed out by a third party:
 * shard 1 steps first and its partials wait in shard 0's mail; two
 * Exchange calls claiming block 1 with made-up attempts are refused
 * (UNAVAILABLE, nothing kept) instead of evicting them; shard 0's own
 * step then finds the real ones and both blocks apply the same step. */
static void forged_partials_evict_nothing(void **u) {
  (void)u;
  scen_t s;
  scen_up(&s, 2, false);
  ref_step(&s.r, &s.hp, 2, s.g);
  wpush_t wp[MAXS];
  push_one_id(&s, &wp[1], 1, 0, 4242, s.g);
  net_idle();
  assert_int_equal(wp[1].d.calls, 0); /* waits for shard 0's partials */
  uint8_t buf[4096];
  size_t len = craft(&s, 1, s.g, FPS_SPLIT_PHASE_STATS, buf, sizeof buf);
  char why[FPS_WHY_MAX];
  unsigned refused = 0;
  for (uint64_t a = 0xf00d0001; a <= 0xf00d0002; a++) {
    fps_xmsg_t m = {.name = "e", .version = 0, .from_shard = 1, .shard_count = 2, .block_index = 1,
                    .phase = FPS_SPLIT_PHASE_STATS, .attempt = a, .partials = buf, .len = len};
    int rc = fps_shard_exchange_receive(&core[0], &m, NULL, why, sizeof why);
    if (rc == FPS_EUNAVAILABLE) refused++;
  }
  /* The real attempt's partials plus one made-up attempt fill the room;
   * the second made-up one waits. */
  assert_int_equal(refused, 1);
  expect_in(why, "already wait here");
  push_one_id(&s, &wp[0], 0, 0, 4242, s.g);
  net_idle();
  expect_all_ok(&s, wp, 1);
  scen_down(&s);
}

/* Holds (or frees) every link to and from core c: c is frozen. */
static void freeze(uint32_t c, int mode) {
  for (uint32_t o = 0; o < ncores; o++)
    if (o != c) link_mode[c][o] = link_mode[o][c] = mode;
}

/* The colleague's case: shard 2 frozen during step 0 (attempt A), shards
 * 0 and 1 fail it at the deadline; shard 2 resumes and its step A's
 * partials reach them: kept (3 blocks: a retry of A may meet them), but
 * its COMMIT is not acknowledged (no step of A in flight there), so shard
 * 2's step fails too and nothing applies. The workers push step 0 again with another
 * gradient (attempt B): every core applies B alone, as an unsplit run of
 * that one push would. */
static void dead_attempt_partials_refused(void **u) {
  (void)u;
  scen_t s;
  scen_up(&s, 3, false);
  float g2[SR * SC];
  fx_fill(g2, SR * SC, 23);
  freeze(2, LINK_HOLD);
  wpush_t wp[MAXS];
  push_all_id(&s, wp, 0, 1001, s.g);
  net_idle();
  fps_fake_clock_advance((int64_t)(XDEADLINE_S * 1e9) + 1000);
  for (uint32_t b = 0; b < 2; b++) fps_shard_expire(&core[b], fps_fake_now_ns); /* 2 is frozen */
  char why[FPS_WHY_MAX];
  for (uint32_t b = 0; b < 2; b++) {
    assert_int_equal(push_result(&wp[b], why, sizeof why), FPS_EUNAVAILABLE);
    push_end(&wp[b]);
  }
  assert_int_equal(wp[2].d.calls, 0);
  /* Shard 2 resumes: what was queued to and from it is delivered. */
  freeze(2, LINK_OK);
  net_release(0);
  /* Its partials are kept (a retry of A may still begin there), but its
   * COMMIT is not acknowledged: no step of A is in flight on shards 0 and
   * 1 (a real transport retries it until shard 2's deadline), so shard 2
   * applies nothing either. */
  for (uint32_t b = 0; b < 2; b++) {
    assert_int_equal(last_rc[2][b], FPS_EUNAVAILABLE);
    expect_in(last_why[2][b], "commit of the step from version 0");
    expect_in(last_why[2][b], "no step of it is in flight");
  }
  assert_int_equal(push_result(&wp[2], why, sizeof why), FPS_EUNAVAILABLE);
  expect_in(why, "(commit)");
  push_end(&wp[2]);
  expect_untouched(&s);
  /* Attempt A's partials again (the frozen shard's transport retrying):
   * the same bytes as those kept, so OK; nothing applies without a
   * COMMIT round. */
  uint8_t buf[4096];
  size_t len = craft(&s, 2, s.g, FPS_SPLIT_PHASE_STATS, buf, sizeof buf);
  fps_xmsg_t m = {.name = "e", .version = 0, .from_shard = 2, .shard_count = 3, .block_index = 2,
                  .phase = FPS_SPLIT_PHASE_STATS, .attempt = 0, .partials = buf, .len = len};
  /* The attempt shard 0 failed: learn it from its refusal of the COMMIT. */
  const char *hex = strstr(last_why[2][0], "attempt 0x");
  assert_non_null(hex);
  expect_in(hex, "(a hash of its pushes' push_ids)");
  m.attempt = strtoull(hex + 8, NULL, 16);
  assert_true(m.attempt != 0);
  assert_int_equal(fps_shard_exchange_receive(&core[0], &m, NULL, why, sizeof why), 0);
  /* Partials of some other attempt of step 0 are kept (acknowledged) for a
   * step of that attempt; 2 attempts are kept (A and 1), a third waits
   * (UNAVAILABLE) and evicts nothing. */
  for (uint64_t a = 1; a <= 3; a++) {
    fps_xmsg_t o = m;
    o.attempt = a;
    assert_int_equal(fps_shard_exchange_receive(&core[0], &o, NULL, why, sizeof why), a <= 1 ? 0 : FPS_EUNAVAILABLE);
  }
  expect_in(why, "2 other attempts of block 2's STATS partials for the step from version 0 already wait here");
  fps_tensor_t *t0 = find(&core[0], "e");
  pthread_mutex_lock(&t0->mu);
  assert_null(t0->split->xs);
  pthread_mutex_unlock(&t0->mu);
  /* Attempt B, another gradient: only B's partials are combined. The
   * mean gradient with W = 1 is g2 itself. */
  ref_step(&s.r, &s.hp, 3, g2);
  push_all_id(&s, wp, 0, 2002, g2);
  net_idle();
  expect_all_ok(&s, wp, 1);
  for (uint32_t b = 0; b < 3; b++) assert_int_equal(find(&core[b], "e")->version, 1);
  /* And the unsplit core agrees (the blocks match common's split math bit
   * for bit above; this is the whole tensor stepped once with g2). */
  {
    fps_shard_t whole;
    const fps_kernels_t *k;
    assert_int_equal(fps_kernels_by_name("auto", &k, why, sizeof why), 0);
    fps_shard_opts_t o = {.shard_id = 0, .shard_count = 1, .mode = FPS_MODE_SYNC, .workers = 1,
                          .deadline = FX_DEADLINE_S, .max_tensors = 8, .max_bytes = 16u << 20,
                          .max_staging_bytes = 16u << 20, .apply_log = 8, .checkpoint_dir = ""};
    assert_int_equal(fps_shard_init(&whole, &o, k, NULL), 0);
    whole_create(&whole, "e", &s.shape, &s.hp, s.init);
    fx_done_t d = {0};
    fps_push_t *p = fx_push_new(&whole, 0, 0, INT64_MAX, &d);
    assert_int_equal(fx_push_grad(p, "e", g2, SR * SC, 1, NULL), 0);
    assert_int_equal(fx_commit(p, why), 0);
    fps_push_destroy(p);
    float wparam[SR * SC];
    assert_int_equal(fx_params(&whole, "e", wparam), 1);
    for (uint32_t b = 0; b < 3; b++) {
      fps_tensor_t *t = find(&core[b], "e");
      const float *ref = wparam + s.r.g[b].row_lo * SC, *prev = s.init + s.r.g[b].row_lo * SC;
      double e = param_scaled(t->param, ref, prev, s.r.g[b].block_numel);
      if (e > PTOL) print_error("block %u: param scaled error %g\n", b, e);
      assert_true(e <= PTOL);
    }
    fps_shard_destroy(&whole);
  }
  scen_down(&s);
}

/* A step that failed everywhere, pushed again with the same push_ids (a
 * retry: the same attempt, the same partials), applies once every core
 * has started it again; an Exchange retried within the attempt (a lost
 * acknowledgement) is accepted as identical. */
static void failed_attempt_retried(void **u) {
  (void)u;
  scen_t s;
  scen_up(&s, 3, false);
  freeze(2, LINK_HOLD);
  wpush_t wp[MAXS];
  push_all_id(&s, wp, 0, 77, s.g);
  net_idle();
  fps_fake_clock_advance((int64_t)(XDEADLINE_S * 1e9) + 1000);
  for (uint32_t b = 0; b < 3; b++) fps_shard_expire(&core[b], fps_fake_now_ns);
  net_release(FPS_EUNAVAILABLE);
  expect_all_fail(&s, wp, "timed out");
  expect_untouched(&s);
  /* The retry: every core starts it before the partials flow (a peer's
   * retry arriving before this core restarted is refused: docs/shards.md). */
  for (uint32_t c = 0; c < 3; c++) freeze(c, LINK_HOLD);
  ref_step(&s.r, &s.hp, 3, s.g);
  push_all_id(&s, wp, 0, 77, s.g);
  net_idle();
  for (uint32_t c = 0; c < 3; c++) freeze(c, LINK_OK);
  link_mode[1][0] = LINK_LOSE_ACK;
  net_release(0);
  assert_int_equal(last_rc[1][0], 0);
  expect_all_ok(&s, wp, 1);
  scen_down(&s);
}

/* A standby replica of shard 0 (core[MAXS]) holding core[0]'s block "e"
 * as the primary ships it (fps_shard_image, fps_shard_install). */
static fps_shard_t *standby_of_0(const scen_t *s) {
  const fps_kernels_t *k;
  char why[FPS_WHY_MAX];
  assert_int_equal(fps_kernels_by_name("auto", &k, why, sizeof why), 0);
  fps_shard_t *sb = &core[MAXS];
  fps_shard_opts_t o = {.shard_id = 0, .shard_count = s->nb, .mode = FPS_MODE_SYNC, .workers = scen_workers,
                        .deadline = FX_DEADLINE_S, .max_tensors = 64, .max_bytes = 64u << 20,
                        .max_staging_bytes = 64u << 20, .apply_log = 8, .checkpoint_dir = ""};
  assert_int_equal(fps_shard_init(sb, &o, k, NULL), 0);
  node_id[MAXS] = 0;
  fps_shard_set_exchange(sb, net_send, &node_id[MAXS], XDEADLINE_S);
  fps_image_t img;
  int rc = fps_shard_image(&core[0], find(&core[0], "e"), &img, why, sizeof why);
  if (rc) print_error("image: %s\n", why);
  assert_int_equal(rc, 0);
  assert_true(img.is_split);
  fps_image_in_t in = {.name = img.name, .dims = img.shape->dim, .ndim = img.shape->ndim, .hp = img.hp,
                       .version = img.version, .step = img.step, .rms = img.rms, .last_lr = img.last_lr,
                       .last_weight_decay = img.last_weight_decay, .params = fps_snap_data(img.params),
                       .state = img.state, .split = &img.split, .split_replaces = img.split_replaces,
                       .xapplied = img.xapplied,
                       .xversion = img.xversion, .xattempt = img.xattempt};
  for (int i = 0; i < FPS_STATE_KINDS; i++) in.n[i] = img.n[i];
  for (int i = 0; i < 2; i++) {
    in.xown[i] = img.xown[i];
    in.xown_len[i] = img.xown_len[i];
  }
  rc = fps_shard_install(sb, &in, why, sizeof why);
  if (rc) print_error("install: %s\n", why);
  assert_int_equal(rc, 0);
  fps_image_release(&core[0], &img);
  return sb;
}

/* Worker 0 pushes block b of "e" at step with push_id id to sh. */
static void push_block_id(scen_t *s, fps_shard_t *sh, uint32_t b, uint64_t step, uint64_t id, wpush_t *w) {
  char why[FPS_WHY_MAX];
  w->p = fx_push_new(sh, 0, step, INT64_MAX, &w->d);
  assert_int_equal(fps_push_set_id(w->p, id, why, sizeof why), 0);
  assert_int_equal(fx_push_grad(w->p, "e", s->g + s->r.g[b].row_lo * SC, s->r.g[b].block_numel, 1, NULL), 0);
  w->rc = fps_push_commit(w->p, w->why, sizeof w->why);
}

/* Shard 0's primary dies during a step that applied on it and on every
 * peer, before its result reached its standby: the standby, promoted,
 * holds version 0 while the peers hold 1. The worker's retry (the same
 * push_id, so the same attempt) reaches the standby alone (the peers
 * answered theirs); the peers answer its partials (and COMMIT) with their
 * own of that step, which went to the dead primary, and the standby
 * applies the step bit for bit. Before fps_xreply_t it waited for them
 * until the exchange deadline, and the blocks then rolled back. 2 and 3
 * blocks (the COMMIT round), with and without the U2 phase. */
static void standby_promoted_mid_step(void **u) {
  (void)u;
  for (int c = 0; c < 4; c++) {
    scen_t s;
    scen_up(&s, c < 2 ? 2 : 3, c % 2 == 1);
    fps_shard_t *sb = standby_of_0(&s);
    expect_block_on_equals_ref(sb, 0, "e", &s.r, 0);
    wpush_t wp[MAXS];
    ref_step(&s.r, &s.hp, s.nb, s.g);
    push_all_id(&s, wp, 0, 77, s.g);
    net_idle();
    expect_all_ok(&s, wp, 1);
    route[0] = MAXS; /* the primary is gone; its standby serves shard 0 */
    wpush_t w;
    char why[FPS_WHY_MAX];
    push_block_id(&s, sb, 0, 0, 77, &w);
    net_idle();
    int rc = push_result(&w, why, sizeof why);
    if (rc) print_error("case %d: %s\n", c, why);
    assert_int_equal(rc, 0);
    push_end(&w);
    expect_block_on_equals_ref(sb, 0, "e", &s.r, 1);
    /* And the job goes on from there, the standby in the primary's place. */
    ref_step(&s.r, &s.hp, s.nb, s.g);
    for (uint32_t b = 0; b < s.nb; b++) push_block_id(&s, b ? &core[b] : sb, b, 1, 78, &wp[b]);
    net_idle();
    for (uint32_t b = 0; b < s.nb; b++) {
      rc = push_result(&wp[b], why, sizeof why);
      if (rc) print_error("case %d, core %u: %s\n", c, b, why);
      assert_int_equal(rc, 0);
      push_end(&wp[b]);
      expect_block_on_equals_ref(b ? &core[b] : sb, b, "e", &s.r, 2);
    }
    net_release(FPS_EUNAVAILABLE);
    net_idle();
    fps_shard_destroy(sb);
    scen_down(&s);
  }
}

/* The promoted standby's first retry of the step fails (its sends held
 * past the exchange deadline). A block whose step failed tells its peers
 * the versions it can go to (xrecover.c); this one must not: its peer
 * stands one step ahead, and the lists would make the blocks agree on an
 * older version (without anchors, as here, on none: every push refused
 * at once). The next retry completes the step with the peer's answers. */
static void promoted_standby_sends_no_versions(void **u) {
  (void)u;
  scen_t s;
  scen_up(&s, 2, false);
  fps_shard_t *sb = standby_of_0(&s);
  wpush_t wp[MAXS], w;
  ref_step(&s.r, &s.hp, s.nb, s.g);
  push_all_id(&s, wp, 0, 77, s.g);
  net_idle();
  expect_all_ok(&s, wp, 1);
  route[0] = MAXS;
  link_mode[0][1] = LINK_HOLD;
  push_block_id(&s, sb, 0, 0, 77, &w);
  net_idle();
  fps_fake_clock_advance((int64_t)(XDEADLINE_S * 1e9) + 1000);
  fps_shard_expire(sb, fps_fake_now_ns);
  char why[FPS_WHY_MAX];
  assert_int_equal(push_result(&w, why, sizeof why), FPS_EUNAVAILABLE);
  push_end(&w);
  link_mode[0][1] = LINK_OK;
  net_release(0); /* what the failed step sent arrives after all */
  push_block_id(&s, sb, 0, 0, 77, &w);
  net_idle();
  int rc = push_result(&w, why, sizeof why);
  if (rc) print_error("the retry: %s\n", why);
  assert_int_equal(rc, 0);
  push_end(&w);
  expect_block_on_equals_ref(sb, 0, "e", &s.r, 1);
  expect_block_equals_ref(1, "e", &s.r, 1);
  fps_shard_destroy(sb);
  scen_down(&s);
}

/* A standby's cut of a block holds, with the step's result, the keys of
 * all W members of its round (sync.c records them inside the apply gate):
 * a member whose answer was lost when its primary died retries on the
 * promoted standby and is answered from its key. Split sets recorded
 * none, so such a retry was refused as stale and training stopped (the
 * 17th of 20 kills in the split standby test). */
static void split_step_keys_in_the_cut(void **u) {
  (void)u;
  scen_workers = 2;
  scen_t s;
  scen_up(&s, 2, false);
  scen_workers = 1;
  fps_shard_repl_keys(&core[0], true);
  wpush_t wp[MAXS][2];
  char why[FPS_WHY_MAX];
  for (uint32_t b = 0; b < 2; b++)
    for (uint32_t w = 0; w < 2; w++) {
      wp[b][w].p = fx_push_new(&core[b], w, 0, INT64_MAX, &wp[b][w].d);
      assert_int_equal(fps_push_set_id(wp[b][w].p, 100 + w, why, sizeof why), 0);
      assert_int_equal(fx_push_grad(wp[b][w].p, "e", blk_grad(&s, b), s.r.g[b].block_numel, 1, NULL), 0);
      wp[b][w].rc = fps_push_commit(wp[b][w].p, wp[b][w].why, sizeof wp[b][w].why);
    }
  net_idle();
  for (uint32_t b = 0; b < 2; b++)
    for (uint32_t w = 0; w < 2; w++) {
      int rc = push_result(&wp[b][w], why, sizeof why);
      if (rc) print_error("core %u worker %u: %s\n", b, w, why);
      assert_int_equal(rc, 0);
      push_end(&wp[b][w]);
    }
  fps_tensor_t *t = find(&core[0], "e");
  fps_image_t img, *extra = NULL;
  fps_key_rec_t *keys = NULL;
  size_t nextra = 0;
  assert_int_equal(fps_shard_images(&core[0], &t, 1, &img, &keys, &extra, &nextra, why, sizeof why), 0);
  assert_int_equal(img.version, 1);
  bool seen[2] = {false, false};
  for (fps_key_rec_t *k = keys; k; k = k->next) {
    assert_true(k->worker < 2);
    assert_int_equal(k->id, 100 + k->worker);
    assert_int_equal(k->n, 1);
    assert_int_equal(k->v[0], 1);
    seen[k->worker] = true;
  }
  assert_true(seen[0] && seen[1]);
  assert_int_equal(nextra, 0);
  fps_key_recs_free(keys);
  fps_image_release(&core[0], &img);
  fps_free(extra);
  fps_shard_repl_keys(&core[0], false);
  scen_down(&s);
}

int main(int argc, char **argv) {
  /* "golden": only the golden cases (their own ctest entry, not run under
   * TSan: 246 runs of real math dominate its time, and the scenarios
   * already race the same code). */
  if (argc > 1 && strcmp(argv[1], "golden") == 0) {
    const struct CMUnitTest golden[] = {cmocka_unit_test(golden_split_over_cores)};
    return cmocka_run_group_tests(golden, NULL, NULL);
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(receive_checks_in_order),
      cmocka_unit_test(u2_phase_tiny_gradients),
      cmocka_unit_test(peer_never_answers),
      cmocka_unit_test(exchange_deadline_bounds),
      cmocka_unit_test(refused_send),
      cmocka_unit_test(refused_send_two_shards),
      cmocka_unit_test(lost_ack_then_retry),
      cmocka_unit_test(early_partials_from_faster_peers),
      cmocka_unit_test(set_of_block_and_whole_tensor),
      cmocka_unit_test(two_split_tensors_in_one_call),
      cmocka_unit_test(member_cancelled_mid_exchange),
      cmocka_unit_test(stale_and_ahead_pushes),
      cmocka_unit_test(shutdown_fails_exchange),
      cmocka_unit_test(oom_sweep_stays_consistent),
      cmocka_unit_test(dead_attempt_partials_refused),
      cmocka_unit_test(failed_attempt_retried),
      cmocka_unit_test(forged_partials_evict_nothing),
      cmocka_unit_test(standby_promoted_mid_step),
      cmocka_unit_test(promoted_standby_sends_no_versions),
      cmocka_unit_test(split_step_keys_in_the_cut),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
