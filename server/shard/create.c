/* Create's rules: tensors are registered idempotently (create-or-match)
 * and get their initial values from sliced init data, possibly over many
 * calls, until every element is covered (init coverage).
 *
 * The whole request is validated before anything changes, so a failed
 * Create leaves the shard exactly as it was. No lock is held while the
 * request is checked (NaN scans, slice coverage) or its values copied,
 * except the tensor's own lock for a tensor that already exists:
 *   1. validate against what the store holds now (the store's read lock
 *      for each lookup only, a tensor's lock to copy its coverage);
 *   2. allocate the new tensors and write their values, and stage a
 *      replacement's, all unseen by anyone else;
 *   3. under the store's write lock, pointer work only: no name this call
 *      creates appeared meanwhile, the limits, then lock the existing
 *      tensors this call writes and check that no other Create changed
 *      them since step 1 (init_gen), insert the new tensors;
 *   4. with only those tensors' locks held, write their values.
 * A concurrent Create of the same tensors sends step 3 back to step 1.
 *
 * A row block of a split tensor (item.split, internal.h) goes the same
 * way with its own elements and state sizes (split_block.c: the map's
 * checks, whether this shard holds blocks, matching maps). */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "checkpoint.h"
#include "metrics.h"
#include "internal.h"

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
  /* Resume and replace (lead). */
  fps_state_size_t ssz;        /* the tensor's state sizes */
  fps_ranges_t sranges[FPS_STATE_KINDS]; /* state ranges after this call */
  bool replacing;              /* replaces an existing tensor's values */
  fps_snap_t *new_pbuf;        /* replacing: the new values, staged (a new
                                * buffer: the published one is never written) */
  fps_adafactor_state_t new_st;
  fps_split_state_t new_sst;   /* replacing a block: its new state */
  fps_split_geom_t geom;       /* a split block's rows (item.split) */
  uint64_t gen;                /* lead, existing: its init_gen when checked */
  bool inserted;               /* lead, new: in the store (no longer ours to free) */
  fps_shard_t *sh;             /* replacing: whose staging a retired buffer counts in */
} fps_plan_t;

/* A Create that keeps meeting concurrent Creates of its tensors gives up
 * (UNAVAILABLE: retry) rather than loop. */
#define FPS_CREATE_RETRIES 64

static const char *const fps__kind_name[FPS_STATE_KINDS] = {"row", "col", "var", "mom"};

static uint64_t fps__kind_size(const fps_state_size_t *z, int k) {
  return k == FPS_STATE_ROW ? z->row : k == FPS_STATE_COL ? z->col : k == FPS_STATE_VAR ? z->var : z->mom;
}

/* The state arrays a replacement is staged in (a block's or a whole
 * tensor's). */
static void fps__staged_arrays(const fps_plan_t *lead, float *out[FPS_STATE_KINDS]) {
  const bool b = lead->t->split != NULL;
  out[FPS_STATE_ROW] = b ? lead->new_sst.row : lead->new_st.row;
  out[FPS_STATE_COL] = b ? lead->new_sst.col : lead->new_st.col;
  out[FPS_STATE_VAR] = b ? lead->new_sst.var : lead->new_st.var;
  out[FPS_STATE_MOM] = b ? lead->new_sst.mom : lead->new_st.mom;
}

/* Every state array of the tensor covered? */
static bool fps__state_covered(const fps_state_size_t *z, const fps_ranges_t *r) {
  for (int k = 0; k < FPS_STATE_KINDS; k++)
    if (r[k].covered != fps__kind_size(z, k)) return false;
  return true;
}

/* One state slice of item `name` against the lead's plan. */
static int fps__state_slice_check(const char *name, fps_plan_t *lead, const fps_state_slice_t *ss, char *why,
                                  size_t wl) {
  if (ss->kind < 0 || ss->kind >= FPS_STATE_KINDS) {
    snprintf(why, wl, "tensor '%s': init_state slice has no valid kind (STATE_ROW, STATE_COL, STATE_VAR, STATE_MOM)",
             name);
    return FPS_EINVAL;
  }
  const char *kn = fps__kind_name[ss->kind];
  uint64_t n = fps__kind_size(&lead->ssz, ss->kind);
  if (n == 0) {
    snprintf(why, wl, "tensor '%s' has no %s state (%s)", name, kn,
             ss->kind == FPS_STATE_MOM ? "only hf with beta1 keeps momentum"
             : ss->kind == FPS_STATE_VAR ? "it is factored: row and col"
                                         : "it is not factored: var");
    return FPS_EINVAL;
  }
  if (ss->len % 4) {
    snprintf(why, wl, "tensor '%s': %s state slice is %zu bytes, not a whole number of float32", name, kn, ss->len);
    return FPS_EINVAL;
  }
  uint64_t cnt = ss->len / 4;
  if (ss->offset > n || cnt > n - ss->offset) {
    /* offset + cnt may not fit in 64 bits (a hostile offset): name both. */
    if (ss->offset > UINT64_MAX - cnt)
      snprintf(why, wl, "tensor '%s': %s state slice of %" PRIu64 " elements at offset %" PRIu64
               " is out of range: it has %" PRIu64 " elements", name, kn, cnt, ss->offset, n);
    else
      snprintf(why, wl, "tensor '%s': %s state slice [%" PRIu64 ", %" PRIu64 ") is out of range: it has %" PRIu64
               " elements", name, kn, ss->offset, ss->offset + cnt, n);
    return FPS_EINVAL;
  }
  for (uint64_t j = 0; j < cnt; j++) {
    float v;
    memcpy(&v, ss->data + 4 * j, 4);
    if (!isfinite(v) || (ss->kind != FPS_STATE_MOM && v < 0)) {
      snprintf(why, wl, "tensor '%s': %s state element %" PRIu64 " is %g (%s)", name, kn, ss->offset + j, (double)v,
               isfinite(v) ? "a second moment is never negative" : "NaN or Inf");
      return FPS_EINVAL;
    }
  }
  int rc = fps_ranges_add(&lead->sranges[ss->kind], ss->offset, ss->offset + cnt);
  if (rc == FPS_EEXISTS) {
    snprintf(why, wl, "tensor '%s': %s state slice [%" PRIu64 ", %" PRIu64 ") overlaps state already received", name,
             kn, ss->offset, ss->offset + cnt);
    return FPS_EINVAL;
  }
  if (rc < 0) {
    snprintf(why, wl, "tensor '%s': out of memory", name);
    return FPS_ENOMEM;
  }
  return 0;
}

static int fps__cmp_item(const void *a, const void *b, void *arg) {
  const fps_create_item_t *items = arg;
  size_t i = *(const size_t *)a, j = *(const size_t *)b;
  int c = strcmp(items[i].name ? items[i].name : "", items[j].name ? items[j].name : "");
  if (c) return c;
  return i < j ? -1 : i > j;
}

/* Whether `name` (len bytes) is a tensor of the store or of this call
 * (items sorted by name in order[0..n)). REQUIRES: the store's lock. */
static bool fps__name_taken_locked(fps_shard_t *sh, const fps_create_item_t *items, const size_t *order, size_t n,
                                   const char *name, size_t len) {
  if (fps__store_find_locked(&sh->store, name, len)) return true;
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    const char *m = items[order[mid]].name ? items[order[mid]].name : "";
    int c = strncmp(m, name, len);
    if (c == 0 && m[len] != '\0') c = 1; /* m is longer: after name */
    if (c == 0) return true;
    if (c < 0) lo = mid + 1;
    else hi = mid;
  }
  return false;
}

/* A new tensor's name must leave the checkpoint's keys distinct: not
 * safetensors' "__metadata__", and not "x/row" beside "x" (the keys of x's
 * state arrays are "x/row", "x/col", "x/var", "x/mom"), either way round,
 * among the tensors held and those of this call. Otherwise every
 * checkpoint after this Create would fail, SIGTERM's included.
 * REQUIRES: the store's lock. */
static int fps__name_collision_locked(fps_shard_t *sh, const fps_create_item_t *items, const size_t *order,
                                      size_t n, const char *name, char *why, size_t wl) {
  if (!strcmp(name, "__metadata__")) {
    snprintf(why, wl, "tensor '__metadata__': the name is reserved by the checkpoint format (safetensors)");
    return FPS_EINVAL;
  }
  size_t len = strlen(name);
  char key[FPS_TENSOR_NAME_MAX + 8];
  for (const char *const *s = fps_ckpt_state_suffixes; *s; s++) {
    const char *sfx = *s;
    size_t sl = strlen(sfx);
    if (len > sl && !memcmp(name + len - sl, sfx, sl) && fps__name_taken_locked(sh, items, order, n, name, len - sl)) {
      snprintf(why, wl,
               "tensor '%s' collides with tensor '%.*s' in checkpoints (whose state is stored as '%s'): "
               "rename one",
               name, (int)(len - sl), name, name);
      return FPS_EINVAL;
    }
    if (len + sl <= FPS_TENSOR_NAME_MAX) {
      snprintf(key, sizeof key, "%s%s", name, sfx);
      if (fps__name_taken_locked(sh, items, order, n, key, len + sl)) {
        snprintf(why, wl,
                 "tensor '%s' collides with tensor '%s' in checkpoints (where the state of '%s' is stored as "
                 "'%s'): rename one",
                 name, key, name, key);
        return FPS_EINVAL;
      }
    }
  }
  return 0;
}

/* Phase 1 for item i. Returns 0 or FPS_E* and fills why. */
static int fps__create_check(fps_shard_t *sh, fps_plan_t *p, size_t i, char *why, size_t wl) {
  fps_plan_t *it = &p[i];
  const fps_create_item_t *tc = it->it;
  const char *name = tc->name ? tc->name : "";
  int rc;
  if ((rc = fps_shard_name_check(name, why, wl)) < 0) return rc;
  if ((rc = fps_shard_shape_check(name, tc->dims, tc->ndim, &it->shape, &it->numel, why, wl)) < 0) return rc;
  if (tc->split) {
    /* A row block: its map first (a client learns first whether its map is
     * wrong), then whether this shard holds blocks at all. From here on
     * numel, offsets and state sizes are the block's. */
    uint64_t lo, hi;
    rc = fps_shard_split_check(name, &it->shape, tc->split, sh->cfg.shard_id, sh->cfg.shard_count, &lo, &hi,
                               why, wl);
    if (rc < 0) return rc;
    if ((rc = fps_shard_split_allowed(sh, name, why, wl)) < 0) return rc;
    char sub[256] = "";
    if (fps_split_geom_init(&it->geom, &it->shape, lo, hi, sub, sizeof sub) < 0) {
      snprintf(why, wl, "tensor '%s': split block %u: %s", name, tc->split->block_index, sub);
      return FPS_EINVAL;
    }
    it->numel = it->geom.block_numel;
  }

  fps_plan_t *lead = &p[it->lead];
  /* What this item must agree with: the existing tensor, or the group's
   * first item. */
  const fps_shape_t *want_shape = NULL;
  const fps_adafactor_hparams_t *want_hp = NULL;
  if (it->lead == i) {
    it->t = fps_store_find(&sh->store, name);
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
    /* Split or whole, and the same block of the same map. */
    fps_split_map_t have_map;
    const fps_split_map_t *have = NULL;
    if (it->lead != i) {
      have = lead->it->split;
    } else if (it->t->split) {
      fps_shard_split_map_of(it->t->split, &have_map);
      have = &have_map;
    }
    if ((rc = fps_shard_split_match(name, have, tc->split, why, wl)) < 0) return rc;
  }
  /* Resume settings: a tensor's items agree, and are sane. */
  if (it->lead != i && (tc->step != lead->it->step || tc->replace != lead->it->replace ||
                        memcmp(&tc->rms, &lead->it->rms, sizeof tc->rms) != 0)) {
    snprintf(why, wl, "tensor '%s': the items naming it in this Create differ in step, rms or replace", name);
    return FPS_EINVAL;
  }
  if (tc->step > FPS_MAX_STEP) {
    snprintf(why, wl, "tensor '%s': step %" PRIu64 " is past the largest a tensor may resume at (2^53)", name,
             tc->step);
    return FPS_EINVAL;
  }
  if (tc->n_state && tc->step == 0) {
    snprintf(why, wl, "tensor '%s': init_state needs a step > 0 (a fresh tensor's state is all zeros)", name);
    return FPS_EINVAL;
  }
  if (!isfinite(tc->rms) || tc->rms < 0 || (double)(float)tc->rms != tc->rms) {
    snprintf(why, wl, "tensor '%s': rms %g must be a finite float32 >= 0", name, tc->rms);
    return FPS_EINVAL;
  }
  if (tc->rms != 0 && tc->hp.flavor != FPS_FLAVOR_HF) {
    snprintf(why, wl, "tensor '%s': rms is hf state; %s keeps none (send 0)", name, fps_flavor_name(tc->hp.flavor));
    return FPS_EINVAL;
  }
  if (it->lead == i) {
    if ((rc = fps_adafactor_state_size(&it->shape, it->t ? &it->t->hp : &tc->hp, &it->ssz)) < 0) {
      snprintf(why, wl, "tensor '%s': %s", name, fps_strerror(rc));
      return rc;
    }
    if (tc->split) fps_shard_split_state_size(&it->geom, it->t ? &it->t->hp : &tc->hp, &it->ssz);
    if (it->t) {
      pthread_mutex_lock(&it->t->mu);
      pthread_mutex_lock(&sh->rounds_mu); /* guards the round */
      bool open = it->t->round.open;
      uint64_t round_step = it->t->round.step, version = it->t->version;
      uint32_t joined = it->t->round.joined;
      pthread_mutex_unlock(&sh->rounds_mu);
      it->replacing = tc->replace;
      it->was_ready = !tc->replace && it->t->ready;
      it->gen = it->t->init_gen;
      rc = 0;
      if (!it->was_ready && !tc->replace) {
        rc = fps_ranges_copy(&it->ranges, &it->t->init);
        for (int k = 0; k < FPS_STATE_KINDS && rc == 0; k++)
          rc = fps_ranges_copy(&it->sranges[k], &it->t->init_state[k]);
      }
      pthread_mutex_unlock(&it->t->mu);
      if (rc < 0) {
        snprintf(why, wl, "tensor '%s': out of memory", name);
        return FPS_ENOMEM;
      }
      if (tc->replace && open) {
        snprintf(why, wl,
                 "tensor '%s': cannot replace it while a sync round is open (step %" PRIu64 ", %u of %u workers "
                 "pushed); replace between rounds",
                 name, round_step, joined, sh->cfg.workers);
        return FPS_ESTATE;
      }
      /* An initialising tensor is filled at the step it was created with. */
      if (!it->was_ready && !tc->replace && (tc->step || tc->n_state) && tc->step != version) {
        snprintf(why, wl, "tensor '%s' is being created at step %" PRIu64 ", not %" PRIu64, name, version, tc->step);
        return FPS_EINVAL;
      }
    } else {
      it->is_new = true;
    }
  }
  for (size_t j = 0; j < tc->n_state && !lead->was_ready; j++)
    if ((rc = fps__state_slice_check(name, lead, &tc->state[j], why, wl)) < 0) return rc;

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

/* Back to the state before step 1 (a retry): keeps it and lead. */
static void fps__plan_reset(fps_plan_t *p, size_t n) {
  for (size_t i = 0; i < n; i++) {
    fps_ranges_free(&p[i].ranges);
    for (int k = 0; k < FPS_STATE_KINDS; k++) fps_ranges_free(&p[i].sranges[k]);
    fps__pbuf_retire(p[i].sh, p[i].t, p[i].new_pbuf);
    fps_adafactor_state_destroy(&p[i].new_st);
    fps_split_state_destroy(&p[i].new_sst);
    if (p[i].lead == i && p[i].is_new && !p[i].inserted) fps_tensor_destroy(p[i].t);
    const fps_create_item_t *it = p[i].it;
    size_t lead = p[i].lead;
    memset(&p[i], 0, sizeof p[i]);
    p[i].it = it;
    p[i].lead = lead;
  }
}

/* Writes item i's init values and state into `param` / `st` (its lead's
 * tensor, or a replacement's staging). Returns the init bytes. */
static uint64_t fps__create_write(const fps_create_item_t *item, const fps_plan_t *pi, float *param,
                                  float *const st[FPS_STATE_KINDS]) {
  uint64_t received = 0;
  if (pi->count) {
    fps_dtype_decode(item->init->dtype, item->init->data, pi->count, param + pi->off, NULL);
    received = item->init->len;
  }
  for (size_t j = 0; j < item->n_state; j++) {
    const fps_state_slice_t *ss = &item->state[j];
    memcpy(st[ss->kind] + ss->offset, ss->data, ss->len);
  }
  return received;
}

/* The lead's coverage becomes the tensor's; ready once the params are
 * covered and, at a resume step, the state. REQUIRES t->mu (or t unseen). */
static void fps__create_publish(fps_plan_t *lead) {
  fps_tensor_t *t = lead->t;
  fps_ranges_free(&t->init);
  t->init = lead->ranges;
  memset(&lead->ranges, 0, sizeof lead->ranges);
  for (int k = 0; k < FPS_STATE_KINDS; k++) {
    fps_ranges_free(&t->init_state[k]);
    t->init_state[k] = lead->sranges[k];
    memset(&lead->sranges[k], 0, sizeof lead->sranges[k]);
  }
  if (t->init.covered == t->numel && (t->version == 0 || fps__state_covered(&t->size, t->init_state))) {
    t->ready = true;
    t->pbuf->version = t->version; /* published from now on: read only */
    fps_ranges_free(&t->init);
    for (int k = 0; k < FPS_STATE_KINDS; k++) fps_ranges_free(&t->init_state[k]);
    FPS_LOG(FPS_LOG_DEBUG, "tensor '%s' is ready", t->name);
  }
  t->init_gen++;
}

static int fps__cmp_tensor_ptr(const void *a, const void *b) {
  const fps_tensor_t *x = *(fps_tensor_t *const *)a, *y = *(fps_tensor_t *const *)b;
  return x < y ? -1 : x > y;
}

/* max_tensors and max_bytes against new_count tensors of new_bytes more:
 * 0 or FPS_ELIMIT with why, naming `largest` (the call's largest new
 * tensor). REQUIRES store->mu (read or write). */
static int fps__create_limits_locked(fps_shard_t *sh, uint64_t new_count, uint64_t new_bytes, const char *largest,
                                     char *why, size_t wl) {
  char who[320];
  if (new_count > 1)
    snprintf(who, sizeof who, "tensor '%s' and %" PRIu64 " more", largest, new_count - 1);
  else
    snprintf(who, sizeof who, "tensor '%s'", largest ? largest : "");
  if (sh->store.count + new_count > sh->cfg.max_tensors) {
    snprintf(why, wl, "Create of %s: %" PRIu64 " new tensors would exceed this shard's limit of %" PRIu64
             " tensors (--max-tensors)", who, new_count, sh->cfg.max_tensors);
    return FPS_ELIMIT;
  }
  if (sh->store.param_bytes + new_bytes > sh->cfg.max_bytes) {
    snprintf(why, wl, "Create of %s: %" PRIu64 " new parameter bytes would exceed this shard's limit of %" PRIu64
             " bytes (--max-bytes; %" PRIu64 " in use)", who, new_bytes, sh->cfg.max_bytes, sh->store.param_bytes);
    return FPS_ELIMIT;
  }
  return 0;
}

int fps_shard_create(fps_shard_t *sh, uint32_t shard_id, uint32_t shard_count, const fps_create_item_t *items,
                     size_t n, fps_create_info_t *out, uint64_t *received_out, char *why, size_t wl) {
  int rc = 0;
  fps_plan_t *p = fps_calloc(n ? n : 1, sizeof *p);
  size_t *order = fps_calloc(n ? n : 1, sizeof *order);
  fps_tensor_t **rt = fps_calloc(n ? n : 1, sizeof *rt); /* existing tensors written, by address */
  size_t nr = 0;
  bool locked = false, tlocked = false;
  unsigned tries = 0;
  *received_out = 0;
  if (!p || !order || !rt) {
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

again:
  /* Step 1: validate (no store lock but for each lookup). */
  nr = 0;
  uint64_t new_count = 0, new_bytes = 0, largest_numel = 0;
  const char *largest = NULL; /* named by a limit's message */
  for (size_t i = 0; i < n && rc == 0; i++) {
    rc = fps__create_check(sh, p, i, why, wl);
    if (rc == 0 && p[i].lead == i && p[i].is_new) {
      new_count++;
      new_bytes += p[i].numel * 4;
      if (!largest || p[i].numel > largest_numel) largest = items[i].name, largest_numel = p[i].numel;
    }
  }
  if (rc < 0) goto done;
  /* The limits before allocating: a hostile Create of 2^40 elements must
   * not get its terabytes reserved only to be refused at insertion. They
   * are checked again under the write lock (others may insert meanwhile). */
  pthread_rwlock_rdlock(&sh->store.mu);
  rc = fps__create_limits_locked(sh, new_count, new_bytes, largest, why, wl);
  pthread_rwlock_unlock(&sh->store.mu);
  if (rc < 0) goto done;
  /* A replace covers everything in this call. */
  for (size_t i = 0; i < n && rc == 0; i++) {
    if (p[i].lead != i || !p[i].replacing) continue;
    const char *name = items[i].name;
    if (p[i].ranges.covered != p[i].numel) {
      rc = FPS_EINVAL;
      snprintf(why, wl,
               "tensor '%s': a replace must carry all %" PRIu64 " values in this Create (it has %" PRIu64 ")", name,
               p[i].numel, p[i].ranges.covered);
    } else if (items[i].step > 0 && !fps__state_covered(&p[i].ssz, p[i].sranges)) {
      int k = 0;
      while (p[i].sranges[k].covered == fps__kind_size(&p[i].ssz, k)) k++;
      rc = FPS_EINVAL;
      snprintf(why, wl,
               "tensor '%s': a replace at step %" PRIu64 " must carry its whole state in this Create (%s: %" PRIu64
               " of %" PRIu64 " elements)",
               name, items[i].step, fps__kind_name[k], p[i].sranges[k].covered, fps__kind_size(&p[i].ssz, k));
    }
  }
  if (rc < 0) goto done;

  /* Step 2: allocate every new tensor and write its values; stage the
   * replacements. Nobody else sees any of it yet: no lock. */
  for (size_t i = 0; i < n && rc == 0; i++) {
    if (p[i].lead != i || !p[i].is_new) continue;
    const char *name = items[i].name;
    p[i].t = items[i].split ? fps_tensor_create_split(name, strlen(name), &p[i].geom, items[i].split,
                                                      &items[i].hp, sh->cfg.workers, sh->cfg.apply_log)
                            : fps_tensor_create(name, strlen(name), &p[i].shape, p[i].numel, &items[i].hp,
                                                sh->cfg.workers, sh->cfg.apply_log);
    if (!p[i].t) {
      rc = FPS_ENOMEM;
      snprintf(why, wl, "tensor '%s': out of memory allocating %" PRIu64 " parameters", name, p[i].numel);
      break;
    }
    /* Resume: it starts at the step's version and state (still not ready). */
    p[i].t->version = items[i].step;
    if (p[i].t->split) {
      p[i].t->split->st.step = items[i].step;
      p[i].t->split->st.rms = (float)items[i].rms;
    } else {
      p[i].t->st.step = items[i].step;
      p[i].t->st.rms = (float)items[i].rms;
    }
  }
  for (size_t i = 0; i < n && rc == 0; i++) {
    if (p[i].lead != i || !p[i].replacing) continue;
    bool over = false;
    p[i].new_pbuf = fps__pbuf_new_staged(sh, p[i].t, &over);
    p[i].sh = sh;
    const fps_tensor_t *t = p[i].t;
    if (over) {
      rc = FPS_ELIMIT;
      snprintf(why, wl,
               "tensor '%s': staging its %" PRIu64 "-element replacement would pass the shard's limit for "
               "in-flight tensors (--max-staging-bytes); retry later",
               items[i].name, t->numel);
    } else if (!p[i].new_pbuf || (t->split ? fps_split_state_init(&p[i].new_sst, &t->split->g, &t->hp)
                                            : fps_adafactor_state_init(&p[i].new_st, &p[i].shape, &t->hp)) < 0) {
      rc = FPS_ENOMEM;
      snprintf(why, wl, "tensor '%s': out of memory staging its replacement", items[i].name);
    }
  }
  if (rc < 0) goto done;
  uint64_t received = 0;
  for (size_t i = 0; i < n; i++) {
    fps_plan_t *lead = &p[p[i].lead];
    float *arr[FPS_STATE_KINDS];
    if (lead->is_new) {
      fps_tensor_state_arrays(lead->t, arr);
      received += fps__create_write(&items[i], &p[i], lead->t->param, arr);
    } else if (lead->replacing) {
      fps__staged_arrays(lead, arr);
      received += fps__create_write(&items[i], &p[i], lead->new_pbuf->data, arr);
    }
  }
  for (size_t i = 0; i < n; i++)
    if (p[i].lead == i && p[i].is_new) fps__create_publish(&p[i]);
  /* The existing tensors this call writes: initialising ones (values or
   * just their coverage) and replacements. */
  for (size_t i = 0; i < n; i++)
    if (p[i].lead == i && !p[i].is_new && (p[i].replacing || !p[i].was_ready)) rt[nr++] = p[i].t;
  qsort(rt, nr, sizeof *rt, fps__cmp_tensor_ptr);

  /* Step 3: the store's write lock, for pointer work only. */
  pthread_rwlock_wrlock(&sh->store.mu);
  locked = true;
  bool stale = false;
  for (size_t i = 0; i < n && !stale; i++)
    if (p[i].lead == i && p[i].is_new && fps__store_find_locked(&sh->store, items[i].name, strlen(items[i].name)))
      stale = true; /* another Create made it meanwhile */
  for (size_t i = 0; i < n && !stale && rc == 0; i++)
    if (p[i].lead == i && p[i].is_new) rc = fps__name_collision_locked(sh, items, order, n, items[i].name, why, wl);
  if (!stale && rc == 0) rc = fps__create_limits_locked(sh, new_count, new_bytes, largest, why, wl);
  if (!stale && rc == 0 && fps__store_reserve_locked(&sh->store, sh->store.count + new_count) < 0) {
    rc = FPS_ENOMEM;
    snprintf(why, wl, "Create: out of memory growing the tensor map");
  }
  if (!stale && rc == 0) {
    for (size_t a = 0; a < nr; a++) pthread_mutex_lock(&rt[a]->mu);
    tlocked = true;
    pthread_mutex_lock(&sh->rounds_mu); /* guards the rounds */
    for (size_t i = 0; i < n && !stale && rc == 0; i++) {
      if (p[i].lead != i || p[i].is_new || !(p[i].replacing || !p[i].was_ready)) continue;
      fps_tensor_t *t = p[i].t;
      if (t->init_gen != p[i].gen) stale = true; /* another Create wrote it meanwhile */
      else if (p[i].replacing && (t->round.open || t->red || (t->split && t->split->xs))) {
        /* Pushes do not take the store lock: one more look, under the
         * tensor's. */
        rc = FPS_ESTATE;
        snprintf(why, wl, "tensor '%s': cannot replace it while a sync round is open (step %" PRIu64
                 "); replace between rounds", t->name, t->version);
      }
    }
    pthread_mutex_unlock(&sh->rounds_mu);
  }
  if (stale || rc < 0) {
    if (tlocked)
      for (size_t a = nr; a-- > 0;) pthread_mutex_unlock(&rt[a]->mu);
    tlocked = false;
    pthread_rwlock_unlock(&sh->store.mu);
    locked = false;
    if (rc < 0) goto done;
    fps__plan_reset(p, n);
    if (++tries >= FPS_CREATE_RETRIES) {
      rc = FPS_EUNAVAILABLE;
      snprintf(why, wl, "Create: other Creates of the same tensors kept changing them; retry");
      goto done;
    }
    goto again;
  }
  for (size_t i = 0; i < n; i++)
    if (p[i].lead == i && p[i].is_new) {
      fps__store_insert_locked(&sh->store, p[i].t); /* reserved: cannot fail */
      p[i].inserted = true;
    }
  pthread_rwlock_unlock(&sh->store.mu);
  locked = false;

  /* Step 4: the existing tensors' values, under their own locks only. */
  for (size_t i = 0; i < n; i++) {
    fps_plan_t *lead = &p[p[i].lead];
    if (lead->is_new || lead->was_ready || lead->replacing) continue;
    float *arr[FPS_STATE_KINDS];
    fps_tensor_state_arrays(lead->t, arr);
    received += fps__create_write(&items[i], &p[i], lead->t->param, arr);
  }
  for (size_t i = 0; i < n; i++) {
    if (p[i].lead != i || p[i].is_new || p[i].was_ready) continue;
    fps_tensor_t *t = p[i].t;
    if (p[i].replacing) {
      fps_snap_t *old_pbuf = t->pbuf;
      t->pbuf = p[i].new_pbuf;
      t->param = t->pbuf->data;
      fps__pbuf_publish(sh, t->pbuf); /* the tensor's own now, no longer staging */
      if (t->split) {
        fps_split_state_t old_sst = t->split->st;
        t->split->st = p[i].new_sst;
        t->split->st.step = items[i].step;
        t->split->st.rms = (float)items[i].rms;
        p[i].new_sst = old_sst; /* freed below with the plan */
        fps__xrec_new_history(sh, t);
        t->split->replaces++;
      } else {
        fps_adafactor_state_t old_st = t->st;
        t->st = p[i].new_st;
        t->st.step = items[i].step;
        t->st.rms = (float)items[i].rms;
        p[i].new_st = old_st;
      }
      t->version = items[i].step;
      t->pbuf->version = t->version;
      fps__tbuf_drop_spare(sh, t); /* a new history: start afresh */
      t->ready = true;
      fps_ranges_free(&t->init);
      for (int k = 0; k < FPS_STATE_KINDS; k++) fps_ranges_free(&t->init_state[k]);
      /* A new history: the old apply log and restore point no longer apply. */
      t->log_len = t->log_head = 0;
      t->restored_seq = t->restored_version = 0;
      t->last_lr = t->hp.has_lr ? t->hp.lr : 0.0;
      t->last_weight_decay = t->hp.weight_decay;
      t->init_gen++;
      p[i].new_pbuf = old_pbuf; /* retired below with the plan (replies may
                                 * still read it) */
    } else {
      fps__create_publish(&p[i]);
    }
  }
  for (size_t a = nr; a-- > 0;) pthread_mutex_unlock(&rt[a]->mu);
  tlocked = false;
  /* After the writes (checkpoint.c reads the count before it copies). A
   * Create that only matched ready tensors (every worker's on start)
   * changed nothing: counted, SIGTERM after a restore would rewrite an
   * unchanged shard's checkpoint. */
  if (new_count > 0 || nr > 0) atomic_fetch_add(&sh->changes, 1);
  *received_out = received;
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
    o->changed = lead->is_new || lead->replacing || !lead->was_ready;
  }

done:
  if (tlocked)
    for (size_t a = nr; a-- > 0;) pthread_mutex_unlock(&rt[a]->mu);
  if (locked) pthread_rwlock_unlock(&sh->store.mu);
  if (p) fps__plan_reset(p, n);
  fps_free(p);
  fps_free(order);
  fps_free(rt);
  return rc;
}
