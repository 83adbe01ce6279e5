/* Recovery of split tensors to one version (internal.h).
 *
 * The blocks of a split tensor step together (xstep.c), so while every
 * shard runs they stand at one version. They part when a block shard
 * restarts from a checkpoint older than its peers' versions (SIGKILL), or
 * when a step applies on some blocks only (a shard that committed and lost
 * its peers, a crash in the commit round). Steps are then refused
 * everywhere, forever, unless the blocks move to one version again. To
 * have a version to move to:
 *
 *   ANCHORS  every --split-anchor-steps versions, the step that reaches a
 *            multiple of N writes the block (weights by reference, state
 *            copied under t->mu) to <checkpoint-dir>/anchors/<hash of the
 *            name>/, keeping the newest ANCHORS_KEEP, before its pushes are
 *            answered. Every shard writes the same versions, since the
 *            blocks step together; a shard restarted from its checkpoint
 *            finds its anchors on disk (fps__xrec_restored).
 *   VERSIONS a block that meets a peer at another version (an Exchange of
 *            another step, a worker's push ahead of or behind it), whose
 *            step failed, or that was restored, sends every other block's
 *            shard the versions it can be restored to: its own and its
 *            anchors'. A shard that gets a peer's list answers with its
 *            own (once per exchange deadline, or at once if that peer's
 *            list was not known yet). Until it holds every list and stands
 *            at the version they agree on, a block announces again once
 *            per exchange deadline (the expiry hook, fps__xrec_tick): a
 *            list lost on its way, or refused by a shard that was starting,
 *            is sent again, and a peer that lacks ours answers. A block
 *            that moved (AGREE) announces its new list at once.
 *   STAMPS   every Exchange message carries its sender's clock
 *            (fps__xrec_stamp: wall-clock ns, strictly increasing in a
 *            process, so also across its restarts; a receiver counts a
 *            stamp at most 10 s past its own clock). A list sent before its
 *            sender took part in a step is out of date once that step
 *            applied: a list older than the newest step message from that
 *            block (or than the list already held) is ignored, so a list
 *            delivered late cannot move a block back to a version the
 *            blocks have left.
 *   AGREE    once a shard holds every other block's list, the target is
 *            the newest version in all of them (each shard computes the
 *            same from the same lists). A block not at it loads it from its
 *            anchor once no round of it is open or exchanging (else the
 *            expiry hook retries, fps__xrec_tick), logs what it lost, and
 *            counts it (factorps_split_recoveries_total,
 *            factorps_split_lost_steps_total, TensorStats). Workers pushing
 *            another step then get "ahead of shard" or "stale push" with a
 *            hint, pull, and go on from the agreed version.
 *
 * The lists are forgotten when a step applies (the blocks agree again).
 * If no version is in every list (anchors off, or pruned past), the
 * blocks stay apart and the shard logs the lists once. */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "alloc.h"
#include "checkpoint.h"
#include "metrics.h"
#include "internal.h"

#define ANCHORS_KEEP 3 /* anchors kept per block: see docs/operations.md */

struct fps_xanchor_s {
  fps_tensor_t *t;
  uint64_t version;
  bool fresh;                 /* the block's first anchor: its directory is emptied first */
  uint64_t history;           /* the block's history (fps_xrec_t) when it was taken */
  fps_ckpt_snapshot_t *snap;
  struct fps_xanchor_s *next;
};

typedef struct fps_xrec_s {
  uint64_t anchor[ANCHORS_KEEP]; /* versions on disk, newest first */
  char *path[ANCHORS_KEEP];   /* their files */
  unsigned nanchor;
  bool dir_owned;             /* the directory is this life's (emptied or scanned) */
  uint64_t history;           /* replaces so far (fps__xrec_new_history) */
  bool *have;                 /* [n_blocks]: that block's list is here */
  uint64_t *list;             /* [n_blocks * FPS_XVERSIONS_MAX] */
  unsigned *nlist;            /* [n_blocks] */
  uint64_t *list_stamp;       /* [n_blocks]: the held list's stamp */
  uint64_t *step_stamp;       /* [n_blocks]: the newest stamp of that block's step messages */
  int64_t announced_ns;       /* 0: not since the blocks last agreed */
  bool apart;                 /* announced, and not yet at the version every list holds:
                               * announces again (fps__xrec_tick); counted in sh->xrec_apart */
  bool pending;               /* moving to `target` waits for the round */
  uint64_t target;
  bool unagreeable;           /* every list is here and no version is in all of them:
                               * logged once, steps refused (fps__xrec_refuse) */
  uint64_t recoveries;        /* times this block moved to an agreed version */
  uint64_t lost_steps;        /* updates that undid, in total */
  uint64_t last_from, last_to;
} fps_xrec_t;

/* Frees r and what it owns (a partly made one too: fps_calloc'ed). */
static void fps__xrec_free(fps_xrec_t *r) {
  for (unsigned i = 0; i < r->nanchor; i++) fps_free(r->path[i]);
  fps_free(r->have);
  fps_free(r->list);
  fps_free(r->nlist);
  fps_free(r->list_stamp);
  fps_free(r->step_stamp);
  fps_free(r);
}

/* t's recovery record, made on first use. NULL on OOM. REQUIRES t->mu. */
static fps_xrec_t *fps__xrec_get(fps_tensor_t *t) {
  fps_tensor_split_t *sp = t->split;
  if (sp->rec) return sp->rec;
  fps_xrec_t *r = fps_calloc(1, sizeof *r);
  if (!r) return NULL;
  r->have = fps_calloc(sp->n_blocks, sizeof *r->have);
  r->list = fps_calloc((size_t)sp->n_blocks * FPS_XVERSIONS_MAX, sizeof *r->list);
  r->nlist = fps_calloc(sp->n_blocks, sizeof *r->nlist);
  r->list_stamp = fps_calloc(sp->n_blocks, sizeof *r->list_stamp);
  r->step_stamp = fps_calloc(sp->n_blocks, sizeof *r->step_stamp);
  if (!r->have || !r->list || !r->nlist || !r->list_stamp || !r->step_stamp) {
    fps__xrec_free(r);
    return NULL;
  }
  sp->rec = r;
  return r;
}

void fps__xrec_forget(fps_tensor_t *t) {
  fps_xrec_t *r = t->split ? t->split->rec : NULL;
  if (!r) return;
  fps__xrec_free(r);
  t->split->rec = NULL;
}

/* Wall-clock ns: stamps are compared across a sender's restarts. */
static uint64_t fps__wall_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t fps__xrec_stamp(fps_shard_t *sh) {
  uint64_t now = fps__wall_ns();
  uint64_t last = atomic_load(&sh->xstamp_last);
  for (;;) {
    uint64_t next = now > last ? now : last + 1;
    if (atomic_compare_exchange_weak(&sh->xstamp_last, &last, next)) return next;
  }
}

/* A peer's stamp as this shard keeps it: at most STAMP_AHEAD_NS past its
 * own clock. A stamp from far in the future (a forged Exchange, a peer
 * whose clock jumped) would otherwise make every later list of that block
 * look out of date, and keep its blocks apart for good; bounded, it does
 * so for at most that long, after which the block's re-announced lists
 * count again. Peers' clocks that differ by less keep the order of their
 * messages exactly. */
#define STAMP_AHEAD_NS (UINT64_C(10) * 1000000000u)

static uint64_t fps__stamp_bounded(uint64_t stamp) {
  uint64_t lim = fps__wall_ns() + STAMP_AHEAD_NS;
  return stamp > lim ? lim : stamp;
}

void fps__xrec_peer_stepped(fps_tensor_t *t, uint32_t block, uint64_t stamp) {
  fps_xrec_t *r = fps__xrec_get(t);
  stamp = fps__stamp_bounded(stamp);
  if (r && stamp > r->step_stamp[block]) r->step_stamp[block] = stamp;
}

/* Marks r apart (announced, not agreed) or not, keeping sh->xrec_apart. */
static void fps__xrec_set_apart(fps_shard_t *sh, fps_xrec_t *r, bool apart) {
  if (r->apart == apart) return;
  r->apart = apart;
  atomic_fetch_add(&sh->xrec_apart, apart ? 1 : -1);
}

/* Forgets the peers' lists: the blocks agree (a step applied) or moved. */
static void fps__xrec_reset(fps_shard_t *sh, fps_xrec_t *r, uint32_t nb) {
  memset(r->have, 0, nb * sizeof *r->have);
  memset(r->list_stamp, 0, nb * sizeof *r->list_stamp);
  fps__xrec_set_apart(sh, r, false);
  r->announced_ns = 0;
  r->unagreeable = false;
  if (r->pending) atomic_fetch_sub(&sh->xrec_pending, 1);
  r->pending = false;
}

void fps__xrec_new_history(fps_shard_t *sh, fps_tensor_t *t) {
  fps_xrec_t *r = t->split ? t->split->rec : NULL;
  if (!r) return;
  fps__xrec_reset(sh, r, t->split->n_blocks);
  /* Off the disk too: a restart would find them, and every block's
   * restart the same old versions, which would then agree. */
  for (unsigned i = 0; i < r->nanchor; i++) {
    unlink(r->path[i]);
    fps_free(r->path[i]);
  }
  r->nanchor = 0;
  r->dir_owned = false; /* the next anchor empties the directory first */
  r->history++;         /* an old anchor still being written is dropped */
}

/* <checkpoint-dir>/anchors (sub false) or its directory for t. */
static void fps__anchor_dir(const fps_shard_t *sh, const fps_tensor_t *t, bool sub, char *buf, size_t len) {
  /* FNV-1a of the name: tensor names may hold any byte a path may not. */
  uint64_t h = UINT64_C(0xcbf29ce484222325);
  for (const char *p = t->name; *p; p++) h = (h ^ (uint8_t)*p) * UINT64_C(0x100000001b3);
  if (sub) snprintf(buf, len, "%s/anchors/%016" PRIx64, sh->cfg.checkpoint_dir, h);
  else snprintf(buf, len, "%s/anchors", sh->cfg.checkpoint_dir);
}

/* The versions t can be restored to: its own first, then its anchors'.
 * REQUIRES t->mu. */
static unsigned fps__own_list(const fps_tensor_t *t, const fps_xrec_t *r, uint64_t *out) {
  unsigned n = 0;
  out[n++] = t->version;
  for (unsigned i = 0; r && i < r->nanchor && n < FPS_XVERSIONS_MAX; i++)
    if (r->anchor[i] != t->version) out[n++] = r->anchor[i];
  return n;
}

static void fps__list_text(const uint64_t *v, unsigned n, char *buf, size_t len) {
  size_t k = (size_t)snprintf(buf, len, "[");
  for (unsigned i = 0; i < n && k < len; i++)
    k += (size_t)snprintf(buf + k, len - k, "%s%" PRIu64, i ? ", " : "", v[i]);
  if (k < len) snprintf(buf + k, len - k, "]");
}

/* ------------------------------------------------------------ anchors */

static void fps__anchor_release(void *ref) { fps_snap_unref(ref); }

void fps__xrec_applied_locked(fps_shard_t *sh, fps_tensor_t *t, fps_xanchor_t **list) {
  fps_tensor_split_t *sp = t->split;
  if (!sp) return;
  if (sp->rec) fps__xrec_reset(sh, sp->rec, sp->n_blocks);
  uint32_t every = sh->cfg.split_anchor_steps;
  if (!every || !*sh->cfg.checkpoint_dir || t->version % every) return;
  fps_xrec_t *r = fps__xrec_get(t);
  if (!r) goto fail_quiet; /* out of memory: no anchor, recovery may go further back */
  fps_xanchor_t *a = fps_calloc(1, sizeof *a);
  if (!a || fps_ckpt_snapshot_create(&a->snap, sh->cfg.shard_id, sh->cfg.shard_count,
                                     fps_mode_name(sh->cfg.mode)) < 0)
    goto fail;
  fps_ckpt_snapshot_borrow_params(a->snap, fps__anchor_release);
  fps_ckpt_block_t map = {.block_index = sp->block_index, .n_blocks = sp->n_blocks, .bounds = sp->bounds,
                          .block_shards = sp->block_shards, .shard_count = sp->shard_count};
  size_t idx = 0;
  char why[FPS_CKPT_WHY_MAX];
  if (fps_ckpt_snapshot_add_block(a->snap, t->name, &t->shape, &t->hp, &map, &idx, why, sizeof why) < 0) goto fail;
  fps_snap_ref(t->pbuf);
  if (fps_ckpt_snapshot_copy_block_ref(a->snap, idx, t->version, t->param, t->pbuf, &sp->st) < 0) {
    fps_snap_unref(t->pbuf);
    goto fail;
  }
  fps_ckpt_snapshot_set_applied(a->snap, idx, t->last_lr, t->last_weight_decay);
  a->t = t;
  a->version = t->version;
  a->fresh = !r->dir_owned;
  a->history = r->history;
  r->dir_owned = true;
  a->next = *list;
  *list = a;
  return;
fail:
  if (a) fps_ckpt_snapshot_destroy(a->snap);
  fps_free(a);
fail_quiet:
  FPS_LOG(FPS_LOG_WARN, "tensor '%s': no anchor at version %" PRIu64 " (out of memory)", t->name, t->version);
}

/* Deletes the checkpoint files of dir (another life's anchors). */
static void fps__anchor_dir_empty(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *e;
  char path[FPS_CKPT_PATH_MAX + 300];
  while ((e = readdir(d)))
    if (strncmp(e->d_name, "ckpt-", 5) == 0) {
      snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
      unlink(path);
    }
  closedir(d);
}

void fps__xrec_anchor_flush(fps_shard_t *sh, fps_xanchor_t *list) {
  while (list) {
    fps_xanchor_t *a = list;
    list = a->next;
    char dir[FPS_CKPT_PATH_MAX], why[FPS_CKPT_WHY_MAX] = "";
    fps__anchor_dir(sh, a->t, false, dir, sizeof dir);
    mkdir(dir, 0700);
    fps__anchor_dir(sh, a->t, true, dir, sizeof dir);
    mkdir(dir, 0700);
    if (a->fresh) fps__anchor_dir_empty(dir);
    fps_ckpt_written_t w;
    int rc = fps_ckpt_write(dir, a->snap, ANCHORS_KEEP, &w, why, sizeof why);
    char *path = rc == 0 ? fps_strdup(w.path) : NULL;
    if (rc < 0 || !path) {
      FPS_LOG(FPS_LOG_WARN, "tensor '%s': anchor at version %" PRIu64 " not written into %s: %s (%s)",
              a->t->name, a->version, dir, why, fps_strerror(rc < 0 ? rc : FPS_ENOMEM));
    } else {
      pthread_mutex_lock(&a->t->mu);
      fps_xrec_t *r = a->t->split->rec;
      if (r->history != a->history) { /* replaced meanwhile: of no version now */
        unlink(path);
        fps_free(path);
      } else {
        if (r->nanchor == ANCHORS_KEEP) fps_free(r->path[ANCHORS_KEEP - 1]);
        else r->nanchor++;
        memmove(&r->anchor[1], &r->anchor[0], (r->nanchor - 1) * sizeof r->anchor[0]);
        memmove(&r->path[1], &r->path[0], (r->nanchor - 1) * sizeof r->path[0]);
        r->anchor[0] = a->version;
        r->path[0] = path;
      }
      pthread_mutex_unlock(&a->t->mu);
    }
    fps_ckpt_snapshot_destroy(a->snap);
    fps_free(a);
  }
}

/* The block of t in checkpoint ck, if it is t's (same name, map and
 * geometry). */
static fps_ckpt_tensor_t *fps__anchor_find(fps_ckpt_t *ck, const fps_tensor_t *t) {
  const fps_tensor_split_t *sp = t->split;
  for (size_t i = 0; i < ck->n_tensors; i++) {
    fps_ckpt_tensor_t *ct = &ck->tensors[i];
    if (strcmp(ct->name, t->name) != 0) continue;
    const fps_ckpt_block_t *b = &ct->block;
    if (b->n_blocks != sp->n_blocks || b->block_index != sp->block_index ||
        memcmp(b->bounds, sp->bounds, ((size_t)sp->n_blocks + 1) * sizeof *b->bounds) != 0 ||
        ct->bstate.g.block_numel != sp->g.block_numel || ct->bstate.g.factored != sp->g.factored)
      return NULL;
    return ct;
  }
  return NULL;
}

void fps__xrec_restored(fps_shard_t *sh, fps_tensor_t *t) {
  if (!t->split || !*sh->cfg.checkpoint_dir) return;
  char dir[FPS_CKPT_PATH_MAX];
  fps__anchor_dir(sh, t, true, dir, sizeof dir);
  fps_ckpt_entry_t *e = NULL;
  size_t n = 0;
  fps_ckpt_expect_t ex = {.shard_id = sh->cfg.shard_id, .shard_count = sh->cfg.shard_count,
                          .mode = fps_mode_name(sh->cfg.mode)};
  if (fps_ckpt_list(dir, &ex, &e, &n) < 0) n = 0;
  pthread_mutex_lock(&t->mu);
  fps_xrec_t *r = fps__xrec_get(t);
  if (r) r->dir_owned = true; /* its anchors go on from these */
  pthread_mutex_unlock(&t->mu);
  for (size_t i = 0; r && i < n && r->nanchor < ANCHORS_KEEP; i++) { /* newest first */
    if (e[i].status != 0) continue;
    fps_ckpt_t *ck = NULL;
    char why[FPS_CKPT_WHY_MAX];
    if (fps_ckpt_load_file(e[i].path, &ex, &ck, why, sizeof why) < 0) continue;
    fps_ckpt_tensor_t *ct = fps__anchor_find(ck, t);
    char *path = ct ? fps_strdup(e[i].path) : NULL;
    if (path) {
      pthread_mutex_lock(&t->mu);
      r->anchor[r->nanchor] = ct->version;
      r->path[r->nanchor++] = path;
      pthread_mutex_unlock(&t->mu);
    }
    fps_ckpt_destroy(ck);
  }
  fps_ckpt_list_free(e);
  if (r && r->nanchor) {
    uint64_t v[FPS_XVERSIONS_MAX];
    char text[256];
    pthread_mutex_lock(&t->mu);
    unsigned k = fps__own_list(t, r, v);
    pthread_mutex_unlock(&t->mu);
    fps__list_text(v, k, text, sizeof text);
    FPS_LOG(FPS_LOG_INFO, "tensor '%s': block %u restored at version %" PRIu64 "; versions it can go to: %s",
            t->name, t->split->block_index, t->version, text);
  }
}

/* ----------------------------------------------------------- agreeing */

static void fps__xrec_sent(void *arg, int err, const char *msg, const fps_xreply_t *reply) {
  (void)reply;
  (void)arg;
  if (err) FPS_LOG(FPS_LOG_DEBUG, "VERSIONS not delivered: %s", msg ? msg : fps_strerror(err));
}

/* Holds every other block's list and stands at the version they agree
 * on (or no version agrees: announcing again changes nothing until a
 * peer's list changes, and its announcement brings ours). REQUIRES t->mu. */
static bool fps__xrec_done_locked(const fps_tensor_t *t, const fps_xrec_t *r) {
  const fps_tensor_split_t *sp = t->split;
  for (uint32_t b = 0; b < sp->n_blocks; b++)
    if (b != sp->block_index && !r->have[b]) return false;
  return !r->pending;
}

/* Sends this block's list to every other block's shard: on its own
 * initiative (announce), or to answer a peer's list (answer). A block
 * whose state came in a standby's image and has not stepped since sends
 * none on its own: its peers may be one step ahead (the step its primary
 * died in), and the workers' retry lets it complete that step with them
 * (xstep.c, fps_xreply_t); a list would make the blocks agree on an older
 * anchor instead. It still answers a peer that asks (a peer in recovery
 * needs every list). */
static void fps__xrec_send_list(fps_shard_t *sh, fps_tensor_t *t, bool answer) {
  if (!t->split || !sh->xsend) return;
  int64_t now = fps_now_ns();
  int64_t window = (int64_t)((sh->xdeadline > 0 ? sh->xdeadline : 10.0) * 1e9);
  uint64_t v[FPS_XVERSIONS_MAX];
  pthread_mutex_lock(&t->mu);
  if (!answer && t->split->mail && t->split->mail->imaged) {
    pthread_mutex_unlock(&t->mu);
    return;
  }
  fps_xrec_t *r = t->ready ? fps__xrec_get(t) : NULL;
  if (r && !fps__xrec_done_locked(t, r)) fps__xrec_set_apart(sh, r, true);
  if (!r || (r->announced_ns && now - r->announced_ns < window)) {
    pthread_mutex_unlock(&t->mu);
    return;
  }
  r->announced_ns = now;
  unsigned n = fps__own_list(t, r, v);
  /* Taken with the list, under t->mu: a step message this shard sends
   * after it has a newer stamp (see STAMPS above). */
  uint64_t stamp = fps__xrec_stamp(sh);
  pthread_mutex_unlock(&t->mu);
  uint8_t wire[FPS_XVERSIONS_MAX * 8];
  for (unsigned i = 0; i < n; i++)
    for (int b = 0; b < 8; b++) wire[i * 8 + b] = (uint8_t)(v[i] >> (8 * b));
  const fps_tensor_split_t *sp = t->split; /* the map is fixed */
  FPS_LOG(FPS_LOG_DEBUG, "tensor '%s': block %u at version %" PRIu64 " sends the versions it can go to", t->name,
          sp->block_index, v[0]);
  for (uint32_t b = 0; b < sp->n_blocks; b++) {
    if (b == sp->block_index) continue;
    fps_xmsg_t m = {.name = t->name, .version = v[0], .from_shard = sh->cfg.shard_id,
                    .shard_count = sh->cfg.shard_count, .block_index = sp->block_index,
                    .phase = FPS_XPHASE_VERSIONS, .attempt = 0, .partials = wire, .len = (size_t)n * 8,
                    .stamp = stamp};
    sh->xsend(sh->xsend_ctx, sp->block_shards[b], &m, fps_clock_after(now, sh->xdeadline > 0 ? sh->xdeadline : 10.0),
              fps__xrec_sent, NULL);
  }
}

void fps__xrec_announce(fps_shard_t *sh, fps_tensor_t *t) { fps__xrec_send_list(sh, t, false); }

/* "tensor 'x': its blocks stand at different versions ..." with every
 * block's list. REQUIRES t->mu and every list held. */
static void fps__xrec_apart_text(const fps_tensor_t *t, const fps_xrec_t *r, char *buf, size_t len) {
  const fps_tensor_split_t *sp = t->split;
  uint64_t own[FPS_XVERSIONS_MAX];
  char one[256];
  fps__list_text(own, fps__own_list(t, r, own), one, sizeof one);
  size_t k = (size_t)snprintf(buf, len,
                              "tensor '%s': its blocks stand at different versions and no version is held by every "
                              "block (this block %s",
                              t->name, one);
  for (uint32_t b = 0; b < sp->n_blocks && k < len; b++) {
    if (b == sp->block_index) continue;
    fps__list_text(&r->list[(size_t)b * FPS_XVERSIONS_MAX], r->nlist[b], one, sizeof one);
    k += (size_t)snprintf(buf + k, len - k, ", shard %u %s", sp->block_shards[b], one);
  }
  if (k < len)
    snprintf(buf + k, len - k,
             "): its steps are refused until it is created again or restored from a job checkpoint "
             "(--split-anchor-steps keeps versions to agree on)");
}

/* With every other block's list here: the newest version in all of them,
 * set as the pending target if t is not at it. REQUIRES t->mu. */
static void fps__xrec_agree_locked(fps_shard_t *sh, fps_tensor_t *t, fps_xrec_t *r) {
  const fps_tensor_split_t *sp = t->split;
  for (uint32_t b = 0; b < sp->n_blocks; b++)
    if (b != sp->block_index && !r->have[b]) return;
  uint64_t own[FPS_XVERSIONS_MAX];
  unsigned n = fps__own_list(t, r, own);
  bool found = false;
  uint64_t target = 0;
  for (unsigned i = 0; i < n; i++) {
    bool everywhere = true;
    for (uint32_t b = 0; everywhere && b < sp->n_blocks; b++) {
      if (b == sp->block_index) continue;
      bool in = false;
      for (unsigned j = 0; !in && j < r->nlist[b]; j++) in = r->list[(size_t)b * FPS_XVERSIONS_MAX + j] == own[i];
      everywhere = in;
    }
    if (everywhere && (!found || own[i] > target)) {
      found = true;
      target = own[i];
    }
  }
  if (!found) {
    if (!r->unagreeable) {
      r->unagreeable = true;
      char text[1024];
      fps__xrec_apart_text(t, r, text, sizeof text);
      FPS_LOG(FPS_LOG_ERROR, "%s", text);
    }
    fps__xrec_set_apart(sh, r, false);
    return;
  }
  r->unagreeable = false;
  if (target == t->version) {
    if (r->pending) atomic_fetch_sub(&sh->xrec_pending, 1);
    r->pending = false;
    fps__xrec_set_apart(sh, r, false);
    return;
  }
  if (!r->pending) atomic_fetch_add(&sh->xrec_pending, 1);
  r->pending = true;
  r->target = target;
}

/* Moves t to its pending target from the target's anchor once no round of
 * it is open or exchanging. No lock held. */
static void fps__xrec_move(fps_shard_t *sh, fps_tensor_t *t) {
  fps_tensor_split_t *sp = t->split;
  pthread_mutex_lock(&t->mu);
  fps_xrec_t *r = sp->rec;
  if (!r || !r->pending || t->round.open || t->round.settling || sp->xs) {
    pthread_mutex_unlock(&t->mu);
    return;
  }
  uint64_t target = r->target;
  char path[FPS_CKPT_PATH_MAX] = "";
  for (unsigned i = 0; i < r->nanchor; i++)
    if (r->anchor[i] == target) snprintf(path, sizeof path, "%s", r->path[i]);
  pthread_mutex_unlock(&t->mu);
  char why[FPS_CKPT_WHY_MAX] = "not among this block's anchors";
  fps_ckpt_expect_t ex = {.shard_id = sh->cfg.shard_id, .shard_count = sh->cfg.shard_count,
                          .mode = fps_mode_name(sh->cfg.mode)};
  fps_ckpt_t *ck = NULL;
  fps_ckpt_tensor_t *ct = NULL;
  int rc = *path ? fps_ckpt_load_file(path, &ex, &ck, why, sizeof why) : FPS_ENOTFOUND;
  if (rc == 0 && (!(ct = fps__anchor_find(ck, t)) || ct->version != target)) {
    snprintf(why, sizeof why, "the file holds no block of this tensor at that version");
    rc = FPS_EFORMAT;
  }
  bool over = false;
  pthread_mutex_lock(&t->mu);
  fps_snap_t *nb = rc == 0 ? fps__pbuf_new_staged(sh, t, &over) : NULL;
  if (rc == 0 && !nb) {
    snprintf(why, sizeof why, "%s", over ? "over --max-staging-bytes" : "out of memory");
    rc = FPS_ENOMEM;
  }
  if (rc < 0 || !r->pending || r->target != target || t->round.open || t->round.settling || sp->xs) {
    if (rc < 0 && r->pending && r->target == target) {
      /* Not retried: the other blocks may move once more (their lists
       * change), else this stays logged. */
      fps__xrec_reset(sh, r, sp->n_blocks);
      FPS_LOG(FPS_LOG_ERROR, "tensor '%s': cannot move block %u to the agreed version %" PRIu64 " (%s): %s",
              t->name, sp->block_index, target, path, why);
    }
    if (nb) fps__pbuf_retire(sh, t, nb);
    pthread_mutex_unlock(&t->mu);
    fps_ckpt_destroy(ck);
    return;
  }
  memcpy(nb->data, ct->param, sp->g.block_numel * sizeof(float));
  fps_snap_t *old = t->pbuf;
  t->pbuf = nb;
  t->param = nb->data;
  fps__pbuf_publish(sh, nb);
  fps_split_state_t old_st = sp->st;
  sp->st = ct->bstate;
  memset(&ct->bstate, 0, sizeof ct->bstate);
  uint64_t from = t->version;
  t->version = target;
  t->pbuf->version = target;
  t->round.step = target;
  t->last_lr = ct->last_lr;
  t->last_weight_decay = ct->last_weight_decay;
  t->log_len = t->log_head = 0; /* its apply log was of the other history */
  fps__tbuf_drop_spare(sh, t);
  fps__pbuf_retire(sh, t, old);
  fps__xmail_reset(sp);
  uint64_t lost = from > target ? from - target : 0;
  if (lost) fps__idem_forget_after(&sh->idem, target);
  r->recoveries++;
  r->lost_steps += lost;
  r->last_from = from;
  r->last_to = target;
  uint64_t total = r->lost_steps;
  fps__xrec_reset(sh, r, sp->n_blocks);
  atomic_fetch_add(&sh->changes, 1); /* the next checkpoint holds it */
  pthread_mutex_unlock(&t->mu);
  fps_split_state_destroy(&old_st);
  fps_ckpt_destroy(ck);
  fps_metrics_split_recovered(lost);
  FPS_LOG(FPS_LOG_WARN,
          "tensor '%s': its blocks agreed on version %" PRIu64 ", the newest every block holds: block %u went "
          "from version %" PRIu64 " to it (anchor %s); %" PRIu64 " update%s of this block undone (%" PRIu64
          " in total)",
          t->name, target, sp->block_index, from, path, lost, lost == 1 ? "" : "s", total);
  /* The others may have decided from other lists (one changed on its
   * way): this block's new list makes every block check again, and it
   * announces until it holds every list at the version they agree on. */
  fps__xrec_announce(sh, t);
}

int fps__xrec_receive(fps_shard_t *sh, fps_tensor_t *t, const fps_xmsg_t *m, char *why, size_t wl) {
  const uint8_t *p = m->partials;
  unsigned n = (unsigned)(m->len / 8);
  uint64_t v[FPS_XVERSIONS_MAX];
  for (unsigned i = 0; i < n; i++) {
    v[i] = 0;
    for (int b = 0; b < 8; b++) v[i] |= (uint64_t)p[i * 8 + b] << (8 * b);
  }
  pthread_mutex_lock(&t->mu);
  if (!t->ready) {
    pthread_mutex_unlock(&t->mu);
    snprintf(why, wl, "Exchange of tensor '%s' from shard %u: this shard's block is still initialising", t->name,
             m->from_shard);
    return FPS_ESTATE;
  }
  fps_xrec_t *r = fps__xrec_get(t);
  if (!r) {
    pthread_mutex_unlock(&t->mu);
    snprintf(why, wl, "Exchange of tensor '%s': out of memory keeping a peer's versions", t->name);
    return FPS_ENOMEM;
  }
  uint32_t b = m->block_index;
  uint64_t stamp = m->stamp ? fps__stamp_bounded(m->stamp) : 0;
  if (stamp && (stamp < r->step_stamp[b] || (r->have[b] && stamp < r->list_stamp[b]))) {
    /* Made before that block's latest step message or list: out of date
     * (STAMPS above). Acknowledged: a resend would be as old. */
    pthread_mutex_unlock(&t->mu);
    FPS_LOG(FPS_LOG_DEBUG, "tensor '%s': an out-of-date list of versions from shard %u ignored", t->name,
            m->from_shard);
    return 0;
  }
  bool knew = r->have[b];
  r->list_stamp[b] = stamp;
  memcpy(&r->list[(size_t)b * FPS_XVERSIONS_MAX], v, n * sizeof v[0]);
  r->nlist[b] = n;
  r->have[b] = true;
  fps__xrec_agree_locked(sh, t, r);
  bool pending = r->pending;
  if (!knew) r->announced_ns = 0; /* a peer that does not know ours yet */
  pthread_mutex_unlock(&t->mu);
  fps__xrec_send_list(sh, t, true);
  if (pending) fps__xrec_move(sh, t);
  return 0;
}

void fps__xrec_tick(fps_shard_t *sh) {
  pthread_rwlock_rdlock(&sh->store.mu);
  for (fps_tensor_t *t = sh->store.first; t; t = t->next) {
    if (!t->split) continue;
    fps__xrec_move(sh, t);
    pthread_mutex_lock(&t->mu);
    const fps_xrec_t *r = t->split->rec;
    bool again = r && r->apart;
    pthread_mutex_unlock(&t->mu);
    if (again) fps__xrec_announce(sh, t); /* once per exchange deadline */
  }
  pthread_rwlock_unlock(&sh->store.mu);
}

void fps_shard_recover_start(fps_shard_t *sh) {
  pthread_rwlock_rdlock(&sh->store.mu);
  for (fps_tensor_t *t = sh->store.first; t; t = t->next)
    if (t->split) fps__xrec_announce(sh, t);
  pthread_rwlock_unlock(&sh->store.mu);
}

void fps__xrec_hint(const fps_tensor_t *t, char *buf, size_t len) {
  const fps_xrec_t *r = t->split ? t->split->rec : NULL;
  size_t n = strlen(buf);
  if (!r || !r->recoveries || n + 1 >= len) return;
  snprintf(buf + n, len - n,
           "; the split tensor's blocks agreed on version %" PRIu64 " (this block came from version %" PRIu64
           ", %" PRIu64 " update%s undone in total): pull it, take its version as the step and push again",
           r->last_to, r->last_from, r->lost_steps, r->lost_steps == 1 ? "" : "s");
}

bool fps__xrec_refuse(const fps_tensor_t *t, char *why, size_t len) {
  const fps_xrec_t *r = t->split ? t->split->rec : NULL;
  if (!r || !r->unagreeable) return false;
  fps__xrec_apart_text(t, r, why, len);
  return true;
}

uint64_t fps__xrec_lost_steps(const fps_tensor_t *t) {
  return t->split && t->split->rec ? t->split->rec->lost_steps : 0;
}
