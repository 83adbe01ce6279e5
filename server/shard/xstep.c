/* The cross-shard step of split tensors (internal.h; the exchange
 * contract is shard.h): a
 * sync set holding row blocks applies only once every block's partial
 * sums are here and every peer has acknowledged ours.
 *
 * A set of rounds settles as sync.c describes (checked, prepared, sums
 * taken and divided by W). If it holds blocks with a gradient, each gets
 * pass A (fps_split_step_begin), and the set waits as an exchange group:
 *   STATS  our partials go to every other block's shard (the sender hook,
 *          no core lock held); theirs arrive through
 *          fps_shard_exchange_receive(). When every block's are in and
 *          every send is acknowledged, each block combines (in block
 *          order); a torch block whose clamp may bind needs
 *   U2     a second exchange of the explicit sums of U^2;
 * then the whole set is applied at once (sync.c's fps__set_settle: whole
 * tensors by their step, blocks by pass C). Any failure (a send that
 * failed or was refused, the deadline, partials that show the blocks
 * diverged) abandons every block's step (nothing changed) and fails every
 * member with FPS_EUNAVAILABLE naming the tensor, the peer and the cause.
 *
 * A member cancelled during the exchange does not abort it: the peers
 * may already hold our partials and apply, so failing here alone would
 * make the blocks diverge. The set settles as it would have (as a sync
 * set being completed always did); the cancelled call just never hears.
 *
 * Partials that arrive before our own step (a peer faster) are kept in
 * t->split->mail for the block's version v or v + 1; after a step the
 * partials it used are kept (wire only) so that a peer whose
 * acknowledgement was lost can retry them and be answered OK.
 *
 * Attempts. The same version can be stepped more than once: a step that
 * failed is pushed again, as a retry (the same push_ids: the same
 * gradients, the same partials) or as new pushes (other gradients). A
 * step's attempt is a hash of its round's members' (worker_id, push_id),
 * the same on every shard; partials are kept and matched per (version,
 * block, phase, attempt), so a step never combines another attempt's.
 * When a step fails, its attempt is remembered as failed (until the
 * version moves on or a retry of it starts here) and its partials are
 * refused: a peer whose step of that attempt is still running (it was
 * frozen, say) must not be acknowledged, or it could apply what this
 * shard abandoned. Attempt 0 (no push_ids) cannot be told apart from the
 * next one and is never remembered as failed.
 *
 * Locks: sh->apply_gate (its read side, while a group advances: the
 * standby's cut, replica.c) -> tensor->mu (a block's xs and mail, its round) -> sh->xs_mu (the
 * list of groups, for the expiry hook) -> g->mu (the group's counts,
 * error and send records). Whoever makes a group ready (all in, or an
 * error) marks it busy and advances it with no lock held on entry; only
 * one thread advances a group at a time. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "alloc.h"
#include "metrics.h"
#include "internal.h"

#define NPHASE 2 /* FPS_SPLIT_PHASE_STATS, FPS_SPLIT_PHASE_U2 */
#define NSENDPH 3 /* phases with sends: STATS, U2 and FPS_XPHASE_COMMIT */

/* One block's partials of one phase, as received. */
typedef struct fps_xpart_s {
  uint8_t *wire;              /* NULL: not received */
  size_t len;
  fps_split_partials_t dec;   /* decoded (owns its arrays) */
} fps_xpart_t;

/* How long the drain gives an ABORT to reach its peer. */
#define FPS_XABORT_DEADLINE_S 1.0

#define KEPT_ATTEMPTS 2 /* early attempts kept per (version, block, phase) */

/* One block tensor's step in flight (t->split->xs; t->mu). */
struct fps_xstep_s {
  fps_xgroup_t *g;
  fps_tensor_t *t;
  uint64_t version;
  uint64_t attempt;           /* fps__attempt() of its round */
  uint32_t nb, me;
  fps_split_step_t *step;     /* until handed to the apply (prep.split) */
  bool combined;              /* phase STATS combined */
  bool u2;                    /* combined: phase U2 is due */
  fps_xpart_t *part;          /* [NPHASE * nb]: (phase - 1) * nb + block */
  uint8_t *own[NPHASE];       /* our wire form per phase (for the sends) */
  size_t own_len[NPHASE];
  /* Allocated at start, so that nothing after our acknowledgements can
   * fail for want of memory (a peer that has them may apply): combine's
   * input, and the records that keep the partials after the step. */
  fps_split_partials_t *parts; /* [nb] */
  struct fps_xkept_s **kept;  /* [NPHASE * nb], NULL at our own block */
  bool *committed;            /* [nb]: that block's COMMIT is here */
};

/* One send of our partials to a peer. */
typedef struct fps_xsendrec_s {
  fps_xgroup_t *g;
  struct fps_xstep_s *x;
  uint32_t to;
  int phase;
  int state;                  /* 0 not sent, 1 in flight, 2 acknowledged, 3 failed */
} fps_xsendrec_t;

struct fps_xgroup_s {
  fps_shard_t *sh;
  pthread_mutex_t mu;
  int refs;                   /* until settled + the advancer or kicker +
                               * sends in flight */
  fps_tensor_t *set;          /* the set's rounds, address order (round.cnext) */
  size_t k;
  fps__set_settle_fn settle;  /* sync.c's: applies or fails the set */
  struct fps_xstep_s **x;     /* its blocks with a gradient */
  size_t n;
  fps_xsendrec_t *rec;        /* [NPHASE * sends per phase] */
  size_t nsend;               /* sends per phase */
  bool commit;                /* a block of 3+: COMMIT round before applying */
  int64_t calls_deadline_ns;  /* the members' calls' earliest deadline */
  int phase;                  /* being exchanged */
  size_t missing;             /* peers' partials of this phase not yet here */
  size_t unacked;             /* our sends of this phase not yet acknowledged */
  bool busy;                  /* a thread advances or sends for it */
  bool over;                  /* settled */
  bool timed_out;             /* the expiry hook failed it */
  bool msg_due;               /* timed out: finish writes msg (naming peers) */
  int err;                    /* the first failure, 0: none */
  char msg[1024];
  int64_t started_ns, deadline_ns;
  struct fps_xgroup_s *prev, *next; /* sh->xgroups (sh->xs_mu) */
  bool linked;
};

/* ------------------------------------------------------------ helpers */

static void fps__xpart_clear(fps_xpart_t *p) {
  fps_free(p->wire);
  fps_split_partials_free(&p->dec);
  memset(p, 0, sizeof *p);
}

static void fps__xstep_free(struct fps_xstep_s *x) {
  if (!x) return;
  fps_split_step_free(x->step);
  if (x->part)
    for (uint32_t i = 0; i < NPHASE * x->nb; i++) fps__xpart_clear(&x->part[i]);
  fps_free(x->part);
  if (x->kept)
    for (uint32_t i = 0; i < NPHASE * x->nb; i++) fps_free(x->kept[i]);
  fps_free(x->kept);
  fps_free(x->committed);
  fps_free(x->parts);
  for (int p = 0; p < NPHASE; p++) fps_free(x->own[p]);
  fps_free(x);
}

static void fps__xg_unref(fps_xgroup_t *g) {
  pthread_mutex_lock(&g->mu);
  bool last = --g->refs == 0;
  pthread_mutex_unlock(&g->mu);
  if (!last) return;
  for (size_t i = 0; i < g->n; i++) fps__xstep_free(g->x[i]);
  fps_free(g->x);
  fps_free(g->rec);
  pthread_mutex_destroy(&g->mu);
  fps_free(g);
}

/* True (and g marked busy) if g can advance now: failed, or every
 * partial of its phase in and every send acknowledged. REQUIRES g->mu. */
static bool fps__xg_ready_locked(fps_xgroup_t *g) {
  if (g->busy || g->over) return false;
  if (!g->err && (g->missing || g->unacked)) return false;
  g->busy = true;
  g->refs++; /* the advancer's */
  return true;
}

/* Records the group's first failure. REQUIRES g->mu. */
static void fps__xg_fail_locked(fps_xgroup_t *g, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fps__xg_fail_locked(fps_xgroup_t *g, const char *fmt, ...) {
  if (g->err) return;
  g->err = FPS_EUNAVAILABLE;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g->msg, sizeof g->msg, fmt, ap);
  va_end(ap);
}

/* The geometry block b of t's map has. */
static int fps__block_geom(const fps_tensor_t *t, uint32_t b, fps_split_geom_t *g) {
  char why[256];
  const fps_tensor_split_t *sp = t->split;
  return fps_split_geom_init(g, &t->shape, sp->bounds[b], sp->bounds[b + 1], why, sizeof why);
}

/* Checks a peer's old column state against ours where their matrices
 * overlap (phase STATS, same version). 0 or the first matrix that differs
 * + 1. REQUIRES t->mu. */
static uint64_t fps__colstate_differs(const fps_tensor_t *t, const fps_split_partials_t *p) {
  const fps_split_state_t *st = &t->split->st;
  if (!p->factored || !st->col) return 0;
  uint64_t lo = p->mtx_lo > st->g.mtx_lo ? p->mtx_lo : st->g.mtx_lo;
  uint64_t hi_p = p->mtx_lo + p->nmat, hi_s = st->g.mtx_lo + st->g.nmat;
  uint64_t hi = hi_p < hi_s ? hi_p : hi_s;
  const uint64_t C = st->g.cols;
  for (uint64_t m = lo; m < hi; m++)
    if (memcmp(p->col_old + (m - p->mtx_lo) * C, st->col + (m - st->g.mtx_lo) * C, C * sizeof(float)))
      return m + 1;
  return 0;
}

/* splitmix64's finaliser: every input bit moves every output bit. */
static uint64_t fps__mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
  return z ^ (z >> 31);
}

/* The attempt of t's round: its members' (worker_id, push_id) in worker
 * order, hashed alike on every shard (libfactorps sends one push_id per
 * logical push to every shard; a retry reuses it). 0 if no member has a
 * push_id; never 0 otherwise. REQUIRES t->mu (the round is settling). */
static uint64_t fps__attempt(const fps_shard_t *sh, const fps_tensor_t *t) {
  uint64_t h = UINT64_C(0x6a09e667f3bcc908);
  bool keyed = false;
  for (uint32_t w = 0; w < sh->cfg.workers; w++) {
    const fps_push_entry_t *m = t->round.member[w];
    uint64_t id = m ? fps__push_key(m->owner) : 0;
    keyed |= id != 0;
    h = fps__mix64(h ^ fps__mix64(((uint64_t)w << 1 | (m != NULL)) + UINT64_C(0x9e3779b97f4a7c15)));
    h = fps__mix64(h ^ id);
  }
  if (!keyed) return 0;
  return h ? h : 1;
}

/* Attempt a for a message: a hash means nothing to a user, so 0 says why
 * attempts cannot be told apart, and any other is shown as the hash it is
 * (hex, so shards' logs can be matched). */
static void fps__attempt_text(uint64_t a, char *buf, size_t len) {
  if (!a) snprintf(buf, len, "attempt 0 (pushes without a push_id)");
  else snprintf(buf, len, "attempt 0x%016" PRIx64 " (a hash of its pushes' push_ids)", a);
}

/* ------------------------------------------------------------ set-up */

void fps__xstep_forget(fps_tensor_t *t) {
  fps_tensor_split_t *s = t->split;
  if (!s) return;
  fps__xrec_forget(t);
  fps__xstep_free(s->xs); /* not reached: no step is in flight at teardown */
  s->xs = NULL;
  fps__xmail_free(s);
}

bool fps__xstep_needed(const fps_tensor_t *set) {
  for (const fps_tensor_t *t = set; t; t = t->round.cnext)
    if (t->split && !t->round.none) return true;
  return false;
}

/* ------------------------------------------------------------- start */

int fps__xstep_start(fps_shard_t *sh, fps_tensor_t *set, size_t k, fps__set_settle_fn settle, fps_xgroup_t **out,
                     char *why, size_t wl) {
  *out = NULL;
  if (!sh->xsend) {
    snprintf(why, wl, "tensor '%s': this shard has no --peers, so it cannot step a split tensor", set->name);
    return FPS_ESTATE;
  }
  if (atomic_load(&sh->xstopping)) {
    /* Nothing of this step was sent: no peer can apply it. */
    snprintf(why, wl, "tensor '%s': this shard is shutting down; the step of its split blocks was not begun",
             set->name);
    return FPS_EUNAVAILABLE;
  }
  int rc = 0;
  fps_xgroup_t *g = fps_calloc(1, sizeof *g);
  if (!g) goto oom;
  pthread_mutex_init(&g->mu, NULL);
  g->sh = sh;
  g->set = set;
  g->k = k;
  g->settle = settle;
  g->refs = 2; /* the kicker's, and its life until it settles */
  g->busy = true; /* until the kick has sent everything */
  g->phase = FPS_SPLIT_PHASE_STATS;
  size_t n = 0, nsend = 0;
  for (fps_tensor_t *t = set; t; t = t->round.cnext)
    if (t->split && !t->round.none) {
      n++;
      nsend += t->split->n_blocks - 1;
    }
  g->x = fps_calloc(n, sizeof *g->x);
  g->rec = fps_calloc(NSENDPH * nsend, sizeof *g->rec);
  if (!g->x || !g->rec) goto oom;
  g->nsend = nsend;
  int64_t now = fps_now_ns();
  g->started_ns = now;
  g->deadline_ns = fps_clock_after(now, sh->xdeadline > 0 ? sh->xdeadline : 10.0);
  g->calls_deadline_ns = INT64_MAX;
  for (fps_tensor_t *t = set; t; t = t->round.cnext) {
    if (t->round.calls_deadline_ns < g->calls_deadline_ns) g->calls_deadline_ns = t->round.calls_deadline_ns;
    /* The members hear of a failure before their own calls give up (the
     * round's --deadline for waiting on workers does not bound it). */
    if (t->round.calls_deadline_ns < g->deadline_ns) g->deadline_ns = t->round.calls_deadline_ns;
    if (!t->split || t->round.none) continue;
    fps_tensor_split_t *sp = t->split;
    struct fps_xstep_s *x = fps_calloc(1, sizeof *x);
    if (!x) goto oom;
    g->x[g->n++] = x;
    x->g = g;
    x->t = t;
    x->version = t->version;
    x->attempt = fps__attempt(sh, t);
    x->nb = sp->n_blocks;
    x->me = sp->block_index;
    x->part = fps_calloc(NPHASE * (size_t)x->nb, sizeof *x->part);
    x->parts = fps_malloc(x->nb * sizeof *x->parts);
    x->kept = fps_calloc(NPHASE * (size_t)x->nb, sizeof *x->kept);
    x->committed = fps_calloc(x->nb, sizeof *x->committed);
    if (!x->part || !x->parts || !x->kept || !x->committed) goto oom;
    /* With two blocks, "all partials here and ours acknowledged" on one
     * shard means both hold everything; with more it does not (a third
     * may have failed meanwhile and refuse the rest), so they commit. */
    g->commit |= x->nb > 2;
    for (uint32_t j = 0; j < NPHASE * x->nb; j++)
      if (j % x->nb != x->me && !(x->kept[j] = fps_calloc(1, sizeof *x->kept[j]))) goto oom;
    fps_adafactor_hparams_t hp = fps__update_hparams(t, &t->round.member[0]->uh);
    fps_pool_t *pool = t->numel >= FPS_POOL_MIN(sh) ? sh->pool : NULL;
    rc = fps_split_step_begin(sh->kernels, &hp, &sp->st, t->param, t->round.sum, pool, &x->step);
    if (rc == FPS_ENOMEM) goto oom;
    if (rc < 0) {
      snprintf(why, wl, "tensor '%s': the Adafactor step refuses this update's settings: %s", t->name,
               fps_strerror(rc));
      goto fail;
    }
    size_t sz = fps_split_partials_size(&sp->g, FPS_SPLIT_PHASE_STATS);
    size_t sz2 = fps_split_partials_size(&sp->g, FPS_SPLIT_PHASE_U2);
    if (!sz || !sz2 || !(x->own[0] = fps_malloc(sz)) || !(x->own[1] = fps_malloc(sz2))) goto oom;
    x->own_len[0] = fps_split_partials_encode(fps_split_step_partials(x->step), x->own[0], sz);
    if (x->own_len[0] != sz) {
      snprintf(why, wl, "tensor '%s': could not encode this block's partials", t->name);
      rc = FPS_EINVAL;
      goto fail;
    }
  }
  /* Partials that came before this step: checked now against our state
   * (their geometry was checked when they came). */
  size_t have = 0;
  for (size_t i = 0; i < g->n; i++) {
    struct fps_xstep_s *x = g->x[i];
    fps_tensor_split_t *sp = x->t->split;
    fps__xmail_prune(sp, x->version);
    if (!sp->mail && !(sp->mail = fps_calloc(1, sizeof *sp->mail))) goto oom;
    for (fps_xkept_t **pp = &sp->mail->head; *pp;) {
      fps_xkept_t *m = *pp;
      if (m->done || m->version != x->version || m->attempt != x->attempt) {
        pp = &m->next;
        continue;
      }
      uint64_t bad = m->phase == FPS_SPLIT_PHASE_STATS ? fps__colstate_differs(x->t, &m->dec) : 0;
      if (bad) {
        snprintf(why, wl,
                 "tensor '%s' step %" PRIu64 ": shard %u's partials (block %u) carry another column state "
                 "of matrix %" PRIu64 " than this shard's block: the blocks have diverged; nothing was applied",
                 x->t->name, x->version, sp->block_shards[m->block], m->block, bad - 1);
        rc = FPS_EUNAVAILABLE;
        goto fail;
      }
      fps_xpart_t *p = &x->part[(size_t)(m->phase - 1) * x->nb + m->block];
      p->wire = m->wire;
      p->len = m->len;
      p->dec = m->dec;
      if (m->phase == FPS_SPLIT_PHASE_STATS) have++;
      *pp = m->next;
      fps_free(m);
    }
  }
  g->missing = nsend - have;
  g->unacked = nsend;
  /* A retry of an attempt that failed here: its partials are welcome again
   * (they are the same as the failed one's). */
  for (size_t i = 0; i < g->n; i++) fps__xmail_mark(g->x[i]->t->split, g->x[i]->version, g->x[i]->attempt, false);
  size_t r = 0;
  for (size_t i = 0; i < g->n; i++) {
    struct fps_xstep_s *x = g->x[i];
    for (uint32_t b = 0; b < x->nb; b++) {
      if (b == x->me) continue;
      for (int ph = 0; ph < NSENDPH; ph++)
        g->rec[(size_t)ph * nsend + r] = (fps_xsendrec_t){g, x, x->t->split->block_shards[b], ph + 1, 0};
      r++;
    }
    x->t->split->xs = x;
  }
  for (fps_tensor_t *t = set; t; t = t->round.cnext) t->round.exchanging = true;
  pthread_mutex_lock(&sh->xs_mu);
  g->next = sh->xgroups;
  if (sh->xgroups) sh->xgroups->prev = g;
  sh->xgroups = g;
  g->linked = true;
  pthread_mutex_unlock(&sh->xs_mu);
  *out = g;
  return 0;
oom:
  snprintf(why, wl, "tensor '%s': out of memory starting the exchange of its split blocks", set->name);
  rc = FPS_ENOMEM;
fail:
  /* Nothing was sent and no state changed: pass A changes nothing. (Mail
   * taken into a step goes with it: those peers' steps fail too.) */
  if (g) {
    for (size_t i = 0; g->x && i < g->n; i++) fps__xstep_free(g->x[i]);
    fps_free(g->x);
    fps_free(g->rec);
    pthread_mutex_destroy(&g->mu);
    fps_free(g);
  }
  return rc;
}

/* ------------------------------------------------------------- sends */

static void fps__xg_advance(fps_xgroup_t *g);

/* The block shard `shard` holds (the map is constant: no lock), or
 * n_blocks if none. */
static uint32_t fps__block_of_shard(const fps_tensor_split_t *sp, uint32_t shard) {
  uint32_t b = 0;
  while (b < sp->n_blocks && sp->block_shards[b] != shard) b++;
  return b;
}

/* What a peer's answer brought that it had sent before (fps_xreply_t):
 * taken as if it had arrived now, through the same checks. */
static void fps__xsend_echo(fps_xsendrec_t *rec, const fps_xreply_t *r) {
  fps_shard_t *sh = rec->g->sh;
  const struct fps_xstep_s *x = rec->x;
  const fps_tensor_split_t *sp = x->t->split;
  uint32_t b = fps__block_of_shard(sp, rec->to);
  int phase = r->len ? rec->phase : (r->applied || r->committed) ? FPS_XPHASE_COMMIT : 0;
  if (b == sp->n_blocks || !phase || (phase == FPS_XPHASE_COMMIT && !x->g->commit)) return;
  fps_xmsg_t m = {.name = x->t->name, .version = x->version, .from_shard = rec->to,
                  .shard_count = sh->cfg.shard_count, .block_index = b, .phase = phase,
                  .attempt = x->attempt, .partials = r->partials, .len = r->len};
  char why[512];
  if (phase != FPS_XPHASE_COMMIT &&
      fps_shard_exchange_payload_check(phase, m.partials, m.len, why, sizeof why) < 0) {
    FPS_LOG(FPS_LOG_WARN, "tensor '%s': shard %u answered with partials that are not valid: %s", x->t->name,
            rec->to, why);
    return;
  }
  int rc = fps_shard_exchange_receive(sh, &m, NULL, why, sizeof why);
  if (rc < 0) FPS_LOG(FPS_LOG_DEBUG, "tensor '%s': the partials shard %u answered with: %s", x->t->name, rec->to, why);
}

static void fps__xsend_done(void *arg, int err, const char *msg, const fps_xreply_t *reply) {
  fps_xsendrec_t *rec = arg;
  fps_xgroup_t *g = rec->g;
  if (!err && reply && (reply->len || reply->applied || reply->committed)) fps__xsend_echo(rec, reply);
  pthread_mutex_lock(&g->mu);
  rec->state = err ? 3 : 2;
  if (!g->over) {
    if (err)
      fps__xg_fail_locked(g,
                          "tensor '%s' step %" PRIu64 ": the exchange with shard %u failed (%s): %s; nothing was "
                          "applied, retry",
                          rec->x->t->name, rec->x->version, rec->to,
                          rec->phase == FPS_SPLIT_PHASE_STATS ? "partials"
                          : rec->phase == FPS_SPLIT_PHASE_U2  ? "U2 partials"
                                                              : "commit",
                          msg && *msg ? msg : fps_strerror(err));
    else if (rec->phase == g->phase)
      g->unacked--;
  }
  bool ready = fps__xg_ready_locked(g);
  pthread_mutex_unlock(&g->mu);
  if (!err && rec->phase <= NPHASE) fps_metrics_exchange_bytes(rec->x->own_len[rec->phase - 1], 0);
  if (ready) fps__xg_advance(g);
  fps__xg_unref(g); /* the send's */
}

/* Sends phase `phase`'s partials of every block of g (g busy, held by the
 * caller's reference; no core lock held), then lets g advance. */
static void fps__xg_send(fps_xgroup_t *g, int phase) {
  fps_shard_t *sh = g->sh;
  fps_xsendrec_t *rec = g->rec + (size_t)(phase - 1) * g->nsend;
  for (size_t i = 0; i < g->nsend; i++) {
    struct fps_xstep_s *x = rec[i].x;
    if (phase == FPS_SPLIT_PHASE_U2 && !x->u2) continue;
    pthread_mutex_lock(&g->mu);
    bool stop = g->err != 0;
    if (!stop) {
      g->refs++;
      rec[i].state = 1;
    }
    pthread_mutex_unlock(&g->mu);
    if (stop) break; /* failed meanwhile: the rest need not go */
    bool own = phase <= NPHASE; /* COMMIT carries nothing */
    /* Whether we still lack that peer's own of this phase: if it should
     * have reached us already, its answer brings it (a standby promoted
     * mid-step lacks what went to its predecessor). */
    const fps_tensor_split_t *sp = x->t->split;
    uint32_t b = fps__block_of_shard(sp, rec[i].to);
    pthread_mutex_lock(&x->t->mu);
    bool want = b < sp->n_blocks &&
                (own ? !x->part[(size_t)(phase - 1) * x->nb + b].wire : !x->committed[b]);
    pthread_mutex_unlock(&x->t->mu);
    fps_xmsg_t m = {.name = x->t->name, .version = x->version, .from_shard = sh->cfg.shard_id,
                    .shard_count = sh->cfg.shard_count, .block_index = x->me, .phase = phase,
                    .attempt = x->attempt, .partials = own ? x->own[phase - 1] : NULL,
                    .len = own ? x->own_len[phase - 1] : 0, .stamp = fps__xrec_stamp(sh), .want = want};
    int rc = sh->xsend(sh->xsend_ctx, rec[i].to, &m, g->deadline_ns, fps__xsend_done, &rec[i]);
    if (rc < 0) {
      char cause[128];
      snprintf(cause, sizeof cause, "the send was refused at once (%s)", fps_strerror(rc));
      fps__xsend_done(&rec[i], rc, cause, NULL);
    }
  }
  pthread_mutex_lock(&g->mu);
  g->busy = false;
  bool ready = fps__xg_ready_locked(g);
  pthread_mutex_unlock(&g->mu);
  if (ready) fps__xg_advance(g);
}

void fps__xstep_kick(fps_xgroup_t *g) {
  fps__xg_send(g, FPS_SPLIT_PHASE_STATS);
  fps__xg_unref(g); /* the kicker's */
}

/* ------------------------------------------------------- advance, settle */

/* The parts of phase `phase` of x in block order, ours at its place. */
static void fps__xstep_parts(const struct fps_xstep_s *x, int phase, fps_split_partials_t *parts) {
  for (uint32_t b = 0; b < x->nb; b++) {
    if (b == x->me)
      parts[b] = *(phase == FPS_SPLIT_PHASE_STATS ? fps_split_step_partials(x->step) : fps_split_step_u2(x->step));
    else
      parts[b] = x->part[(size_t)(phase - 1) * x->nb + b].dec;
  }
}

/* Why a timed-out or forced group failed: the peers still missing.
 * REQUIRES the set's tensor locks and g->mu. */
static void fps__xg_timeout_msg_locked(fps_xgroup_t *g, const char *reason) {
  int64_t now = fps_now_ns();
  struct fps_xstep_s *x0 = g->x[0];
  size_t n = (size_t)snprintf(g->msg, sizeof g->msg, "tensor '%s' step %" PRIu64 ": ", x0->t->name, x0->version);
  if (reason) {
    snprintf(g->msg + n, sizeof g->msg - n, "%s; the exchange of its split blocks was abandoned, nothing applied",
             reason);
    return;
  }
  if (g->phase == FPS_XPHASE_COMMIT) {
    /* Every partial was here: what is missing is the peers' word. */
    n += (size_t)snprintf(g->msg + n, sizeof g->msg - n, "the commit round timed out after %.3f s;",
                          (double)(now - g->started_ns) / 1e9);
    const char *sep = " no commit from shard ";
    for (size_t i = 0; i < g->n && n < sizeof g->msg - 120; i++)
      for (uint32_t b = 0; b < g->x[i]->nb && n < sizeof g->msg - 120; b++)
        if (b != g->x[i]->me && !g->x[i]->committed[b]) {
          n += (size_t)snprintf(g->msg + n, sizeof g->msg - n, "%s%u", sep, g->x[i]->t->split->block_shards[b]);
          sep = ", ";
        }
    if (n < sizeof g->msg) snprintf(g->msg + n, sizeof g->msg - n, "; nothing was applied, retry");
    return;
  }
  n += (size_t)snprintf(g->msg + n, sizeof g->msg - n, "the exchange of %s partials timed out after %.3f s;",
                        g->phase == FPS_SPLIT_PHASE_STATS ? "its" : "its U2", (double)(now - g->started_ns) / 1e9);
  /* The first block tensor that still lacks something names the peers. */
  for (size_t i = 0; i < g->n && n < sizeof g->msg - 200; i++) {
    struct fps_xstep_s *x = g->x[i];
    if (g->phase == FPS_SPLIT_PHASE_U2 && !x->u2) continue;
    const char *sep = " no partials from shard ";
    for (uint32_t b = 0; b < x->nb && n < sizeof g->msg - 120; b++)
      if (b != x->me && !x->part[(size_t)(g->phase - 1) * x->nb + b].wire) {
        n += (size_t)snprintf(g->msg + n, sizeof g->msg - n, "%s%u", sep, x->t->split->block_shards[b]);
        sep = ", ";
      }
    if (strcmp(sep, ", ") == 0 && x != x0)
      n += (size_t)snprintf(g->msg + n, sizeof g->msg - n, " (tensor '%s')", x->t->name);
    sep = "; no acknowledgement from shard ";
    fps_xsendrec_t *rec = g->rec + (size_t)(g->phase - 1) * g->nsend;
    for (size_t r = 0; r < g->nsend && n < sizeof g->msg - 120; r++)
      if (rec[r].x == x && rec[r].state != 2) {
        n += (size_t)snprintf(g->msg + n, sizeof g->msg - n, "%s%u", sep, rec[r].to);
        sep = ", ";
      }
  }
  if (n < sizeof g->msg) snprintf(g->msg + n, sizeof g->msg - n, "; nothing was applied, retry");
}

/* Settles g (the set's tensor locks held, g busy): err 0 hands every
 * block's combined step to its apply; otherwise abandons them. */
static void fps__xg_finish(fps_xgroup_t *g, int err) {
  fps_shard_t *sh = g->sh;
  pthread_mutex_lock(&sh->xs_mu);
  if (g->linked) {
    if (g->prev) g->prev->next = g->next;
    else sh->xgroups = g->next;
    if (g->next) g->next->prev = g->prev;
    g->linked = false;
  }
  pthread_mutex_unlock(&sh->xs_mu);
  int64_t now = fps_now_ns();
  for (size_t i = 0; i < g->n; i++) {
    struct fps_xstep_s *x = g->x[i];
    fps_tensor_split_t *sp = x->t->split;
    sp->xs = NULL;
    if (err) {
      fps_split_step_free(x->step); /* abandoned: nothing changed */
      x->step = NULL;
      /* Its partials are refused from now on (the mail exists: the step
       * was started with it). */
      fps__xmail_mark(sp, x->version, x->attempt, true);
      continue;
    }
    x->t->round.prep.split = x->step;
    x->step = NULL;
    size_t own_len[2] = {x->own_len[0], x->u2 ? x->own_len[1] : 0};
    if (!x->u2) { /* allocated at start, never written */
      fps_free(x->own[1]);
      x->own[1] = NULL;
    }
    fps__xmail_applied(sp->mail, x->version, x->attempt, x->own, own_len, false);
    /* Kept for peers whose acknowledgement was lost: they retry these.
     * (The mail exists: the step was started with it.) */
    for (uint32_t j = 0; sp->mail && j < NPHASE * x->nb; j++) {
      fps_xpart_t *p = &x->part[j];
      fps_xkept_t *kp = p->wire ? x->kept[j] : NULL;
      if (!kp) continue;
      x->kept[j] = NULL;
      kp->version = x->version;
      kp->attempt = x->attempt;
      kp->block = j % x->nb;
      kp->phase = (int)(j / x->nb) + 1;
      kp->done = true;
      kp->wire = p->wire;
      kp->len = p->len;
      p->wire = NULL;
      kp->next = sp->mail->head;
      sp->mail->head = kp;
    }
    fps__xmail_prune(sp, x->version + 1);
  }
  for (fps_tensor_t *t = g->set; t; t = t->round.cnext) t->round.exchanging = false;
  char why[1024];
  pthread_mutex_lock(&g->mu);
  g->over = true;
  if (g->msg_due) {
    char reason[sizeof g->msg];
    snprintf(reason, sizeof reason, "%s", g->msg);
    fps__xg_timeout_msg_locked(g, reason[0] ? reason : NULL);
    g->msg_due = false;
  }
  snprintf(why, sizeof why, "%s", g->msg);
  pthread_mutex_unlock(&g->mu);
  fps_metrics_exchange_observe(err == 0, err ? 0 : (double)(now - g->started_ns) / 1e9);
  g->settle(sh, g->set, g->k, err, why, sizeof why);
  /* A step that failed may have applied elsewhere (a peer that committed
   * and lost us, a crash): the blocks compare versions. */
  for (size_t i = 0; err && i < g->n; i++) fps__xrec_announce(sh, g->x[i]->t);
  fps__xg_unref(g); /* settled: no tensor points to it any more */
}

/* Advances a ready group (the caller made it busy and holds a reference
 * for it): combines the phase that is complete, starts phase U2 where
 * due, or settles the set. */
static void fps__xg_advance(fps_xgroup_t *g) {
  for (;;) {
    /* The apply gate before the tensors' locks, as sync.c's sets: the set
     * may apply now, and its settle records its members' keys and
     * releases both (a standby's cut sees the results with the keys). */
    pthread_rwlock_rdlock(&g->sh->apply_gate);
    for (fps_tensor_t *t = g->set; t; t = t->round.cnext) pthread_mutex_lock(&t->mu);
    pthread_mutex_lock(&g->mu);
    int err = g->err, phase = g->phase;
    pthread_mutex_unlock(&g->mu);
    if (!err && phase == FPS_XPHASE_COMMIT) { /* every block committed */
      fps__xg_finish(g, 0);
      break;
    }
    char why[512];
    bool any_u2 = false;
    for (size_t i = 0; !err && i < g->n; i++) {
      struct fps_xstep_s *x = g->x[i];
      if (phase == FPS_SPLIT_PHASE_U2 && !x->u2) continue;
      fps_split_partials_t *parts = x->parts;
      fps__xstep_parts(x, phase, parts);
      int rc = phase == FPS_SPLIT_PHASE_STATS ? fps_split_step_combine(x->step, parts, x->nb, why, sizeof why)
                                              : fps_split_step_combine_u2(x->step, parts, x->nb, why, sizeof why);
      if (rc < 0) {
        pthread_mutex_lock(&g->mu);
        fps__xg_fail_locked(g,
                            "tensor '%s' step %" PRIu64 ": combining the blocks' partials failed (%s): %s; "
                            "nothing was applied",
                            x->t->name, x->version, fps_strerror(rc), why);
        err = g->err;
        pthread_mutex_unlock(&g->mu);
        break;
      }
      if (phase == FPS_SPLIT_PHASE_STATS) {
        x->combined = true;
        x->u2 = fps_split_step_needs_u2(x->step);
        any_u2 |= x->u2;
      }
    }
    /* Phase U2 where due: the explicit sums, then a second exchange. */
    for (size_t i = 0; !err && any_u2 && i < g->n; i++) {
      struct fps_xstep_s *x = g->x[i];
      const fps_split_partials_t *u = x->u2 ? fps_split_step_u2(x->step) : NULL;
      size_t sz = x->u2 ? fps_split_partials_size(&x->t->split->g, FPS_SPLIT_PHASE_U2) : 0;
      if (x->u2 && (!u || !sz || (x->own_len[1] = fps_split_partials_encode(u, x->own[1], sz)) != sz)) {
        /* Not reached: the U2 phase allocates nothing (begin did). */
        pthread_mutex_lock(&g->mu);
        fps__xg_fail_locked(g, "tensor '%s' step %" PRIu64 ": could not make the U2 partials; nothing was applied",
                            x->t->name, x->version);
        err = g->err;
        pthread_mutex_unlock(&g->mu);
      }
      /* Peers decide the same (same bits): U2 partials for a block that
       * needs none means they have diverged. */
      for (uint32_t b = 0; !err && !x->u2 && b < x->nb; b++)
        if (x->part[x->nb + b].wire) {
          pthread_mutex_lock(&g->mu);
          fps__xg_fail_locked(g,
                              "tensor '%s' step %" PRIu64 ": shard %u sent U2 partials though no U2 phase is due "
                              "here: the blocks have diverged; nothing was applied",
                              x->t->name, x->version, x->t->split->block_shards[b]);
          err = g->err;
          pthread_mutex_unlock(&g->mu);
        }
    }
    if (!err && any_u2) {
      size_t missing = 0, sends = 0;
      for (size_t i = 0; i < g->n; i++) {
        struct fps_xstep_s *x = g->x[i];
        for (uint32_t b = 0; x->u2 && b < x->nb; b++)
          if (b != x->me) {
            sends++;
            missing += !x->part[x->nb + b].wire;
          }
      }
      pthread_mutex_lock(&g->mu);
      err = g->err;
      if (!err) {
        g->phase = FPS_SPLIT_PHASE_U2;
        g->missing = missing;
        g->unacked = sends;
      }
      pthread_mutex_unlock(&g->mu);
      if (!err) {
        for (fps_tensor_t *t = g->set; t; t = t->round.cnext) pthread_mutex_unlock(&t->mu);
        pthread_rwlock_unlock(&g->sh->apply_gate);
        fps__xg_send(g, FPS_SPLIT_PHASE_U2); /* then advances again if ready */
        fps__xg_unref(g);
        return;
      }
    }
    if (!err && g->commit) {
      /* Combined: tell every peer, and apply once every peer said so. A
       * peer that failed meanwhile refuses our COMMIT, so we fail too. */
      size_t missing = 0, sends = 0;
      for (size_t i = 0; i < g->n; i++)
        for (uint32_t b = 0; b < g->x[i]->nb; b++)
          if (b != g->x[i]->me) {
            sends++;
            missing += !g->x[i]->committed[b];
          }
      pthread_mutex_lock(&g->mu);
      err = g->err;
      if (!err) {
        g->phase = FPS_XPHASE_COMMIT;
        g->missing = missing;
        g->unacked = sends;
        /* The peers may have started this round later than we did: a
         * COMMIT gets a deadline of its own (the members' calls still
         * bound it). */
        int64_t d = fps_clock_after(fps_now_ns(), g->sh->xdeadline > 0 ? g->sh->xdeadline : 10.0);
        if (d > g->calls_deadline_ns) d = g->calls_deadline_ns;
        if (d > g->deadline_ns) g->deadline_ns = d;
      }
      pthread_mutex_unlock(&g->mu);
      if (!err) {
        for (fps_tensor_t *t = g->set; t; t = t->round.cnext) pthread_mutex_unlock(&t->mu);
        pthread_rwlock_unlock(&g->sh->apply_gate);
        fps__xg_send(g, FPS_XPHASE_COMMIT); /* then advances again if ready */
        fps__xg_unref(g);
        return;
      }
    }
    fps__xg_finish(g, err); /* releases the tensors' locks and the gate */
    break;
  }
  fps__xg_unref(g); /* the advancer's */
}

/* ------------------------------------------------------------- expiry */

void fps__xstep_expire(fps_shard_t *sh, int64_t now, bool force, const char *reason) {
  if (!force && (atomic_load(&sh->xrec_pending) > 0 || atomic_load(&sh->xrec_apart) > 0)) fps__xrec_tick(sh);
  for (;;) {
    fps_xgroup_t *hit = NULL;
    pthread_mutex_lock(&sh->xs_mu);
    for (fps_xgroup_t *g = sh->xgroups; g && !hit; g = g->next) {
      pthread_mutex_lock(&g->mu);
      if (!g->timed_out && !g->over && (force || now >= g->deadline_ns)) {
        g->timed_out = true;
        if (!g->err) {
          g->err = FPS_EUNAVAILABLE;
          /* The message is written when it settles (naming the peers
           * still missing needs the tensors' locks). */
          g->msg_due = true;
          snprintf(g->msg, sizeof g->msg, "%s", reason ? reason : "");
        }
        if (fps__xg_ready_locked(g)) hit = g;
      }
      pthread_mutex_unlock(&g->mu);
    }
    pthread_mutex_unlock(&sh->xs_mu);
    if (!hit) return;
    fps__xg_advance(hit);
  }
}

/* One step a peer began that this shard will not: (tensor, version,
 * attempt) and the peer's shard. */
typedef struct fps_xabort_s {
  fps_tensor_t *t;
  uint64_t version, attempt;
  uint32_t to, block;
} fps_xabort_t;

static void fps__xabort_sent(void *arg, int err, const char *msg, const fps_xreply_t *reply) {
  (void)reply;
  fps_shard_t *sh = arg;
  if (err) FPS_LOG(FPS_LOG_DEBUG, "ABORT not delivered: %s", msg ? msg : fps_strerror(err));
  atomic_fetch_sub(&sh->xaborts_in_flight, 1);
}

/* Peers whose partials wait here for a step this shard will now never
 * begin hear so (ABORT), and fail theirs at once. REQUIRES xstopping. */
static void fps__xstep_abort_waiting(fps_shard_t *sh) {
  size_t n = 0, cap = 0;
  fps_xabort_t *ab = NULL;
  pthread_rwlock_rdlock(&sh->store.mu);
  for (fps_tensor_t *t = sh->store.first; t; t = t->next) {
    if (!t->split) continue;
    pthread_mutex_lock(&t->mu);
    fps_tensor_split_t *sp = t->split;
    for (fps_xkept_t *k = sp->mail ? sp->mail->head : NULL; k; k = k->next) {
      if (k->done || k->version != t->version) continue;
      if (sp->xs && sp->xs->version == k->version && sp->xs->attempt == k->attempt) continue; /* begun */
      if (n == cap) {
        size_t nc = cap ? 2 * cap : 8;
        fps_xabort_t *na = fps_realloc(ab, nc * sizeof *na);
        if (!na) break; /* out of memory: those peers fail at their deadline */
        ab = na;
        cap = nc;
      }
      ab[n++] = (fps_xabort_t){t, k->version, k->attempt, sp->block_shards[k->block], sp->block_index};
      fps__xmail_mark(sp, k->version, k->attempt, true);
    }
    pthread_mutex_unlock(&t->mu);
  }
  pthread_rwlock_unlock(&sh->store.mu);
  for (size_t i = 0; i < n; i++) {
    fps_xmsg_t m = {.name = ab[i].t->name, .version = ab[i].version, .from_shard = sh->cfg.shard_id,
                    .shard_count = sh->cfg.shard_count, .block_index = ab[i].block, .phase = FPS_XPHASE_ABORT,
                    .attempt = ab[i].attempt, .partials = NULL, .len = 0, .stamp = fps__xrec_stamp(sh)};
    atomic_fetch_add(&sh->xaborts_in_flight, 1);
    if (sh->xsend(sh->xsend_ctx, ab[i].to, &m, fps_clock_after(fps_now_ns(), FPS_XABORT_DEADLINE_S),
                  fps__xabort_sent, sh) < 0)
      atomic_fetch_sub(&sh->xaborts_in_flight, 1);
  }
  fps_free(ab);
}

void fps_shard_drain_exchanges(fps_shard_t *sh, double max_seconds) {
  atomic_store(&sh->xstopping, true);
  if (sh->xsend) fps__xstep_abort_waiting(sh);
  int64_t until = fps_clock_after(fps_now_ns(), max_seconds);
  for (;;) {
    pthread_mutex_lock(&sh->xs_mu);
    /* The ABORTs too: stopping the peers next would cancel them unsent,
     * and their receivers would wait out their deadline. */
    bool idle = sh->xgroups == NULL && atomic_load(&sh->xaborts_in_flight) == 0;
    pthread_mutex_unlock(&sh->xs_mu);
    if (idle || fps_now_ns() >= until) return;
    struct timespec ts = {0, 5 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
}

/* ------------------------------------------------------------ receive */

static bool fps__same(const uint8_t *a, size_t alen, const void *b, size_t blen) {
  return alen == blen && memcmp(a, b, alen) == 0;
}

void fps_xreply_free(fps_xreply_t *r) {
  if (!r) return;
  fps_free(r->partials);
  memset(r, 0, sizeof *r);
}

/* Our send of `phase` of x to shard `to` was acknowledged. REQUIRES t->mu
 * (x is the step in flight; its group's lock is taken here). */
static bool fps__xsent_acked(struct fps_xstep_s *x, int phase, uint32_t to) {
  fps_xgroup_t *g = x->g;
  bool acked = false;
  pthread_mutex_lock(&g->mu);
  const fps_xsendrec_t *rec = g->rec + (size_t)(phase - 1) * g->nsend;
  for (size_t i = 0; i < g->nsend; i++)
    if (rec[i].x == x && rec[i].to == to) acked = rec[i].state == 2;
  pthread_mutex_unlock(&g->mu);
  return acked;
}

/* The answer to m beyond OK (fps_xreply_t): whether its step applied
 * here, and what the sender lacks of ours that it should have had. x: our
 * step of m's (version, attempt) in flight, or NULL. REQUIRES t->mu. */
static int fps__xreply_fill(const fps_tensor_split_t *sp, struct fps_xstep_s *x, const fps_xmsg_t *m,
                            fps_xreply_t *r) {
  if (!r) return 0;
  const fps_xmail_t *ml = sp->mail;
  bool applied = !x && m->attempt && ml && ml->applied && ml->applied_version == m->version &&
                 ml->applied_attempt == m->attempt;
  r->applied = applied;
  if (!m->want || (!applied && !(x && fps__xsent_acked(x, m->phase, m->from_shard)))) return 0;
  if (m->phase == FPS_XPHASE_COMMIT) {
    r->committed = true;
    return 0;
  }
  if (m->phase != FPS_SPLIT_PHASE_STATS && m->phase != FPS_SPLIT_PHASE_U2) return 0;
  int i = m->phase - 1;
  const uint8_t *own = applied ? ml->own[i] : x->own[i];
  size_t len = applied ? ml->own_len[i] : x->own_len[i];
  if (!own || !len || (m->phase == FPS_SPLIT_PHASE_U2 && !applied && !x->u2)) return 0;
  if (!(r->partials = fps_malloc(len))) return FPS_ENOMEM;
  memcpy(r->partials, own, len);
  r->len = len;
  return 0;
}

int fps_shard_exchange_receive(fps_shard_t *sh, const fps_xmsg_t *m, fps_xreply_t *reply, char *why, size_t wl) {
  const char *name = m->name ? m->name : "";
  if (reply) memset(reply, 0, sizeof *reply);
  char sub[512];
  /* The checks that need no tensor, in the proto's order. */
  if (fps_shard_name_check(name, sub, sizeof sub) < 0) {
    snprintf(why, wl, "Exchange: %s", sub);
    return FPS_EINVAL;
  }
  if (m->phase < FPS_SPLIT_PHASE_STATS || m->phase > FPS_XPHASE_ABORT) {
    snprintf(why, wl,
             "Exchange of tensor '%s': phase %d (expected STATS = 1, U2 = 2, COMMIT = 3, VERSIONS = 4 or ABORT = 5)",
             name, m->phase);
    return FPS_EINVAL;
  }
  if (m->shard_count != sh->cfg.shard_count) {
    snprintf(why, wl, "Exchange of tensor '%s' from shard %u, which is one of %u shards; this shard is one of %u",
             name, m->from_shard, m->shard_count, sh->cfg.shard_count);
    return FPS_ESTATE;
  }
  if (m->from_shard >= sh->cfg.shard_count || m->from_shard == sh->cfg.shard_id) {
    snprintf(why, wl, "Exchange of tensor '%s': from_shard %u is not another shard of the %u (this is shard %u)",
             name, m->from_shard, sh->cfg.shard_count, sh->cfg.shard_id);
    return FPS_EINVAL;
  }
  int rc = fps_shard_exchange_payload_check(m->phase, m->partials, m->len, sub, sizeof sub);
  if (rc < 0) {
    snprintf(why, wl, "Exchange of tensor '%s' from shard %u: %s", name, m->from_shard, sub);
    return FPS_EINVAL;
  }
  fps_tensor_t *t = fps_store_find(&sh->store, name);
  if (!t) {
    snprintf(why, wl, "Exchange of tensor '%s' from shard %u: this shard holds no row block of it", name,
             m->from_shard);
    return FPS_ENOTFOUND;
  }
  if (!t->split) { /* fixed at Create: no lock needed */
    snprintf(why, wl,
             "Exchange of tensor '%s' from shard %u: this shard holds the tensor whole, not as a row block of a "
             "split tensor",
             name, m->from_shard);
    return FPS_ESTATE;
  }
  fps_tensor_split_t *sp = t->split;
  if (m->block_index >= sp->n_blocks || m->block_index == sp->block_index ||
      sp->block_shards[m->block_index] != m->from_shard) {
    snprintf(why, wl,
             "Exchange of tensor '%s': block %u from shard %u is not in this shard's map (%u blocks, this shard "
             "holds block %u%s)",
             name, m->block_index, m->from_shard, sp->n_blocks, sp->block_index,
             m->block_index < sp->n_blocks && m->block_index != sp->block_index ? ", that block is another shard's"
                                                                                : "");
    return FPS_ESTATE;
  }
  fps_split_geom_t geo;
  if (fps__block_geom(t, m->block_index, &geo) < 0) { /* not reached: the map was checked at Create */
    snprintf(why, wl, "Exchange of tensor '%s': block %u's rows are invalid", name, m->block_index);
    return FPS_ESTATE;
  }
  /* A peer's versions, in a recovery (xrecover.c): takes its own locks. */
  if (m->phase == FPS_XPHASE_VERSIONS) return fps__xrec_receive(sh, t, m, why, wl);
  bool behind = false; /* the peers have moved on: agree on a version */
  pthread_mutex_lock(&t->mu);
  uint64_t v = t->version;
  const char *ph = m->phase == FPS_SPLIT_PHASE_STATS ? "STATS" : "U2";
  if (!t->ready) {
    rc = FPS_ESTATE;
    snprintf(why, wl, "Exchange of tensor '%s' from shard %u: this shard's block is still initialising", name,
             m->from_shard);
    goto out;
  }
  if (m->stamp) fps__xrec_peer_stepped(t, m->block_index, m->stamp);
  if (m->phase == FPS_XPHASE_ABORT) {
    /* The sender stops before its step of (version, attempt) begins: ours
     * cannot complete (it lacks the sender's partials), so it fails now
     * rather than at its deadline. */
    struct fps_xstep_s *ax =
        sp->xs && sp->xs->version == m->version && sp->xs->attempt == m->attempt ? sp->xs : NULL;
    if (!ax) {
      if (sp->mail) fps__xmail_mark(sp, m->version, m->attempt, true);
      rc = 0;
      goto out;
    }
    fps_xgroup_t *ag = ax->g;
    pthread_mutex_lock(&ag->mu);
    fps__xg_fail_locked(ag,
                        "tensor '%s' step %" PRIu64 ": shard %u is shutting down and will not take part in this "
                        "step; nothing was applied, retry",
                        name, m->version, m->from_shard);
    bool ready = fps__xg_ready_locked(ag);
    pthread_mutex_unlock(&ag->mu);
    pthread_mutex_unlock(&t->mu);
    if (ready) fps__xg_advance(ag);
    return 0;
  }
  if (m->phase == FPS_XPHASE_COMMIT) {
    const struct fps_xmail_s *ml = sp->mail;
    if (ml && ml->applied && ml->applied_version == m->version && ml->applied_attempt == m->attempt &&
        m->version + 1 == v) {
      rc = fps__xreply_fill(sp, NULL, m, reply); /* that step applied here: the sender's retry */
      goto out;
    }
    struct fps_xstep_s *cx =
        sp->xs && sp->xs->version == m->version && sp->xs->attempt == m->attempt ? sp->xs : NULL;
    if (!cx) {
      /* Not acknowledged, so the sender does not apply. At our version it
       * is retried (UNAVAILABLE): our step of it may be about to begin (a
       * retry of a failed attempt, a round still filling). */
      char att[64];
      fps__attempt_text(m->attempt, att, sizeof att);
      rc = m->version == v ? FPS_EUNAVAILABLE : FPS_ESTATE;
      snprintf(why, wl,
               "Exchange of tensor '%s' from shard %u: commit of the step from version %" PRIu64
               " (%s), but no step of it is in flight on this shard (this block is at version %" PRIu64
               "%s%016" PRIx64 ")%s",
               name, m->from_shard, m->version, att, v, sp->xs ? ", its step in flight is of attempt 0x" : "",
               sp->xs ? sp->xs->attempt : 0, m->version == v ? "; retry" : "; nothing is applied");
      goto out;
    }
    if ((rc = fps__xreply_fill(sp, cx, m, reply)) < 0) {
      snprintf(why, wl, "Exchange of tensor '%s': out of memory", name);
      goto out;
    }
    if (cx->committed[m->block_index]) /* a retry */
      goto out;
    cx->committed[m->block_index] = true;
    fps_xgroup_t *cg = cx->g;
    pthread_mutex_lock(&cg->mu);
    if (cg->phase == FPS_XPHASE_COMMIT) cg->missing--;
    bool ready = fps__xg_ready_locked(cg);
    pthread_mutex_unlock(&cg->mu);
    pthread_mutex_unlock(&t->mu);
    if (ready) fps__xg_advance(cg);
    return 0;
  }
  if (m->version < v) {
    /* A peer retrying partials of the step just finished here (our
     * acknowledgement was lost): the same bytes are answered OK. */
    fps_xkept_t *k =
        m->version + 1 == v ? fps__xmail_find(sp, m->version, m->block_index, m->phase, m->attempt, true) : NULL;
    /* A step that came in a standby's image kept no peer partials: its
     * attempt (the same push_ids, so the same gradients) must match. */
    const fps_xmail_t *ml = sp->mail;
    bool imaged = !k && m->version + 1 == v && m->attempt && ml && ml->imaged && ml->applied &&
                  ml->applied_version == m->version && ml->applied_attempt == m->attempt;
    if ((k && fps__same(k->wire, k->len, m->partials, m->len)) || imaged) {
      if ((rc = fps__xreply_fill(sp, NULL, m, reply)) < 0)
        snprintf(why, wl, "Exchange of tensor '%s': out of memory", name);
      goto out;
    }
    rc = FPS_ESTATE;
    snprintf(why, wl,
             "Exchange of tensor '%s' from shard %u: %s partials of the step from version %" PRIu64
             ", but this shard's block is at version %" PRIu64 " (that step is over here)",
             name, m->from_shard, ph, m->version, v);
    behind = true;
    goto out;
  }
  if (m->version > v + 1) {
    char mv[FPS_U64_TEXT], ahead[FPS_U64_TEXT];
    rc = FPS_ESTATE;
    snprintf(why, wl,
             "Exchange of tensor '%s' from shard %u: partials of the step from version %s, more than one step "
             "ahead of this shard's block (version %" PRIu64 ", %s steps behind them): the blocks have diverged",
             name, m->from_shard, fps_u64_text(m->version, mv), v, fps_u64_text(m->version - v, ahead));
    behind = true;
    goto out;
  }
  char att[64];
  fps__attempt_text(m->attempt, att, sizeof att);
  if (sp->n_blocks == 2 && fps__xmail_failed(sp, m->version, m->attempt)) {
    /* Two blocks apply on "all partials here, ours acknowledged": not
     * acknowledged, so the sender's step of that attempt cannot apply
     * what this shard abandoned. UNAVAILABLE, so the sender retries until
     * its deadline: the workers' retry of the attempt (the same push_ids)
     * may begin here meanwhile and take them. With 3+ blocks the COMMIT
     * round keeps the sender from applying, so they are kept like early
     * partials: retries that reach the shards at different moments then
     * still meet (refusing them made such retries fail each other round
     * after round). */
    rc = FPS_EUNAVAILABLE;
    snprintf(why, wl,
             "Exchange of tensor '%s' from shard %u: %s of the step from version %" PRIu64
             " failed on this shard; nothing was applied; kept out until a retry of it begins here",
             name, m->from_shard, att, m->version);
    goto out;
  }
  /* Our step in flight, if these partials are of its attempt; otherwise
   * they are kept for a step of their own attempt. */
  struct fps_xstep_s *x =
      sp->xs && sp->xs->version == m->version && sp->xs->attempt == m->attempt ? sp->xs : NULL;
  if (!x && atomic_load(&sh->xstopping)) {
    /* Shutting down: that step never begins here, so the sender's fails
     * now (not acknowledged) instead of at its deadline. */
    rc = FPS_ESTATE;
    snprintf(why, wl,
             "Exchange of tensor '%s' from shard %u: this shard is shutting down; its step from version %" PRIu64
             " will not begin, nothing was applied",
             name, m->from_shard, m->version);
    goto out;
  }
  /* A retry of partials already here: OK if identical. */
  const fps_xpart_t *had = x ? &x->part[(size_t)(m->phase - 1) * x->nb + m->block_index] : NULL;
  const fps_xkept_t *kept = x ? NULL : fps__xmail_find(sp, m->version, m->block_index, m->phase, m->attempt, false);
  if ((had && had->wire) || kept) {
    bool same = had && had->wire ? fps__same(had->wire, had->len, m->partials, m->len)
                                 : fps__same(kept->wire, kept->len, m->partials, m->len);
    rc = same ? fps__xreply_fill(sp, x, m, reply) : FPS_EEXISTS;
    if (rc == FPS_ENOMEM) snprintf(why, wl, "Exchange of tensor '%s': out of memory", name);
    else if (!same)
      snprintf(why, wl,
               "Exchange of tensor '%s' from shard %u: different %s partials of block %u for the step from "
               "version %" PRIu64 " (%s) were already received",
               name, m->from_shard, ph, m->block_index, m->version, att);
    goto out;
  }
  fps_split_partials_t dec;
  rc = fps_split_partials_decode(m->partials, m->len, &geo, m->phase, &dec, sub, sizeof sub);
  if (rc == FPS_ENOMEM) {
    snprintf(why, wl, "Exchange of tensor '%s': out of memory", name);
    goto out;
  }
  if (rc < 0) {
    rc = FPS_ESTATE;
    snprintf(why, wl,
             "Exchange of tensor '%s' from shard %u: the partials do not fit block %u of this shard's map (%s): "
             "the blocks have diverged",
             name, m->from_shard, m->block_index, sub);
    goto out;
  }
  uint64_t bad = m->version == v && m->phase == FPS_SPLIT_PHASE_STATS ? fps__colstate_differs(t, &dec) : 0;
  if (bad) {
    fps_split_partials_free(&dec);
    rc = FPS_ESTATE;
    snprintf(why, wl,
             "Exchange of tensor '%s' from shard %u: block %u's column state of matrix %" PRIu64
             " before step %" PRIu64 " differs from this shard's: the blocks have diverged",
             name, m->from_shard, m->block_index, bad - 1, v);
    goto out;
  }
  if (x && m->phase == FPS_SPLIT_PHASE_U2 && x->combined && !x->u2) {
    fps_split_partials_free(&dec);
    rc = FPS_ESTATE;
    snprintf(why, wl,
             "Exchange of tensor '%s' from shard %u: U2 partials for step %" PRIu64
             ", but no U2 phase is due here: the blocks have diverged",
             name, m->from_shard, v);
    goto out;
  }
  if (!x && fps__xmail_count(sp, m->version, m->block_index, m->phase) >= KEPT_ATTEMPTS) {
    fps_split_partials_free(&dec);
    rc = FPS_EUNAVAILABLE;
    snprintf(why, wl,
             "Exchange of tensor '%s' from shard %u: %d other attempts of block %u's %s partials for the step "
             "from version %" PRIu64 " already wait here; %s is taken once this shard's own step of it starts "
             "(retry)",
             name, m->from_shard, KEPT_ATTEMPTS, m->block_index, ph, m->version, att);
    goto out;
  }
  uint8_t *wire = fps_malloc(m->len ? m->len : 1);
  fps_xkept_t *kp = NULL;
  if (wire && !x) {
    if (!sp->mail) sp->mail = fps_calloc(1, sizeof *sp->mail);
    kp = sp->mail ? fps_calloc(1, sizeof *kp) : NULL;
  }
  if (!wire || (!x && !kp)) {
    fps_free(wire);
    fps_split_partials_free(&dec);
    rc = FPS_ENOMEM;
    snprintf(why, wl, "Exchange of tensor '%s': out of memory keeping the partials", name);
    goto out;
  }
  if (m->len) memcpy(wire, m->partials, m->len);
  fps_metrics_exchange_bytes(0, m->len);
  if (!x) {
    /* Before our own step of that version and attempt: kept until it
     * starts. */
    *kp = (fps_xkept_t){m->version, m->attempt, m->block_index, m->phase, false, wire, m->len, dec, sp->mail->head};
    sp->mail->head = kp;
    rc = 0;
    goto out;
  }
  /* Before the partials complete the step (and its own move to the mail). */
  if (fps__xreply_fill(sp, x, m, reply) < 0) {
    fps_free(wire);
    fps_split_partials_free(&dec);
    rc = FPS_ENOMEM;
    snprintf(why, wl, "Exchange of tensor '%s': out of memory", name);
    goto out;
  }
  fps_xpart_t *p = &x->part[(size_t)(m->phase - 1) * x->nb + m->block_index];
  p->wire = wire;
  p->len = m->len;
  p->dec = dec;
  fps_xgroup_t *g = x->g;
  pthread_mutex_lock(&g->mu);
  if (m->phase == g->phase && (m->phase == FPS_SPLIT_PHASE_STATS || x->u2)) g->missing--;
  bool ready = fps__xg_ready_locked(g);
  pthread_mutex_unlock(&g->mu);
  pthread_mutex_unlock(&t->mu);
  /* The last partials: this thread completes the step (its pushes are
   * resolved before the peer hears OK). */
  if (ready) fps__xg_advance(g);
  return 0;
out:
  pthread_mutex_unlock(&t->mu);
  if (rc < 0) fps_xreply_free(reply);
  if (behind) fps__xrec_announce(sh, t);
  return rc;
}

int fps_shard_exchange_payload_check(int phase, const void *buf, size_t len, char *why, size_t wl) {
  if (phase == FPS_XPHASE_COMMIT || phase == FPS_XPHASE_ABORT) {
    if (len == 0) return 0;
    snprintf(why, wl, "a %s carries no partials (%zu bytes)", phase == FPS_XPHASE_COMMIT ? "COMMIT" : "ABORT", len);
    return FPS_EINVAL;
  }
  if (phase == FPS_XPHASE_VERSIONS) {
    if (len >= 8 && len % 8 == 0 && len / 8 <= FPS_XVERSIONS_MAX) return 0;
    snprintf(why, wl, "VERSIONS lists 1 to %d versions of 8 bytes (%zu bytes)", FPS_XVERSIONS_MAX, len);
    return FPS_EINVAL;
  }
  return fps_split_partials_check(buf, len, phase, NULL, why, wl) < 0 ? FPS_EINVAL : 0;
}
