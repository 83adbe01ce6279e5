/* Create: registers tensors, idempotently, and fills their initial values
 * from sliced `init` data (see TensorCreate in the proto). The rules
 * (create-or-match, init coverage, limits) are the core's
 * (shard/create.c); this handler decodes the request, checks what only the
 * wire can get wrong, and encodes the reply. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "auth.h"
#include "checkpoint.h"
#include "metrics.h"
#include "replica.h"
#include "replica_send.h"
#include "wire.h"

typedef struct fps_create_call_s {
  fps_call_t base;
  grpc_byte_buffer *reply;    /* packed, waiting for the standby's ack */
} fps_create_call_t;

static void fps__create_destroy(fps_call_t *c) {
  fps_create_call_t *cc = (fps_create_call_t *)c;
  if (cc->reply) grpc_byte_buffer_destroy(cc->reply);
  fps_free(c);
}

/* The standby has the Create's tensors (replica.h): answer now. */
static void fps__create_acked(void *arg, int err, const char *why) {
  fps_create_call_t *cc = arg;
  grpc_byte_buffer *bb = cc->reply;
  cc->reply = NULL;
  if (err < 0) {
    grpc_byte_buffer_destroy(bb);
    fps_call_error(&cc->base, err, "Create: %s", why ? why : "the standby was lost");
    return;
  }
  fps_call_send(&cc->base, bb, true); /* final: on failure the call is already released */
}

/* An init slice with nothing in it at all is no init (proto3 default). */
static bool fps__init_empty(const Factorps__V1__TensorSlice *s) {
  return !s || (s->data.len == 0 && s->n_shape == 0 && (!s->name || !*s->name));
}

static void fps__create_run(fps_create_call_t *cc, const Factorps__V1__CreateRequest *req) {
  fps_server_t *srv = cc->base.srv;
  char why[FPS_WHY_MAX] = "";
  int rc = 0;
  size_t n = req->n_tensors;
  /* replace overwrites a tensor's history: an administrator's call. */
  for (size_t i = 0; i < n; i++) {
    if (!req->tensors[i]->replace) continue;
    fps_ident_t id;
    fps_auth_call_ident(&cc->base, &id);
    char what[FPS_TENSOR_NAME_MAX + 64];
    snprintf(what, sizeof what, "Create of tensor '%s' with replace", req->tensors[i]->name ? req->tensors[i]->name : "");
    if ((rc = fps_auth_allow(&id, FPS_ROLE_ADMIN, what, why, sizeof why)) < 0) {
      fps_call_error(&cc->base, rc, "%s", why);
      return;
    }
    break;
  }
  char job[FPS_CKPT_JOB_MAX + 1] = "";
  uint8_t *reply_buf = NULL;
  fps_tensor_t **ts = NULL; /* the tensors the answer waits on (standby) */
  uint64_t *vs = NULL;      /* the versions it reports of them */
  bool *changed = NULL;     /* those this Create wrote */
  size_t reply_cap = 0;
  fps_create_item_t *items = fps_calloc(n ? n : 1, sizeof *items);
  fps_slice_t *inits = fps_calloc(n ? n : 1, sizeof *inits);
  fps_create_info_t *out = fps_calloc(n ? n : 1, sizeof *out);
  Factorps__V1__TensorInfo *info = fps_calloc(n ? n : 1, sizeof *info);
  Factorps__V1__TensorInfo **infop = fps_calloc(n ? n : 1, sizeof *infop);
  size_t nstate = 0;
  for (size_t i = 0; i < n; i++) nstate += req->tensors[i]->n_init_state;
  fps_state_slice_t *state_base = fps_calloc(nstate ? nstate : 1, sizeof *state_base), *states = state_base;
  fps_split_map_t *maps = fps_calloc(n ? n : 1, sizeof *maps);
  if (!items || !inits || !out || !info || !infop || !state_base || !maps) {
    rc = FPS_ENOMEM;
    snprintf(why, sizeof why, "Create: out of memory for %zu tensors", n);
    goto done;
  }
  /* What the core cannot see: the settings as protobuf, an init slice that
   * names another tensor. Name and shape come first, so a bad item is
   * reported for its most basic problem. */
  for (size_t i = 0; i < n && rc == 0; i++) {
    const Factorps__V1__TensorCreate *tc = req->tensors[i];
    const char *name = tc->name ? tc->name : "";
    fps_shape_t shape;
    uint64_t numel;
    items[i].name = name;
    items[i].dims = tc->shape;
    items[i].ndim = tc->n_shape;
    if ((rc = fps_shard_name_check(name, why, sizeof why)) < 0) break;
    if ((rc = fps_shard_shape_check(name, tc->shape, tc->n_shape, &shape, &numel, why, sizeof why)) < 0) break;
    if (tc->split) {
      /* A row block of a split tensor: the core checks the map. */
      const Factorps__V1__SplitBlock *sb = tc->split;
      maps[i] = (fps_split_map_t){.block_index = sb->block_index,
                                  .bounds = sb->bounds,
                                  .n_bounds = sb->n_bounds,
                                  .block_shards = sb->block_shards,
                                  .n_block_shards = sb->n_block_shards,
                                  .shard_count = sb->shard_count};
      items[i].split = &maps[i];
    }
    if ((rc = fps_wire_hparams(name, tc->optimizer, &items[i].hp, why, sizeof why)) < 0) break;
    items[i].step = tc->step;
    items[i].rms = tc->rms;
    items[i].replace = tc->replace;
    items[i].state = states;
    items[i].n_state = tc->n_init_state;
    for (size_t j = 0; j < tc->n_init_state && rc == 0; j++) {
      const Factorps__V1__StateSlice *ss = tc->init_state[j];
      if (ss->name && *ss->name && strcmp(ss->name, name) != 0) {
        rc = FPS_EINVAL;
        snprintf(why, sizeof why, "tensor '%s': init_state slice names a different tensor '%.64s'", name, ss->name);
        break;
      }
      int k = (int)ss->kind - 1; /* StateKind: ROW = 1 .. MOM = 4 */
      states->kind = k >= 0 && k < FPS_STATE_KINDS ? k : -1;
      states->offset = ss->offset;
      states->data = ss->data.data;
      states->len = ss->data.len;
      states++;
    }
    if (rc < 0) break;
    const Factorps__V1__TensorSlice *s = tc->init;
    if (fps__init_empty(s)) continue;
    if (s->name && *s->name && strcmp(s->name, name) != 0) {
      rc = FPS_EINVAL;
      snprintf(why, sizeof why, "tensor '%s': init slice names a different tensor '%.64s'", name, s->name);
      break;
    }
    fps_wire_slice_view(s, &inits[i]);
    items[i].init = &inits[i];
  }
  if (rc < 0) goto done;
  /* The reply's bytes, reserved before the shard changes: a TensorInfo is
   * its name plus at most 40 bytes of tags, lengths and varints. */
  reply_cap = 16 + FPS_CKPT_JOB_MAX + 4;
  for (size_t i = 0; i < n; i++) reply_cap += strlen(items[i].name) + 48;
  /* The standby's wait list too: nothing may fail for memory once the
   * shard has changed (the allocation sweep checks it). */
  if (!(reply_buf = fps_malloc(reply_cap)) || !(ts = fps_malloc((n ? n : 1) * sizeof *ts)) ||
      !(vs = fps_malloc((n ? n : 1) * sizeof *vs)) || !(changed = fps_malloc((n ? n : 1) * sizeof *changed))) {
    rc = FPS_ENOMEM;
    snprintf(why, sizeof why, "Create: out of memory for the reply");
    goto done;
  }
  /* The job before any tensor: another job's Create creates nothing. */
  if ((rc = fps_shard_job_claim(srv->shard, req->job_id, why, sizeof why)) < 0) goto done;
  fps_shard_job_get(srv->shard, job, sizeof job);
  uint64_t received = 0;
  rc = fps_shard_create(srv->shard, req->shard_id, req->shard_count, items, n, out, &received, why, sizeof why);
  if (rc < 0) goto done;
  fps_metrics_rpc_bytes(FPS_METRICS_CREATE, received, 0);
  for (size_t i = 0; i < n; i++) {
    factorps__v1__tensor_info__init(&info[i]);
    info[i].name = (char *)fps_tensor_name(out[i].t);
    info[i].version = out[i].version;
    info[i].ready = out[i].ready;
    info[i].initialised_elements = out[i].initialised;
    info[i].created = out[i].created;
    infop[i] = &info[i];
  }

done:
  if (rc == 0) {
    Factorps__V1__CreateResponse resp = FACTORPS__V1__CREATE_RESPONSE__INIT;
    resp.n_tensors = n;
    resp.tensors = infop;
    resp.job_id = job;
    /* Names point into tensors, which are never freed while serving. */
    grpc_byte_buffer *bb = fps_pack_message_into(&resp, reply_buf, reply_cap);
    if (!bb) {
      fps_call_error(&cc->base, FPS_EINTERNAL, "Create: the reply outgrew its %zu reserved bytes", reply_cap);
    } else {
      reply_buf = NULL; /* the slice's now */
      /* With a joined standby, the answer waits until it has the
       * tensors this Create made or changed (replica.h). One that was
       * ready and stays as it was (every worker's Create after the
       * first) is covered by the image of its version already marked:
       * the model is not shipped again per worker. One still
       * initialising names no version: a later image must bring it. */
      for (size_t i = 0; i < n; i++) {
        ts[i] = out[i].t;
        vs[i] = out[i].ready ? out[i].version : FPS_RSEND_UNNAMED;
        changed[i] = out[i].changed;
      }
      cc->reply = bb;
      int wr = fps_replica_ack_wait(srv->replica, ts, vs, changed, n, NULL, fps__create_acked, cc, why, sizeof why);
      if (wr == 0) {
        cc->reply = NULL;
        fps_call_send(&cc->base, bb, true); /* final: on failure the call is already released */
      } else if (wr != FPS_EAGAIN) {
        cc->reply = NULL;
        grpc_byte_buffer_destroy(bb);
        fps_call_error(&cc->base, wr, "Create: %s", wr == FPS_ENOMEM ? "out of memory waiting for the standby" : why);
      }
    }
  } else {
    fps_call_error(&cc->base, rc, "%s", why);
  }
  fps_free(reply_buf);
  fps_free(ts);
  fps_free(vs);
  fps_free(changed);
  fps_free(items);
  fps_free(state_base);
  fps_free(maps);
  fps_free(inits);
  fps_free(out);
  fps_free(info);
  fps_free(infop);
}

void fps_rpc_create_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                          grpc_metadata_array *md, grpc_byte_buffer *payload) {
  fps_call_t *c;
  uint64_t held;
  Factorps__V1__CreateRequest *req = fps_call_start_unary(srv, call, deadline, md, payload, sizeof(fps_create_call_t),
      fps__create_destroy, NULL, "Create", &factorps__v1__create_request__descriptor, &c, &held);
  if (!req) return;
  fps__create_run((fps_create_call_t *)c, req);
  fps_wire_request_free(&srv->decode, &req->base, held);
}
