/* Durable checkpoints of the shard (the file format, writer and loader are
 * common/checkpoint.h; this file decides when and what).
 *
 * Writing: every ready tensor is added to a snapshot (its copy buffers
 * allocated and pre-faulted without any tensor lock), then copied under its
 * own lock (memcpy only), then the snapshot is hashed and written outside
 * every lock. A push to a tensor therefore waits at most for one tensor's
 * memcpy. In sync mode a round is applied atomically under the tensor lock,
 * so no tensor is captured half-updated; different tensors are copied one
 * after another, each with its own version recorded.
 *
 * Restoring: at start-up, before the gRPC port is bound, the newest
 * checkpoint that verifies completely (both SHA-256s, every bound) and was
 * written for this shard's id, count, mode and job (--job-id, when given;
 * job.c) is loaded; the library logs and skips every other one. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.h"
#include "alloc.h"
#include "metrics.h"
#include "internal.h"

/* The checkpoint's "created" (RFC 3339 UTC, "2026-01-02T03:04:05.123456789Z")
 * as unix seconds; 0 if it does not parse. */
static double fps__ckpt_created_unix(const char *created) {
  struct tm tm;
  memset(&tm, 0, sizeof tm);
  char frac[16] = "";
  if (sscanf(created, "%4d-%2d-%2dT%2d:%2d:%2d.%15[0-9]", &tm.tm_year, &tm.tm_mon, &tm.tm_mday, &tm.tm_hour,
             &tm.tm_min, &tm.tm_sec, frac) < 6)
    return 0;
  tm.tm_year -= 1900;
  tm.tm_mon -= 1;
  time_t t = timegm(&tm);
  if (t == (time_t)-1) return 0;
  char num[20] = "0.";
  snprintf(num + 2, sizeof num - 2, "%s", frac);
  return (double)t + strtod(num, NULL);
}

/* The metrics reason of a failed fps_checkpoint_write(). `why` holds the
 * system's message (strerror) for FPS_EIO. */
static fps_metrics_ckpt_reason_t fps__ckpt_reason(int rc, const char *why) {
  switch (rc) {
    case FPS_EIO:
      return strstr(why, strerror(ENOSPC)) || strstr(why, strerror(EDQUOT)) ? FPS_METRICS_CKPT_NO_SPACE
                                                                             : FPS_METRICS_CKPT_IO;
    case FPS_ENOMEM: return FPS_METRICS_CKPT_NO_MEMORY;
    case FPS_ENOTFOUND: return FPS_METRICS_CKPT_NO_DIRECTORY;
    case FPS_EAGAIN: return FPS_METRICS_CKPT_BUSY;
    default: return FPS_METRICS_CKPT_OTHER;
  }
}

/* A file the shard cannot load (another mode, shard id or count, another
 * job; damaged) is moved into <dir>/unloaded/ rather than left where
 * pruning would delete it after --checkpoint-keep writes: one restart
 * with a wrong flag must not destroy the trained state. It can be moved
 * back by hand. I/O errors (EIO) say nothing about the file: it stays. */
static void fps__ckpt_rejected(void *ctx, const char *path, int err, const char *why) {
  fps_shard_t *sh = ctx;
  FPS_LOG(FPS_LOG_WARN, "checkpoint %s skipped (%s): %s; trying the previous one", path, fps_err_name(err),
           why);
  if (err != FPS_EFORMAT && err != FPS_ESTATE) return;
  const char *base = strrchr(path, '/');
  base = base ? base + 1 : path;
  char aside[FPS_CKPT_PATH_MAX + 16], to[FPS_CKPT_PATH_MAX + 320];
  snprintf(aside, sizeof aside, "%s/unloaded", sh->cfg.checkpoint_dir);
  if (mkdir(aside, 0700) < 0 && errno != EEXIST) {
    FPS_LOG(FPS_LOG_WARN, "cannot move %s to %s/ (%s): pruning may delete it", path, aside, strerror(errno));
    return;
  }
  /* Never over a file set aside before (another restart's, under the same
   * name: the shard numbers its files from 1 again in an emptied
   * directory): ckpt-00000001-2.safetensors and so on. The directory lock
   * keeps other shards out, so a name seen free stays free. */
  const char *ext = strrchr(base, '.');
  int stem = ext ? (int)(ext - base) : (int)strlen(base);
  struct stat st;
  snprintf(to, sizeof to, "%s/%s", aside, base);
  for (unsigned k = 2; lstat(to, &st) == 0 && k < 100000; k++)
    snprintf(to, sizeof to, "%s/%.*s-%u%s", aside, stem, base, k, ext ? ext : "");
  bool taken = lstat(to, &st) == 0;
  if (taken) errno = EEXIST;
  if (taken || rename(path, to) < 0) {
    FPS_LOG(FPS_LOG_WARN, "cannot move %s to %s/ (%s): pruning may delete it", path, aside, strerror(errno));
    return;
  }
  fps_metrics_checkpoint_set_aside();
  FPS_LOG(FPS_LOG_WARN, "moved %s to %s (this shard cannot load it; it is never pruned there)", path, to);
}

/* A borrowed parameter buffer (fps_ckpt_snapshot_borrow_params) goes. */
static void fps__ckpt_params_release(void *ref) { fps_snap_unref(ref); }

/* A row block of the checkpoint as a block tensor (t->split), its map
 * checked against this shard as a Create's would be. */
static int fps__ckpt_block_tensor(fps_shard_t *sh, const fps_ckpt_t *ck, fps_ckpt_tensor_t *ct,
                                  fps_tensor_t **out) {
  char why[FPS_CKPT_WHY_MAX] = "";
  const fps_ckpt_block_t *b = &ct->block;
  fps_split_map_t map = {.block_index = b->block_index, .bounds = b->bounds, .n_bounds = (size_t)b->n_blocks + 1,
                         .block_shards = b->block_shards, .n_block_shards = b->n_blocks,
                         .shard_count = b->shard_count};
  int rc = fps_shard_split_check(ct->name, &ct->bstate.g.shape, &map, sh->cfg.shard_id, sh->cfg.shard_count,
                                 NULL, NULL, why, sizeof why);
  if (rc == 0) rc = fps_shard_split_allowed(sh, ct->name, why, sizeof why);
  if (rc < 0) {
    FPS_LOG(FPS_LOG_ERROR, "checkpoint %s holds a row block this shard cannot serve: %s", ck->path, why);
    return rc;
  }
  fps_tensor_t *t = fps_tensor_create_split(ct->name, strlen(ct->name), &ct->bstate.g, &map, &ct->hparams,
                                            sh->cfg.workers, sh->cfg.apply_log);
  if (!t) return FPS_ENOMEM;
  /* As for a whole tensor below: take the loaded arrays. */
  fps_free(t->pbuf->data);
  t->param = t->pbuf->data = ct->param;
  ct->param = NULL;
  fps_split_state_destroy(&t->split->st);
  t->split->st = ct->bstate;
  memset(&ct->bstate, 0, sizeof ct->bstate);
  *out = t;
  return 0;
}

/* Moves one loaded tensor into the store. REQUIRES store->mu for writing. */
static int fps__ckpt_adopt_locked(fps_shard_t *sh, const fps_ckpt_t *ck, fps_ckpt_tensor_t *ct) {
  fps_tensor_t *t = NULL;
  if (ct->block.n_blocks) {
    int rc = fps__ckpt_block_tensor(sh, ck, ct, &t);
    if (rc < 0) return rc;
  } else {
    t = fps_tensor_create(ct->name, strlen(ct->name), &ct->state.shape, ct->state.numel, &ct->hparams,
                          sh->cfg.workers, sh->cfg.apply_log);
    if (!t) return FPS_ENOMEM;
    /* Take the loaded arrays instead of copying them: the tensor's own
     * param buffer and zeroed state are released, the checkpoint's fields
     * are zeroed so fps_ckpt_destroy() leaves them alone. The tensor is
     * new (nobody holds its buffer): its data may be swapped. */
    fps_free(t->pbuf->data);
    t->param = t->pbuf->data = ct->param;
    ct->param = NULL;
    fps_adafactor_state_destroy(&t->st);
    t->st = ct->state;
    memset(&ct->state, 0, sizeof ct->state);
  }
  t->ready = true;
  t->version = ct->version;
  t->pbuf->version = t->version;
  t->last_lr = ct->last_lr;
  t->last_weight_decay = ct->last_weight_decay;
  t->restored_seq = ck->info.seq;
  t->restored_version = ct->version;
  t->round.step = t->version;
  int rc = fps__store_insert_locked(&sh->store, t);
  if (rc < 0) fps_tensor_destroy(t);
  return rc;
}

static int fps__ckpt_restore(fps_shard_t *sh) {
  fps_ckpt_expect_t ex = {.shard_id = sh->cfg.shard_id, .shard_count = sh->cfg.shard_count,
                          .mode = fps_mode_name(sh->cfg.mode), .job_id = sh->cfg.job_id};
  fps_ckpt_t *ck = NULL;
  int64_t t0 = fps_now_ns();
  int rc = fps_ckpt_load_newest(sh->cfg.checkpoint_dir, &ex, fps__ckpt_rejected, sh, &ck);
  if (rc == FPS_ENOTFOUND || rc == FPS_EFORMAT) {
    const char *what = rc == FPS_ENOTFOUND ? "holds no checkpoint" : "holds no valid checkpoint";
    if (sh->cfg.require_checkpoint) {
      FPS_LOG(FPS_LOG_ERROR, "--checkpoint-dir %s %s and --require-checkpoint is set: refusing to start",
               sh->cfg.checkpoint_dir, what);
      fps_metrics_restore_set(FPS_METRICS_RESTORE_REFUSED, 0, 0, 0);
      return FPS_ENOTFOUND;
    }
    FPS_LOG(FPS_LOG_INFO, "--checkpoint-dir %s %s: starting empty", sh->cfg.checkpoint_dir, what);
    fps_metrics_restore_set(FPS_METRICS_RESTORE_EMPTY, 0, 0, (double)(fps_now_ns() - t0) / 1e9);
    return 0;
  }
  if (rc < 0) {
    FPS_LOG(FPS_LOG_ERROR, "cannot read --checkpoint-dir %s: %s", sh->cfg.checkpoint_dir, fps_strerror(rc));
    fps_metrics_restore_set(FPS_METRICS_RESTORE_REFUSED, 0, 0, 0);
    return rc;
  }
  uint64_t bytes = 0;
  for (size_t i = 0; i < ck->n_tensors; i++)
    bytes += (ck->tensors[i].block.n_blocks ? ck->tensors[i].bstate.g.block_numel : ck->tensors[i].state.numel) * 4;
  if (ck->n_tensors > sh->cfg.max_tensors || bytes > sh->cfg.max_bytes) {
    FPS_LOG(FPS_LOG_ERROR,
             "checkpoint %s holds %zu tensors and %" PRIu64 " parameter bytes, more than --max-tensors %" PRIu64
             " / --max-bytes %" PRIu64 " allow: refusing to start",
             ck->path, ck->n_tensors, bytes, sh->cfg.max_tensors, sh->cfg.max_bytes);
    fps_ckpt_destroy(ck);
    fps_metrics_restore_set(FPS_METRICS_RESTORE_REFUSED, 0, 0, 0);
    return FPS_ELIMIT;
  }
  pthread_rwlock_wrlock(&sh->store.mu);
  rc = fps__store_reserve_locked(&sh->store, ck->n_tensors);
  for (size_t i = 0; rc == 0 && i < ck->n_tensors; i++) rc = fps__ckpt_adopt_locked(sh, ck, &ck->tensors[i]);
  pthread_rwlock_unlock(&sh->store.mu);
  if (rc < 0) {
    FPS_LOG(FPS_LOG_ERROR, "restoring %s: %s", ck->path, fps_strerror(rc));
    fps_ckpt_destroy(ck);
    fps_metrics_restore_set(FPS_METRICS_RESTORE_REFUSED, 0, 0, 0);
    return rc;
  }
  sh->ckpt_restored_seq = ck->info.seq;
  /* The file's job is this shard's from now on (unless --job-id set it). */
  pthread_mutex_lock(&sh->job_mu);
  if (!sh->job_id[0] && ck->info.shard.job_id[0]) {
    snprintf(sh->job_id, sizeof sh->job_id, "%s", ck->info.shard.job_id);
    snprintf(sh->job_from, sizeof sh->job_from, "checkpoint %s", ck->path);
  }
  pthread_mutex_unlock(&sh->job_mu);
  /* Split blocks: the anchors they can move to (xrecover.c). The store
   * is complete; nothing serves yet. */
  for (fps_tensor_t *t = sh->store.first; t; t = t->next)
    if (t->split) fps__xrec_restored(sh, t);
  pthread_mutex_lock(&sh->ckpt_mu);
  sh->ckpt_have_last = true;
  sh->ckpt_last_changes = atomic_load(&sh->changes);
  snprintf(sh->ckpt_last_path, sizeof sh->ckpt_last_path, "%s", ck->path);
  pthread_mutex_unlock(&sh->ckpt_mu);
  fps_metrics_restore_set(FPS_METRICS_RESTORE_RESTORED, ck->info.seq, fps__ckpt_created_unix(ck->info.created),
                          (double)(fps_now_ns() - t0) / 1e9);
  FPS_LOG(FPS_LOG_INFO, "restored %zu tensors (%" PRIu64 " bytes of data) from %s (sequence %" PRIu64
           ", written %s) in %.3f s",
           ck->n_tensors, ck->info.data_bytes, ck->path, ck->info.seq, ck->info.created,
           (double)(fps_now_ns() - t0) / 1e9);
  fps_ckpt_destroy(ck);
  return 0;
}

int fps_checkpoint_open(fps_shard_t *sh) {
  sh->ckpt_dir_fd = -1;
  if (!*sh->cfg.checkpoint_dir) return 0;
  char why[FPS_CKPT_WHY_MAX] = "";
  int fd = fps_ckpt_dir_lock(sh->cfg.checkpoint_dir, true, why, sizeof why);
  if (fd < 0) {
    FPS_LOG(FPS_LOG_ERROR, "--checkpoint-dir %s: %s (%s)", sh->cfg.checkpoint_dir, why, fps_strerror(fd));
    fps_metrics_restore_set(FPS_METRICS_RESTORE_REFUSED, 0, 0, 0);
    return fd;
  }
  sh->ckpt_dir_fd = fd;
  return fps__ckpt_restore(sh);
}

int fps_checkpoint_write(fps_shard_t *sh, fps_ckpt_done_t *out, char *why, size_t why_len) {
  fps_ckpt_done_t done;
  memset(&done, 0, sizeof done);
  if (!*sh->cfg.checkpoint_dir) {
    snprintf(why, why_len, "this shard has no --checkpoint-dir");
    return FPS_ESTATE;
  }
  pthread_mutex_lock(&sh->ckpt_mu);
  int64_t t0 = fps_now_ns();
  uint64_t mark = fps_metrics_checkpoint_mark(); /* before any tensor is copied */
  uint64_t changes = atomic_load(&sh->changes);  /* likewise */
  fps_ckpt_snapshot_t *snap = NULL;
  int rc = fps_ckpt_snapshot_create(&snap, sh->cfg.shard_id, sh->cfg.shard_count, fps_mode_name(sh->cfg.mode));
  if (rc < 0) {
    snprintf(why, why_len, "cannot create a snapshot: %s", fps_strerror(rc));
    goto fail;
  }
  fps_ckpt_snapshot_borrow_params(snap, fps__ckpt_params_release);
  char job[FPS_CKPT_JOB_MAX + 1];
  fps_shard_job_get(sh, job, sizeof job);
  fps_ckpt_snapshot_set_job(snap, job); /* checked when it was set */
  /* The store's read lock only keeps the tensor list still (tensors are
   * never removed); pushes take it for reading too, so they are not held up. */
  pthread_rwlock_rdlock(&sh->store.mu);
  for (fps_tensor_t *t = sh->store.first; t && rc == 0; t = t->next) {
    pthread_mutex_lock(&t->mu);
    bool ready = t->ready;
    pthread_mutex_unlock(&t->mu);
    if (!ready) {
      done.skipped++;
      continue;
    }
    size_t idx = 0;
    /* A row block's map is fixed at Create (internal.h): no lock. */
    const fps_tensor_split_t *sp = t->split;
    if (sp) {
      fps_ckpt_block_t map = {.block_index = sp->block_index, .n_blocks = sp->n_blocks,
                              .bounds = sp->bounds, .block_shards = sp->block_shards,
                              .shard_count = sp->shard_count};
      rc = fps_ckpt_snapshot_add_block(snap, t->name, &t->shape, &t->hp, &map, &idx, why, why_len);
    } else {
      rc = fps_ckpt_snapshot_add(snap, t->name, &t->shape, &t->hp, &idx, why, why_len);
    }
    if (rc < 0) break;
    int64_t h0 = fps_now_ns();
    pthread_mutex_lock(&t->mu);
    /* A block's state changes only when a step applies, under t->mu. */
    /* The published parameters are immutable: referenced, not copied;
     * only the state (changed in place by updates) is copied here. */
    fps_snap_ref(t->pbuf);
    rc = sp ? fps_ckpt_snapshot_copy_block_ref(snap, idx, t->version, t->param, t->pbuf, &sp->st)
            : fps_ckpt_snapshot_copy_ref(snap, idx, t->version, t->param, t->pbuf, &t->st);
    if (rc < 0) fps_snap_unref(t->pbuf); /* not taken (the tensor holds its own) */
    if (rc == 0) rc = fps_ckpt_snapshot_set_applied(snap, idx, t->last_lr, t->last_weight_decay);
    pthread_mutex_unlock(&t->mu);
    double held = (double)(fps_now_ns() - h0) / 1e9;
    if (held > done.max_hold_seconds) done.max_hold_seconds = held;
    if (rc < 0) snprintf(why, why_len, "tensor '%s': cannot copy it: %s", t->name, fps_strerror(rc));
  }
  pthread_rwlock_unlock(&sh->store.mu);
  if (rc < 0) goto fail;
  if (fps_ckpt_snapshot_count(snap) == 0) {
    /* Nothing worth a file: writing one would only prune real checkpoints
     * (e.g. a shard that started empty because it was given the wrong
     * --mode and then got SIGTERM). */
    snprintf(why, why_len, "the shard holds no %stensors to write", done.skipped ? "initialised " : "");
    fps_ckpt_snapshot_destroy(snap);
    pthread_mutex_unlock(&sh->ckpt_mu);
    FPS_LOG(FPS_LOG_INFO, "no checkpoint written: %s", why);
    return FPS_ENOTFOUND;
  }
  done.copy_seconds = (double)(fps_now_ns() - t0) / 1e9;
  fps_ckpt_written_t w;
  rc = fps_ckpt_write(sh->cfg.checkpoint_dir, snap, sh->cfg.checkpoint_keep, &w, why, why_len);
  if (rc < 0) goto fail;
  if (w.prune_err) FPS_LOG(FPS_LOG_WARN, "checkpoint %s written, but pruning old ones stopped: %s", w.path, why);
  snprintf(done.path, sizeof done.path, "%s", w.path);
  done.seq = w.seq;
  done.bytes = w.file_bytes;
  done.tensors = fps_ckpt_snapshot_count(snap);
  done.seconds = (double)(fps_now_ns() - t0) / 1e9;
  {
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    fps_metrics_checkpoint_written(done.seq, (double)now.tv_sec + (double)now.tv_nsec / 1e9, done.seconds,
                                   done.bytes, mark);
  }
  fps_ckpt_snapshot_destroy(snap);
  sh->ckpt_have_last = true;
  sh->ckpt_last_changes = changes;
  snprintf(sh->ckpt_last_path, sizeof sh->ckpt_last_path, "%s", done.path);
  pthread_mutex_unlock(&sh->ckpt_mu);
  FPS_LOG(FPS_LOG_INFO,
           "checkpoint %s: %" PRIu64 " tensors, %" PRIu64 " bytes in %.3f s (%.0f MB/s; copying %.3f s, "
           "longest tensor lock %.6f s)%s",
           done.path, done.tensors, done.bytes, done.seconds,
           done.seconds > 0 ? (double)done.bytes / 1e6 / done.seconds : 0.0, done.copy_seconds,
           done.max_hold_seconds, done.skipped ? "; tensors still initialising were left out" : "");
  if (out) *out = done;
  return 0;
fail:
  fps_metrics_checkpoint_failed(fps__ckpt_reason(rc, why));
  fps_ckpt_snapshot_destroy(snap);
  pthread_mutex_unlock(&sh->ckpt_mu);
  FPS_LOG(FPS_LOG_ERROR, "checkpoint into %s failed: %s (%s)", sh->cfg.checkpoint_dir, why, fps_strerror(rc));
  /* FPS_ENOTFOUND means "nothing to write" to callers (SIGTERM exits 0
   * then): a directory that vanished is an I/O failure. */
  return rc == FPS_ENOTFOUND ? FPS_EIO : rc;
}

bool fps_checkpoint_unchanged(fps_shard_t *sh, const char **path) {
  pthread_mutex_lock(&sh->ckpt_mu);
  struct stat stb;
  bool same = sh->ckpt_have_last && sh->ckpt_last_changes == atomic_load(&sh->changes) &&
              stat(sh->ckpt_last_path, &stb) == 0;
  pthread_mutex_unlock(&sh->ckpt_mu);
  if (path) *path = sh->ckpt_last_path;
  return same;
}

static void *fps__ckpt_thread(void *arg) {
  fps_shard_t *sh = arg;
  pthread_mutex_lock(&sh->ckpt_thread_mu);
  while (!sh->ckpt_thread_stop) {
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    double iv = sh->cfg.checkpoint_interval;
    until.tv_sec += (time_t)iv;
    until.tv_nsec += (long)((iv - (double)(time_t)iv) * 1e9);
    if (until.tv_nsec >= 1000000000L) {
      until.tv_sec++;
      until.tv_nsec -= 1000000000L;
    }
    while (!sh->ckpt_thread_stop &&
           pthread_cond_timedwait(&sh->ckpt_thread_cv, &sh->ckpt_thread_mu, &until) == 0) {
    }
    if (sh->ckpt_thread_stop) break;
    pthread_mutex_unlock(&sh->ckpt_thread_mu);
    /* An idle shard does not rewrite the same state every interval. A
     * failure is logged by fps_checkpoint_write; the next interval tries
     * again (a full disk may clear). */
    if (!fps_checkpoint_unchanged(sh, NULL)) {
      char why[FPS_CKPT_WHY_MAX] = "";
      fps_checkpoint_write(sh, NULL, why, sizeof why);
    }
    pthread_mutex_lock(&sh->ckpt_thread_mu);
  }
  pthread_mutex_unlock(&sh->ckpt_thread_mu);
  return NULL;
}

int fps_checkpoint_start(fps_shard_t *sh) {
  if (!*sh->cfg.checkpoint_dir || sh->cfg.checkpoint_interval <= 0) return 0;
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&sh->ckpt_thread_cv, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&sh->ckpt_thread_mu, NULL);
  sh->ckpt_thread_stop = false;
  if (pthread_create(&sh->ckpt_thread, NULL, fps__ckpt_thread, sh) != 0) {
    pthread_cond_destroy(&sh->ckpt_thread_cv);
    pthread_mutex_destroy(&sh->ckpt_thread_mu);
    return FPS_ENOMEM;
  }
  sh->ckpt_thread_on = true;
  return 0;
}

void fps_checkpoint_stop(fps_shard_t *sh) {
  if (sh->ckpt_thread_on) {
    pthread_mutex_lock(&sh->ckpt_thread_mu);
    sh->ckpt_thread_stop = true;
    pthread_cond_broadcast(&sh->ckpt_thread_cv);
    pthread_mutex_unlock(&sh->ckpt_thread_mu);
    pthread_join(sh->ckpt_thread, NULL);
    pthread_cond_destroy(&sh->ckpt_thread_cv);
    pthread_mutex_destroy(&sh->ckpt_thread_mu);
    sh->ckpt_thread_on = false;
  }
}

void fps_checkpoint_close(fps_shard_t *sh) {
  fps_checkpoint_stop(sh);
  if (sh->ckpt_dir_fd >= 0) {
    close(sh->ckpt_dir_fd);
    sh->ckpt_dir_fd = -1;
  }
}
