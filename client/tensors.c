/* fps_client_create_tensors(): validation, placement, and the Create
 * calls that register tensors and upload their initial values.
 *
 * Create is unary, so a tensor larger than one message is uploaded by a
 * sequence of Create calls per shard, each carrying the next slice (the
 * shard fills an "initialising" tensor from slices). Rounds run all shards
 * in parallel: round r sends each shard its r-th message. Create is
 * idempotent (same name, shape, settings; data for a ready tensor is
 * ignored), so every round is retried on UNAVAILABLE. Once a reply calls a
 * tensor ready (another worker's values came first), the rest of its
 * values is not sent: a worker joining a running job uploads at most one
 * message of each tensor. Tensors whose values
 * come from another worker are then polled with value-less Creates, with
 * backoff, until ready or the deadline.
 *
 * Split tensors: with split_min_bytes > 0 the placement may cut
 * a tensor into row blocks (fps__placement_split). Each block is its own
 * item here: a Create to its shard carrying the whole map (SplitBlock), the
 * whole shape, and the block's slice of init and of the resume state at
 * block-local offsets (its rows' row statistics, the column statistics of
 * every matrix its rows touch, its elements' variance and momentum: what
 * common's fps_split_state_from_whole keeps). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "alloc.h"
#include "error.h"
#include "factorps/v1/factorps.pb-c.h"
#include "internal.h"

/* Items per def in one message at most: its params and four state kinds. */
#define SEGS 5

/* What one Create goes to one shard for: a whole tensor, or one row block
 * of a split one. */
typedef struct create_item_s {
  size_t def;                           /* index into the defs */
  int shard;
  uint32_t block;                       /* block index (0 for a whole tensor) */
  uint64_t row_lo, row_hi;              /* its rows (a whole tensor: all) */
  const float *data[SEGS];              /* first value to send of params, row, col, var, mom */
  uint64_t seg[SEGS];                   /* elements of each to send (0: none) */
  Factorps__V1__SplitBlock *split;      /* NULL: whole */
  uint64_t split_over;                  /* wire bytes the SplitBlock adds, at most */
} create_item_t;

typedef struct create_job_s {
  fps_client_t *c;
  const fps_tensor_def_t *defs;
  create_item_t *items;                 /* per def, or per block of a split def */
  size_t n_items;
  Factorps__V1__SplitBlock *splits;     /* one per block of the split defs */
  uint64_t *bounds;                     /* their maps' row boundaries */
  uint32_t *block_shards;               /* and shards */
  Factorps__V1__AdafactorConfig *cfg;   /* per def */
  unsigned char *ready;                 /* per item, from the latest reply */
  uint64_t budget;                      /* payload bytes per message */
} create_job_t;

typedef struct create_shard_s {
  fps__stream_t s;
  create_job_t *job;
  size_t *defs;                         /* item indices placed on this shard */
  size_t n;
  size_t pos, round_pos;                /* cursor: next def */
  int seg, round_seg;                   /* cursor: its next segment */
  uint64_t off, round_off;              /* cursor: next element of the segment */
  int poll;                             /* send names only, no values */
  size_t *msg_defs;                     /* items in flight */
  size_t msg_n;
  /* Scratch for building one message (SEGS items per def). */
  Factorps__V1__TensorCreate *tc;
  Factorps__V1__TensorCreate **tcp;
  Factorps__V1__TensorSlice *init;
  Factorps__V1__StateSlice *state;
  Factorps__V1__StateSlice **statep;
} create_shard_t;

static const float *def_data(const fps_tensor_def_t *d, int seg) {
  switch (seg) {
    case 0: return d->init;
    case 1: return d->state_row;
    case 2: return d->state_col;
    case 3: return d->state_var;
    default: return d->state_mom;
  }
}

/* Framing of one TensorCreate besides its values, at most. */
static uint64_t item_over(const create_job_t *job, const create_item_t *it) {
  const fps_tensor_def_t *def = &job->defs[it->def];
  return FPS__SLICE_OVERHEAD * 2 + 2 * strlen(def->name) + 22 * def->ndim + 128 + it->split_over;
}

/* Bytes an item takes on the wire, at most (replace: one message). */
static uint64_t item_bytes(const create_job_t *job, const create_item_t *it) {
  uint64_t b = 0;
  for (int g = 0; g < SEGS; g++)
    if (it->seg[g]) b += it->seg[g] * 4 + item_over(job, it);
  return b;
}

static int create_next(fps__stream_t *s, grpc_byte_buffer **out, int *last) {
  create_shard_t *sh = s->ctx;
  create_job_t *job = sh->job;
  uint64_t used = FPS__MESSAGE_OVERHEAD;
  size_t k = 0;

  sh->round_pos = sh->pos;
  sh->round_seg = sh->seg;
  sh->round_off = sh->off;
  while (sh->pos < sh->n) {
    size_t d = sh->defs[sh->pos];
    const create_item_t *it = &job->items[d];
    const fps_tensor_def_t *def = &job->defs[it->def];
    uint64_t over = item_over(job, it);
    if (k > 0 && used + over + 4 > job->budget) break;
    /* A replace goes whole in one message (checked to fit an empty one). */
    if (def->replace && !sh->poll && k > 0 && sh->seg == 0 && sh->off == 0 &&
        used + item_bytes(job, it) > job->budget)
      break;
    /* The next segment with something to send. */
    while (!sh->poll && sh->seg < SEGS && it->seg[sh->seg] == 0) sh->seg++;
    Factorps__V1__TensorCreate *tc = &sh->tc[k];
    factorps__v1__tensor_create__init(tc);
    tc->name = (char *)def->name;
    tc->n_shape = def->ndim;
    tc->shape = (uint64_t *)def->shape;
    tc->optimizer = &job->cfg[it->def];
    tc->step = def->step;
    tc->rms = def->rms;
    tc->replace = def->replace && !sh->poll;
    tc->split = it->split;
    used += over;
    if (!sh->poll && sh->seg < SEGS) {
      uint64_t room = job->budget > used ? (job->budget - used) / 4 : 0;
      uint64_t left = it->seg[sh->seg] - sh->off;
      uint64_t count = left < room ? left : room;
      if (count == 0) break; /* k > 0 here: the next message takes it */
      const float *src = it->data[sh->seg] + sh->off;
      if (sh->seg == 0) {
        Factorps__V1__TensorSlice *sl = &sh->init[k];
        factorps__v1__tensor_slice__init(sl);
        sl->dtype = FACTORPS__V1__DTYPE__DTYPE_F32;
        sl->offset = sh->off;
        sl->data.data = (uint8_t *)src;
        sl->data.len = count * 4;
        tc->init = sl;
      } else {
        Factorps__V1__StateSlice *ss = &sh->state[k];
        factorps__v1__state_slice__init(ss);
        ss->kind = (Factorps__V1__StateKind)sh->seg; /* row 1, col 2, var 3, mom 4 */
        ss->offset = sh->off;
        ss->data.data = (uint8_t *)src;
        ss->data.len = count * 4;
        sh->statep[k] = ss;
        tc->n_init_state = 1;
        tc->init_state = &sh->statep[k];
      }
      used += count * 4;
      sh->off += count;
      if (sh->off == it->seg[sh->seg]) {
        sh->seg++;
        sh->off = 0;
        while (sh->seg < SEGS && it->seg[sh->seg] == 0) sh->seg++;
        if (sh->seg == SEGS) {
          sh->pos++;
          sh->seg = 0;
        }
      }
    } else {
      sh->pos++;
      sh->seg = 0;
      sh->off = 0;
    }
    sh->tcp[k] = tc;
    sh->msg_defs[k] = d;
    k++;
    if (used >= job->budget) break;
  }
  sh->msg_n = k;
  Factorps__V1__CreateRequest req = FACTORPS__V1__CREATE_REQUEST__INIT;
  req.n_tensors = k;
  req.tensors = sh->tcp;
  req.shard_id = (uint32_t)s->shard;
  req.shard_count = (uint32_t)job->c->n_shards;
  req.job_id = job->c->job_id;
  *out = fps__pack(&req);
  *last = 1;
  return 0;
}

static int create_reply(fps__stream_t *s, const uint8_t *data, size_t len) {
  create_shard_t *sh = s->ctx;
  int rc = 0, code;
  Factorps__V1__CreateResponse *resp = fps__unpack(&factorps__v1__create_response__descriptor, data, len, &code);
  if (!resp) return fps__stream_fail(s, code, "%s CreateResponse", fps__unpack_why(code));
  if (resp->n_tensors != sh->msg_n) {
    rc = fps__stream_fail(s, FPS_CODE_INTERNAL, "CreateResponse has %zu tensors, request had %zu",
                          resp->n_tensors, sh->msg_n);
    goto done;
  }
  for (size_t i = 0; i < sh->msg_n; i++) {
    size_t d = sh->msg_defs[i];
    const char *name = sh->job->defs[sh->job->items[d].def].name;
    if (strcmp(resp->tensors[i]->name, name) != 0) {
      rc = fps__stream_fail(s, FPS_CODE_INTERNAL, "CreateResponse names '%s' where '%s' was sent",
                            resp->tensors[i]->name, name);
      goto done;
    }
    sh->job->ready[d] = resp->tensors[i]->ready ? 1 : 0;
  }
done:
  factorps__v1__create_response__free_unpacked(resp, &fps__pb_allocator);
  return rc;
}

static void create_reset(fps__stream_t *s) {
  create_shard_t *sh = s->ctx;
  sh->pos = sh->round_pos;
  sh->seg = sh->round_seg;
  sh->off = sh->round_off;
}

static const fps__stream_ops_t create_ops = {create_next, create_reply, create_reset, NULL};

static void sleep_s(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

/* Moves the cursor past an item a reply already called ready (another
 * worker's values won): the shard would ignore the rest of its values.
 * Only the item under the cursor can be one: an item's readiness is known
 * once a message carried part of it. A replace is never skipped. */
static void skip_ready(create_shard_t *sh) {
  const create_job_t *job = sh->job;
  while (!sh->poll && sh->pos < sh->n && job->ready[sh->defs[sh->pos]] &&
         !job->defs[job->items[sh->defs[sh->pos]].def].replace) {
    sh->pos++;
    sh->seg = 0;
    sh->off = 0;
  }
}

/* Runs rounds until every shard's cursor reached its end. */
static int run_rounds(fps_client_t *c, create_shard_t *sh, fps__stream_t **run, fps_status_t *st) {
  for (;;) {
    size_t n = 0;
    for (size_t i = 0; i < c->n_shards; i++) {
      skip_ready(&sh[i]);
      if (sh[i].pos < sh[i].n) run[n++] = &sh[i].s;
    }
    if (!n) return 0;
    int rc = fps__streams_run(c, FPS__METHOD_CREATE, run, n, FPS__RETRY_IDEMPOTENT, st);
    if (rc) return rc;
  }
}

/* The placement of the tensor list (whole tensors and row blocks,
 * fps__placement_split; split_min_bytes 0 is fps__placement_compute's) and
 * the items it makes, in defs order, a split tensor's blocks in row order.
 * A split tensor gets its map in the list (t->blocks) and one SplitBlock
 * per block. `list` is still in defs order. Returns 0 or FPS_ENOMEM. */
static int plan_items(fps_client_t *c, fps__tensor_list_t *list, const fps_tensor_def_t *defs,
                      create_job_t *job) {
  const size_t n = list->n, S = c->n_shards;
  const uint64_t smb = c->opts.split_min_bytes;
  size_t nbig = 0;
  for (size_t i = 0; i < n; i++) nbig += smb && list->t[i].bytes >= smb;
  fps__block_t *b = fps_malloc((n + nbig * (S - 1) + 1) * sizeof *b);
  size_t *first = fps_malloc((n + 1) * sizeof *first);
  int rc = FPS_ENOMEM;
  if (!b || !first || fps__placement_split(list->t, n, S, smb, b, first, NULL)) goto done;
  /* A tensor the client's list already places whole (an earlier Create, or
   * fps_client_discover: where the shards hold it), with the same shape,
   * stays on its shard: a tensor added to the job later (a parameter group,
   * a parameter unfrozen) must not move the others, whose state lives where
   * they are. The others keep the plan's places, so workers that agree on
   * where the existing tensors are agree on the new ones too. */
  for (size_t i = 0; i < n; i++) {
    fps__tensor_t *t = &list->t[i];
    const fps__tensor_t *old = fps__tensor_list_find(&c->tensors, t->name);
    if (first[i + 1] - first[i] != 1 || !old || old->blocks || old->shard < 0 || (size_t)old->shard >= S ||
        old->ndim != t->ndim || memcmp(old->shape, t->shape, t->ndim * sizeof *t->shape) != 0)
      continue;
    b[first[i]].shard = old->shard;
    t->shard = old->shard;
  }
  size_t n_split = 0, n_bounds = 0;
  for (size_t i = 0; i < n; i++)
    if (first[i + 1] - first[i] > 1) {
      n_split += first[i + 1] - first[i];
      n_bounds += first[i + 1] - first[i] + 1;
    }
  job->n_items = first[n];
  job->items = fps_calloc(first[n] ? first[n] : 1, sizeof *job->items);
  job->splits = fps_calloc(n_split ? n_split : 1, sizeof *job->splits);
  job->bounds = fps_calloc(n_bounds ? n_bounds : 1, sizeof *job->bounds);
  job->block_shards = fps_calloc(n_split ? n_split : 1, sizeof *job->block_shards);
  if (!job->items || !job->splits || !job->bounds || !job->block_shards) goto done;
  size_t at = 0, sp = 0, bo = 0;
  for (size_t i = 0; i < n; i++) {
    fps__tensor_t *t = &list->t[i];
    const fps_tensor_def_t *d = &defs[i];
    const size_t nb = first[i + 1] - first[i];
    const fps__block_t *tb = b + first[i];
    const uint64_t C = fps__row_elems(t), R = t->ndim >= 2 ? t->shape[t->ndim - 2] : 1;
    uint64_t *bounds = NULL;
    uint32_t *bsh = NULL;
    if (nb > 1) {
      if (!(t->blocks = fps_malloc(nb * sizeof *t->blocks))) goto done;
      memcpy(t->blocks, tb, nb * sizeof *t->blocks);
      bounds = job->bounds + bo;
      bsh = job->block_shards + sp;
      bo += nb + 1;
      for (size_t k = 0; k < nb; k++) {
        bounds[k] = tb[k].row_lo;
        bsh[k] = (uint32_t)tb[k].shard;
      }
      bounds[nb] = tb[nb - 1].row_hi;
    }
    for (size_t k = 0; k < nb; k++) {
      create_item_t *it = &job->items[at++];
      const uint64_t lo = tb[k].row_lo, hi = tb[k].row_hi;
      it->def = i;
      it->shard = tb[k].shard;
      it->block = (uint32_t)k;
      it->row_lo = lo;
      it->row_hi = hi;
      /* The block's part of every array the def gives (block-local). */
      if (d->init) it->data[0] = d->init + lo * C, it->seg[0] = (hi - lo) * C;
      if (d->state_row) it->data[1] = d->state_row + lo, it->seg[1] = hi - lo;
      if (d->state_col) {
        const uint64_t mlo = lo / R, mhi = (hi - 1) / R + 1; /* the matrices it touches */
        it->data[2] = d->state_col + mlo * C;
        it->seg[2] = (mhi - mlo) * C;
      }
      if (d->state_var) it->data[3] = d->state_var + lo, it->seg[3] = hi - lo;
      if (d->state_mom) it->data[4] = d->state_mom + lo * C, it->seg[4] = (hi - lo) * C;
      if (nb > 1) {
        Factorps__V1__SplitBlock *x = &job->splits[sp++];
        factorps__v1__split_block__init(x);
        x->block_index = (uint32_t)k;
        x->n_bounds = nb + 1;
        x->bounds = bounds;
        x->n_block_shards = nb;
        x->block_shards = bsh;
        x->shard_count = (uint32_t)S;
        it->split = x;
        /* tag+length of the message and of both packed fields, the index
         * and the count, and every varint at its longest */
        it->split_over = 48 + 10 * (nb + 1) + 5 * nb;
      }
    }
  }
  rc = 0;
done:
  fps_free(b);
  fps_free(first);
  return rc;
}

/* "tensor 'x'" or "tensor 'x' block 1 (rows [4, 9))", for messages. */
static const char *item_label(const create_job_t *job, const create_item_t *it, char *buf,
                              size_t len) {
  const char *name = job->defs[it->def].name;
  if (!it->split)
    snprintf(buf, len, "tensor '%s'", name);
  else
    snprintf(buf, len, "tensor '%s' block %u (rows [%llu, %llu))", name, it->block,
             (unsigned long long)it->row_lo, (unsigned long long)it->row_hi);
  return buf;
}

int fps_client_create_tensors(fps_client_t *c, const fps_tensor_def_t *defs, size_t n,
                              fps_status_t *status) {
  create_job_t job = {0};
  create_shard_t *sh = NULL;
  fps__stream_t **run = NULL;
  fps__tensor_list_t list = {0};
  uint64_t *numel = NULL;
  char err[256], label[FPS_CLIENT_NAME_MAX + 96];
  int rc;

  if (!c || (!defs && n))
    return fps__status_err(status, FPS_EINVAL, -1, "client or defs is NULL");
  numel = fps_calloc(n ? n : 1, sizeof *numel);
  job.cfg = fps_calloc(n ? n : 1, sizeof *job.cfg);
  list.t = fps_calloc(n ? n : 1, sizeof *list.t);
  sh = fps_calloc(c->n_shards, sizeof *sh);
  run = fps_calloc(c->n_shards, sizeof *run);
  if (!numel || !job.cfg || !list.t || !sh || !run) goto nomem;

  for (size_t i = 0; i < n; i++) {
    const fps_tensor_def_t *d = &defs[i];
    if (!fps__name_valid(d->name)) {
      rc = fps__status_err(status, FPS_EINVAL, -1,
                           "tensor %zu: name must be 1..%d bytes of UTF-8 without control characters", i,
                           FPS_CLIENT_NAME_MAX);
      goto fail;
    }
    numel[i] = fps__shape_numel(d->ndim, d->shape, err, sizeof err);
    if (!numel[i]) {
      rc = fps__status_err(status, FPS_EINVAL, -1, "tensor '%s': bad shape: %s",
                           d->name, err);
      goto fail;
    }
    int bad = fps__optim_to_wire(&d->optim, &job.cfg[i], err, sizeof err);
    if (bad < 0) {
      rc = fps__status_err(status, bad, -1, "tensor '%s': %s", d->name, err);
      goto fail;
    }
    /* Resume and replace: which state arrays the tensor has, and what to send. */
    {
      uint64_t lead = 1, want[SEGS] = {0};
      if (d->ndim >= 2) {
        for (uint32_t j = 0; j + 2 < d->ndim; j++) lead *= d->shape[j];
        want[1] = lead * d->shape[d->ndim - 2];
        want[2] = lead * d->shape[d->ndim - 1];
      } else {
        want[3] = numel[i];
      }
      if (d->optim.flavor == FPS_OPTIM_HF && d->optim.has_beta1) want[4] = numel[i];
      static const char *const kn[SEGS] = {"init", "state_row", "state_col", "state_var", "state_mom"};
      for (int g = 1; g < SEGS; g++) {
        const char *problem = NULL;
        if (def_data(d, g) && !want[g]) problem = "the tensor has no such state";
        else if (d->step && d->init && want[g] && !def_data(d, g)) problem = "a resume (step > 0) needs it";
        else if (!d->step && def_data(d, g)) problem = "state needs a step > 0";
        else if (def_data(d, g) && !d->init) problem = "state needs init values too";
        if (problem) {
          rc = fps__status_err(status, FPS_EINVAL, -1, "tensor '%s': %s: %s", d->name, kn[g],
                               problem);
          goto fail;
        }
      }
    }
    if (d->replace && !d->init) {
      rc = fps__status_err(status, FPS_EINVAL, -1, "tensor '%s': replace needs init values",
                           d->name);
      goto fail;
    }
    fps__tensor_t *t = &list.t[i];
    if (!(t->name = fps_strdup(d->name))) goto nomem;
    list.n = i + 1;
    t->ndim = d->ndim;
    memcpy(t->shape, d->shape, d->ndim * sizeof *d->shape);
    t->numel = numel[i];
    t->bytes = numel[i] * 4;
  }
  job.c = c;
  job.defs = defs;
  job.budget = c->opts.max_message_bytes;
  if (plan_items(c, &list, defs, &job)) goto nomem;
  if (!(job.ready = fps_calloc(job.n_items ? job.n_items : 1, 1))) goto nomem;
  for (size_t i = 0; i < job.n_items; i++) {
    const create_item_t *it = &job.items[i];
    if (defs[it->def].replace && FPS__MESSAGE_OVERHEAD + item_bytes(&job, it) > job.budget) {
      rc = fps__status_err(status, FPS_EINVAL, it->shard,
                           "%s: a replace must travel in one message, and its %llu bytes pass "
                           "max_message_bytes (%llu); raise it (up to the shards' --max-message-bytes)",
                           item_label(&job, it, label, sizeof label),
                           (unsigned long long)item_bytes(&job, it), (unsigned long long)job.budget);
      goto fail;
    }
  }
  for (size_t s = 0; s < c->n_shards; s++) {
    sh[s].s.shard = (int)s;
    sh[s].s.ops = &create_ops;
    sh[s].s.ctx = &sh[s];
    sh[s].job = &job;
  }
  for (size_t i = 0; i < job.n_items; i++) sh[job.items[i].shard].n++;
  for (size_t s = 0; s < c->n_shards; s++) {
    size_t m = sh[s].n ? sh[s].n : 1;
    sh[s].defs = fps_calloc(m, sizeof *sh[s].defs);
    sh[s].msg_defs = fps_calloc(SEGS * m, sizeof *sh[s].msg_defs);
    sh[s].tc = fps_calloc(SEGS * m, sizeof *sh[s].tc);
    sh[s].tcp = fps_calloc(SEGS * m, sizeof *sh[s].tcp);
    sh[s].init = fps_calloc(SEGS * m, sizeof *sh[s].init);
    sh[s].state = fps_calloc(SEGS * m, sizeof *sh[s].state);
    sh[s].statep = fps_calloc(SEGS * m, sizeof *sh[s].statep);
    if (!sh[s].defs || !sh[s].msg_defs || !sh[s].tc || !sh[s].tcp || !sh[s].init || !sh[s].state ||
        !sh[s].statep)
      goto nomem;
    sh[s].n = 0;
  }
  for (size_t i = 0; i < job.n_items; i++) {
    create_shard_t *x = &sh[job.items[i].shard];
    x->defs[x->n++] = i;
  }
  long dup = fps__tensor_list_sort(&list);
  if (dup >= 0) {
    rc = fps__status_err(status, FPS_EINVAL, -1, "tensor '%s' is listed twice",
                         list.t[dup].name);
    goto fail;
  }
  /* The list is valid: it becomes the client's, whatever the shards say. */
  pthread_rwlock_wrlock(&c->lock);
  fps__tensor_list_free(&c->tensors);
  c->tensors = list;
  pthread_rwlock_unlock(&c->lock);
  list = (fps__tensor_list_t){0};

  if ((rc = run_rounds(c, sh, run, status))) goto fail;

  /* Wait for values another worker uploads. */
  double end = fps__now() + c->opts.deadline_seconds, wait = 0.01;
  for (;;) {
    const create_item_t *missing = NULL;
    for (size_t s = 0; s < c->n_shards; s++) {
      size_t k = 0;
      for (size_t j = 0; j < sh[s].n; j++)
        if (!job.ready[sh[s].defs[j]]) sh[s].defs[k++] = sh[s].defs[j];
      if (k && !missing) missing = &job.items[sh[s].defs[0]];
      sh[s].n = k;
      sh[s].pos = sh[s].off = 0;
      sh[s].seg = 0;
      sh[s].poll = 1;
    }
    if (!missing) break;
    if (fps__now() + wait > end) {
      rc = fps__status_set(status, FPS_CODE_DEADLINE_EXCEEDED, missing->shard,
                           "shard %d (%s): %s got no initial values within %g s (no worker "
                           "supplied init?)",
                           missing->shard, c->addrs[missing->shard],
                           item_label(&job, missing, label, sizeof label), c->opts.deadline_seconds);
      goto fail;
    }
    sleep_s(wait);
    wait = wait * 2 > 0.25 ? 0.25 : wait * 2;
    if ((rc = run_rounds(c, sh, run, status))) goto fail;
  }
  rc = 0;
  fps__status_ok(status);
  goto done;

nomem:
  rc = fps__status_err(status, FPS_ENOMEM, -1, "out of memory creating tensors");
fail:
done:
  if (sh)
    for (size_t s = 0; s < c->n_shards; s++) {
      fps_free(sh[s].defs);
      fps_free(sh[s].msg_defs);
      fps_free(sh[s].tc);
      fps_free(sh[s].tcp);
      fps_free(sh[s].init);
      fps_free(sh[s].state);
      fps_free(sh[s].statep);
    }
  fps_free(sh);
  fps_free(run);
  fps_free(numel);
  fps_free(job.items);
  fps_free(job.splits);
  fps_free(job.bounds);
  fps_free(job.block_shards);
  fps_free(job.cfg);
  fps_free(job.ready);
  fps__tensor_list_free(&list);
  return rc;
}
