/* Create's rules: tensors are registered idempotently (create-or-match)
 * and get their initial values from sliced init data, possibly over many
 * calls, until every element is covered (init coverage).
 *
 * The whole request is validated before anything changes (phase 1), under
 * the store's write lock, so a failed Create leaves the shard exactly as it
 * was; phase 2 allocates, inserts and writes. Create is a set-up call, so
 * holding the write lock for its duration costs nothing that matters. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "metrics.h"
#include "shard.h"

/* Per request item. Items naming the same tensor form a group led by the
 * first of them, which owns the group's plan. */
typedef struct fps_plan_s {
  const fps_create_item_t *it;
  fps_shape_t shape;
  uint64_t numel;
  size_t lead;                 /* index of the group's first item */
  fps_tensor_t *t;             /* existing tensor (lead), or the new one */
  bool is_new;                 /* lead: tensor created by this call */
  bool was_ready;              /* lead: tensor ready before this call */
  fps_ranges_t ranges;         /* lead: initialised ranges after this call */
  uint64_t off, count;         /* this item's init slice */
} fps_plan_t;

static int fps__cmp_item(const void *a, const void *b, void *arg) {
  const fps_create_item_t *items = arg;
  size_t i = *(const size_t *)a, j = *(const size_t *)b;
  int c = strcmp(items[i].name ? items[i].name : "", items[j].name ? items[j].name : "");
  if (c) return c;
  return i < j ? -1 : i > j;
}

/* Phase 1 for item i. Returns 0 or FPS_E* and fills why. */
static int fps__create_check(fps_shard_t *sh, fps_plan_t *p, size_t i, char *why, size_t wl) {
  fps_plan_t *it = &p[i];
  const fps_create_item_t *tc = it->it;
  const char *name = tc->name ? tc->name : "";
  int rc;
  if ((rc = fps_shard_name_check(name, why, wl)) < 0) return rc;
  if ((rc = fps_shard_shape_check(name, tc->dims, tc->ndim, &it->shape, &it->numel, why, wl)) < 0) return rc;

  fps_plan_t *lead = &p[it->lead];
  /* What this item must agree with: the existing tensor, or the group's
   * first item. */
  const fps_shape_t *want_shape = NULL;
  const fps_adafactor_hparams_t *want_hp = NULL;
  if (it->lead == i) {
    it->t = fps__store_find_locked(&sh->store, name, strlen(name));
    if (it->t) {
      want_shape = &it->t->shape;
      want_hp = &it->t->hp;
    }
  } else {
    want_shape = &lead->shape;
    want_hp = &lead->it->hp;
  }
  if (want_shape) {
    if (!fps_shape_equal(want_shape, &it->shape)) {
      char a[256], b[256];
      fps_shape_format(want_shape, a, sizeof a);
      fps_shape_format(&it->shape, b, sizeof b);
      snprintf(why, wl,
               "tensor '%s' already exists with shape %s, not %s: a tensor's shape (and with it whether its "
               "optimizer state is factored) is fixed when it is first created",
               name, a, b);
      return FPS_EEXISTS;
    }
    char d[256] = "";
    /* lr and weight_decay may differ: a schedule changes them, and they
     * travel with each push (TensorPush); the existing tensor keeps its
     * first Create's values as the defaults. */
    if (fps_adafactor_hparams_diff_fixed(want_hp, &tc->hp, d, sizeof d) != 0) {
      snprintf(why, wl,
               "tensor '%s' already exists with different optimizer settings: %s (existing vs requested); "
               "the flavor and every setting but lr and weight_decay are fixed when a tensor is first created "
               "(its optimizer state was built for them); lr and weight_decay may change per push",
               name, d);
      return FPS_EEXISTS;
    }
  }
  if (it->lead == i) {
    if (it->t) {
      pthread_mutex_lock(&it->t->mu);
      it->was_ready = it->t->ready;
      rc = it->was_ready ? 0 : fps_ranges_copy(&it->ranges, &it->t->init);
      pthread_mutex_unlock(&it->t->mu);
      if (rc < 0) {
        snprintf(why, wl, "tensor '%s': out of memory", name);
        return FPS_ENOMEM;
      }
    } else {
      it->is_new = true;
    }
  }

  const fps_slice_t *s = tc->init;
  if (!s) return 0;
  if ((rc = fps_shard_slice_check(name, s, &it->shape, it->numel, false, &it->count, why, wl)) < 0) return rc;
  it->off = s->offset;
  if (lead->was_ready) {
    it->count = 0; /* the first values win: ignored */
    return 0;
  }
  uint64_t bad = fps_shard_first_nonfinite(s->dtype, s->data, it->count);
  if (bad < it->count) {
    snprintf(why, wl, "tensor '%s': initial value at element %" PRIu64 " is NaN or Inf", name, it->off + bad);
    return FPS_EINVAL;
  }
  rc = fps_ranges_add(&lead->ranges, it->off, it->off + it->count);
  if (rc == FPS_EEXISTS) {
    snprintf(why, wl,
             "tensor '%s': init slice [%" PRIu64 ", %" PRIu64 ") overlaps elements that are already initialised",
             name, it->off, it->off + it->count);
    return FPS_EINVAL;
  }
  if (rc < 0) {
    snprintf(why, wl, "tensor '%s': out of memory", name);
    return FPS_ENOMEM;
  }
  return 0;
}

int fps_shard_create(fps_shard_t *sh, uint32_t shard_id, uint32_t shard_count, const fps_create_item_t *items,
                     size_t n, fps_create_info_t *out, uint64_t *received_out, char *why, size_t wl) {
  int rc = 0;
  fps_plan_t *p = calloc(n ? n : 1, sizeof *p);
  size_t *order = calloc(n ? n : 1, sizeof *order);
  bool locked = false;
  *received_out = 0;
  if (!p || !order) {
    rc = FPS_ENOMEM;
    snprintf(why, wl, "Create: out of memory for %zu tensors", n);
    goto done;
  }
  if (shard_id != sh->cfg.shard_id || shard_count != sh->cfg.shard_count) {
    rc = FPS_ESTATE;
    snprintf(why, wl,
             "Create: the client placed these tensors on shard %u of %u, but this is shard %u of %u "
             "(check the client's shard list)",
             shard_id, shard_count, sh->cfg.shard_id, sh->cfg.shard_count);
    goto done;
  }
  /* Group items by name: sort indices, the first of each run leads. */
  for (size_t i = 0; i < n; i++) {
    order[i] = i;
    p[i].it = &items[i];
  }
  qsort_r(order, n, sizeof *order, fps__cmp_item, (void *)items);
  for (size_t k = 0; k < n; k++) {
    size_t i = order[k];
    bool same = k > 0 && !strcmp(items[order[k - 1]].name ? items[order[k - 1]].name : "",
                                 items[i].name ? items[i].name : "");
    p[i].lead = same ? p[order[k - 1]].lead : i;
  }

  pthread_rwlock_wrlock(&sh->store.mu);
  locked = true;
  uint64_t new_count = 0, new_bytes = 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    rc = fps__create_check(sh, p, i, why, wl);
    if (rc == 0 && p[i].lead == i && p[i].is_new) {
      new_count++;
      new_bytes += p[i].numel * 4;
    }
  }
  if (rc < 0) goto done;
  if (sh->store.count + new_count > sh->cfg.max_tensors) {
    rc = FPS_ELIMIT;
    snprintf(why, wl, "Create: %" PRIu64 " new tensors would exceed this shard's limit of %" PRIu64
             " tensors (--max-tensors)", new_count, sh->cfg.max_tensors);
    goto done;
  }
  if (sh->store.param_bytes + new_bytes > sh->cfg.max_bytes) {
    rc = FPS_ELIMIT;
    snprintf(why, wl, "Create: %" PRIu64 " new parameter bytes would exceed this shard's limit of %" PRIu64
             " bytes (--max-bytes; %" PRIu64 " in use)", new_bytes, sh->cfg.max_bytes, sh->store.param_bytes);
    goto done;
  }

  /* Phase 2: allocate every new tensor before touching the map. */
  for (size_t i = 0; i < n; i++) {
    if (p[i].lead != i || !p[i].is_new) continue;
    const char *name = items[i].name;
    p[i].t = fps_tensor_create(name, strlen(name), &p[i].shape, p[i].numel, &items[i].hp, sh->cfg.workers,
                               sh->cfg.apply_log);
    if (!p[i].t) {
      rc = FPS_ENOMEM;
      snprintf(why, wl, "tensor '%s': out of memory allocating %" PRIu64 " parameters", name, p[i].numel);
      break;
    }
  }
  if (rc == 0 && fps__store_reserve_locked(&sh->store, sh->store.count + new_count) < 0) {
    rc = FPS_ENOMEM;
    snprintf(why, wl, "Create: out of memory growing the tensor map");
  }
  if (rc < 0) {
    for (size_t i = 0; i < n; i++)
      if (p[i].lead == i && p[i].is_new) {
        fps_tensor_destroy(p[i].t);
        p[i].t = NULL;
      }
    goto done;
  }
  for (size_t i = 0; i < n; i++)
    if (p[i].lead == i && p[i].is_new) fps__store_insert_locked(&sh->store, p[i].t);
  /* Write the initial values, then publish each group's coverage. */
  uint64_t received = 0;
  for (size_t i = 0; i < n; i++) {
    fps_plan_t *lead = &p[p[i].lead];
    if (p[i].count == 0 || lead->was_ready) continue;
    const fps_slice_t *s = items[i].init;
    pthread_mutex_lock(&lead->t->mu);
    fps_dtype_decode(s->dtype, s->data, p[i].count, lead->t->param + p[i].off, NULL);
    pthread_mutex_unlock(&lead->t->mu);
    received += s->len;
  }
  atomic_fetch_add(&sh->counters.bytes_received, received);
  *received_out = received;
  for (size_t i = 0; i < n; i++) {
    if (p[i].lead != i || p[i].was_ready) continue;
    fps_tensor_t *t = p[i].t;
    pthread_mutex_lock(&t->mu);
    fps_ranges_free(&t->init);
    t->init = p[i].ranges;
    memset(&p[i].ranges, 0, sizeof p[i].ranges);
    if (t->init.covered == t->numel) {
      t->ready = true;
      fps_ranges_free(&t->init);
      FPS_SLOG(FPS_LOG_DEBUG, "tensor '%s' is ready", t->name);
    }
    pthread_mutex_unlock(&t->mu);
  }
  for (size_t i = 0; i < n; i++) {
    fps_plan_t *lead = &p[p[i].lead];
    fps_tensor_t *t = lead->t;
    fps_create_info_t *o = &out[i];
    o->t = t;
    pthread_mutex_lock(&t->mu);
    o->version = t->version;
    o->ready = t->ready;
    o->initialised = t->ready ? t->numel : t->init.covered;
    pthread_mutex_unlock(&t->mu);
    o->created = lead->is_new && p[i].lead == i;
  }

done:
  if (locked) pthread_rwlock_unlock(&sh->store.mu);
  if (p)
    for (size_t i = 0; i < n; i++) fps_ranges_free(&p[i].ranges);
  free(p);
  free(order);
  return rc;
}
