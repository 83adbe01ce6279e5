/* libfactorps internals: the client object, the tensor list and placement,
 * the streaming call engine, and the wire decoder. Nothing here is
 * installed; gRPC and protobuf-c types stay behind this header. */
#ifndef FPS_CLIENT_INTERNAL_H
#define FPS_CLIENT_INTERNAL_H

#include <grpc/grpc.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "factorps/client.h"
#include "wire_codec.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "libfactorps sends host floats as the wire's little-endian bytes: little-endian hosts only"
#endif

/* Method paths of factorps.v1.ParameterServer. */
#define FPS__METHOD_CREATE "/factorps.v1.ParameterServer/Create"
#define FPS__METHOD_PUSHPULL "/factorps.v1.ParameterServer/PushPull"
#define FPS__METHOD_PULL "/factorps.v1.ParameterServer/Pull"
#define FPS__METHOD_STATS "/factorps.v1.ParameterServer/Stats"
#define FPS__METHOD_CHECKPOINT "/factorps.v1.ParameterServer/Checkpoint"
#define FPS__METHOD_GETSTATE "/factorps.v1.ParameterServer/GetState"

/* Upper bound of the protobuf framing around one TensorSlice besides its
 * name and shape (tags, length prefixes, dtype, offset), and around one
 * request message (worker id, step, flags). Conservative: every varint is
 * counted at its 10-byte maximum. */
#define FPS__SLICE_OVERHEAD 64
#define FPS__MESSAGE_OVERHEAD 64

/* One row block of a tensor (fps__placement_split). */
typedef struct fps__block_s {
  int shard;
  uint64_t row_lo, row_hi;             /* flattened rows of [..., R, C]; elements for ndim <= 1 */
} fps__block_t;

/* One tensor of the client's list. */
typedef struct fps__tensor_s {
  char *name;                          /* owned */
  uint32_t ndim;
  uint64_t shape[FPS_CLIENT_MAX_DIMS];
  uint64_t numel;
  uint64_t bytes;                      /* numel * 4 */
  int shard;                           /* placement (a split tensor: its first block's) */
  size_t n_blocks;                     /* fps__placement_split: 1, or its row blocks */
  fps__block_t *blocks;                /* a split tensor's n_blocks blocks in row order
                                          (owned), or NULL: whole on `shard` */
} fps__tensor_t;

/* Elements per row of a tensor's [..., R, C] view: C, or 1 for ndim <= 1
 * (whose "rows" are its elements). */
static inline uint64_t fps__row_elems(const fps__tensor_t *t) {
  return t->ndim >= 2 ? t->shape[t->ndim - 1] : 1;
}
/* Blocks of a tensor in the client's list (1 for a whole one). */
static inline size_t fps__block_count(const fps__tensor_t *t) { return t->blocks ? t->n_blocks : 1; }
/* Block k of a tensor; a whole tensor's only block is all of its rows. */
static inline fps__block_t fps__block_at(const fps__tensor_t *t, size_t k) {
  if (t->blocks) return t->blocks[k];
  return (fps__block_t){.shard = t->shard, .row_lo = 0, .row_hi = t->numel / fps__row_elems(t)};
}

/* The tensor list, sorted by name for lookup. */
typedef struct fps__tensor_list_s {
  fps__tensor_t *t;                    /* owned, sorted by strcmp(name) */
  size_t n;
} fps__tensor_list_t;

/* One process serving a shard: the shard's primary or a standby. */
typedef struct fps__replica_s {
  char *addr;                          /* owned "host:port" */
  grpc_channel *channel;               /* chan_mu */
  double failing_since;                /* first seen in TRANSIENT_FAILURE, 0 (chan_mu) */
} fps__replica_t;

/* A shard's replicas, in the order its address entry lists them. */
typedef struct fps__shard_conn_s {
  size_t n;                            /* 1..FPS_CLIENT_MAX_REPLICAS */
  fps__replica_t r[FPS_CLIENT_MAX_REPLICAS];
  atomic_int current;                  /* the replica that answered last: calls start there */
} fps__shard_conn_t;

struct fps_client_s {
  size_t n_shards;
  char **addrs;                        /* owned copies of the entries, n_shards */
  fps__shard_conn_t *shards;           /* n_shards */
  pthread_mutex_t chan_mu;             /* guards the replicas' channel and failing_since */
  grpc_channel_credentials *creds;     /* kept to renew a channel */
  grpc_arg chan_args[7];               /* kept to renew a channel */
  grpc_channel_args chan_ca;
  char *server_name;                   /* owned copy of tls_server_name, or NULL */
  fps_client_options_t opts;           /* string members point to copies below */
  char *auth_header;                   /* "Bearer <token>" or NULL */
  char job_id[72];                     /* opts.job_id's copy, "" = none */
  int tls;                             /* channels use TLS (for error hints) */
  pthread_rwlock_t lock;               /* guards `tensors` */
  fps__tensor_list_t tensors;
};

/* ---- channels (client.c) ---- */

/* The connectivity state of the channel to replica `replica` of shard
 * `shard` (try_to_connect set). A channel that has been in
 * TRANSIENT_FAILURE for a while is replaced by a new one first: gRPC 1.51
 * keeps a channel whose shard went away failing for seconds after the
 * shard is back (measured here: 5 s to 127.0.0.1, 10 s to localhost) while
 * a new channel connects at once. REQUIRES c->chan_mu. */
grpc_connectivity_state fps__channel_state_locked(fps_client_t *c, int shard, int replica);

/* Splits a shard's address entry at '|' into its replicas' addresses
 * (copies into r[].addr, n set). Returns 0, or INVALID_ARGUMENT via `st`
 * naming the entry (an empty part, more than FPS_CLIENT_MAX_REPLICAS, a replica
 * listed twice), or RESOURCE_EXHAUSTED. On failure nothing is left
 * allocated. */
int fps__shard_conn_parse(fps__shard_conn_t *sc, size_t shard, const char *entry, fps_status_t *st);

/* ---- status helpers (status.c), time (client.c) ---- */

/* Fills `st` (may be NULL) and returns `code`. `shard` -1 for none. */
int fps__status_set(fps_status_t *st, int code, int shard, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void fps__status_ok(fps_status_t *st);
/* The library's own failure: fills `st` with the code of FPS_E* `err`
 * (fps__code_from_err: the one translation) and returns that code. */
int fps__status_err(fps_status_t *st, int err, int shard, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
int fps__code_from_err(int err);
/* Seconds since an arbitrary fixed point (CLOCK_MONOTONIC). */
double fps__now(void);
/* The absolute deadline of a call starting now. */
gpr_timespec fps__deadline_after(double seconds);

/* ---- tensor list and placement (placement.c) ---- */

/* Checks a name: 1..FPS_CLIENT_NAME_MAX bytes, no NUL inside. */
int fps__name_valid(const char *name);
/* numel of a shape; 0 (with a message in `err`) if a dim is 0 or the
 * product exceeds the client's limit. */
uint64_t fps__shape_numel(uint32_t ndim, const uint64_t *shape, char *err, size_t errlen);
/* Computes the placement of `n` tensors (name, bytes set; shard is written)
 * on `n_shards` shards as documented in client.h. `load` (n_shards entries,
 * may be NULL) gets each shard's byte total. Returns 0 or FPS_ENOMEM. */
int fps__placement_compute(fps__tensor_t *t, size_t n, size_t n_shards, uint64_t *load);
/* Most shards the split placement handles (its scratch is per shard). */
#define FPS__SPLIT_MAX_SHARDS 65536
/* The row-split placement documented in client.h (fps_client_placement_plan)
 * of `n` tensors (name, ndim, shape, numel, bytes set; shard and n_blocks
 * written): blocks (room for n + (n_shards - 1) * the number of tensors of
 * at least split_min_bytes) gets every tensor's blocks in
 * row order, tensor i's at [first[i], first[i + 1]) (first: n + 1
 * entries). split_min_bytes 0 never splits (then the shards equal
 * fps__placement_compute's). load (may be NULL) gets each shard's bytes.
 * Returns 0, FPS_EINVAL (n_shards 0 or > FPS__SPLIT_MAX_SHARDS), FPS_ENOMEM. */
int fps__placement_split(fps__tensor_t *t, size_t n, size_t n_shards, uint64_t split_min_bytes,
                         fps__block_t *blocks, size_t *first, uint64_t *load);
/* Sorts a list by name and rejects duplicates (returns the index of the
 * first duplicate, or -1). */
long fps__tensor_list_sort(fps__tensor_list_t *l);
/* Binary search by name; NULL if absent. */
const fps__tensor_t *fps__tensor_list_find(const fps__tensor_list_t *l, const char *name);
void fps__tensor_list_free(fps__tensor_list_t *l);

/* ---- the call engine (call.c) ---- */

typedef struct fps__stream_s fps__stream_t;

/* What a stream does; the engine does the gRPC part. Callbacks run on the
 * thread that called fps__streams_run(), one at a time. */
typedef struct fps__stream_ops_s {
  /* Builds the next request message into `*out` (a byte buffer the engine
   * takes over) and sets `*last` when it is the final one. Returns 0, or a
   * status code after filling s->code/s->msg via fps__stream_fail(). */
  int (*next)(fps__stream_t *s, grpc_byte_buffer **out, int *last);
  /* Consumes one response message. Returns 0 or a status code (after
   * fps__stream_fail()); the engine then cancels the call. */
  int (*on_message)(fps__stream_t *s, const uint8_t *data, size_t len);
  /* Rewinds the producer and the consumer for a retry. May be NULL when the
   * stream is never retried after it started. */
  void (*reset)(fps__stream_t *s);
  /* Instead of on_message (which is then NULL): consumes one response
   * message in the buffers gRPC received it in (spans[0..n), valid during
   * the call only), so it can be decoded without gathering it first. */
  int (*on_spans)(fps__stream_t *s, const fps_wspan_t *spans, size_t n);
} fps__stream_ops_t;

/* When a failed attempt may be repeated. */
typedef enum fps__retry_e {
  FPS__RETRY_IDEMPOTENT = 1,  /* any UNAVAILABLE (Create, Pull, Stats, Checkpoint) */
  FPS__RETRY_UNSENT = 2,      /* only if the call never started (PushPull) */
} fps__retry_t;

struct fps__stream_s {
  int shard;                          /* index into the client's shards */
  /* The replica of the shard the last attempt went to (set by the engine:
   * the shard's current one first, the next one after an UNAVAILABLE). */
  int replica;
  int attempts;                       /* failed attempts so far (engine state) */
  const fps__stream_ops_t *ops;
  void *ctx;                          /* the owner's state */
  /* Another stream to the same shard whose request this one follows: the
   * engine sends nothing of this one (opens no call) until `after` has
   * handed its last message to gRPC or ended, so that the shard gets the
   * calls' requests one after the other, each whole as early as possible,
   * instead of all of them interleaved and all late. Never waits for a
   * reply, so sync rounds spread over several calls cannot deadlock. NULL:
   * start at once (also when `after` is not part of the run). */
  struct fps__stream_s *after;
  /* Outcome, valid after fps__streams_run(). */
  int code;                           /* fps_code_t */
  char msg[FPS_STATUS_MESSAGE_MAX];
  /* Engine state. */
  struct fps__stream_engine_s *e;     /* owned by the engine during a run */
};

/* Runs the streams (each against its own shard, all in parallel) to
 * completion: the gRPC status, or a local failure, lands in each stream's
 * code/msg. Retries per `retry` and the client's options, all within one
 * deadline of opts.deadline_seconds: on the shard's next replica at once,
 * with backoff after each round over all of them (max_retries rounds), and
 * none once any stream failed otherwise than UNAVAILABLE (the call fails
 * anyway). Fills `st` with the first failing stream by shard index (one
 * failing otherwise than UNAVAILABLE first) and returns its code, or 0. */
int fps__streams_run(fps_client_t *c, const char *method, fps__stream_t *const *streams, size_t n,
                     fps__retry_t retry, fps_status_t *st);
/* Records a local failure of a stream; returns `code`. */
int fps__stream_fail(fps__stream_t *s, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Packs a protobuf-c message into a fresh gRPC byte buffer. */
grpc_byte_buffer *fps__pack(const void *protobuf_c_message);
/* protobuf-c's allocations through the library's fps_malloc: decode
 * replies with fps__unpack and free them with *_free_unpacked(m,
 * &fps__pb_allocator). */
extern struct ProtobufCAllocator fps__pb_allocator;
/* Decodes a reply (descriptor: a ProtobufCMessageDescriptor *). NULL with
 * *code RESOURCE_EXHAUSTED (out of memory) or INTERNAL (malformed);
 * fps__unpack_why(*code) words it ("malformed", "out of memory
 * decoding"). */
void *fps__unpack(const void *descriptor, const uint8_t *data, size_t len, int *code);
const char *fps__unpack_why(int code);

/* ---- wire decoding of PushPullResponse / PullResponse (wire.c) ---- */

/* Longest version name passed to on_version in full (longer: cut). */
#define FPS__WIRE_NAME_MAX 512

typedef struct fps__wire_sink_s {
  /* Each returns 0, or nonzero to stop (after recording an error). The
   * slice's windows (name, data) point into the message's buffers. */
  int (*on_slice)(void *ctx, const fps_wire_tslice_t *sl);
  int (*on_version)(void *ctx, const char *name, size_t name_len, uint64_t version);
  void *ctx;
} fps__wire_sink_t;

/* Decodes a PushPullResponse or PullResponse (same layout: params = 1,
 * versions = 2) from the buffers spans[0..n) without copying tensor data.
 * Unknown fields are skipped. Returns 0, FPS_EPROTO on malformed input
 * (with a reason in `err`), or the sink's nonzero value. */
int fps__wire_parse_params(const fps_wspan_t *spans, size_t n, const fps__wire_sink_t *sink, char *err,
                           size_t errlen);

/* Encoding of PushPullRequest without copying gradient data: the request
 * becomes a byte buffer of small header slices (fps_wire_slice_header())
 * interleaved with slices that point straight at the caller's floats (see
 * push_pull.c). */

/* Most bytes fps__wire_tensor_push() writes for a name of `name_len`. */
#define FPS__WIRE_TENSOR_PUSH_MAX(name_len) (56 + (name_len))
/* Writes a PushPullRequest.TensorPush as field `field` (name and the
 * present settings of tp). Returns the bytes written. */
size_t fps__wire_tensor_push(uint8_t *buf, unsigned field, const char *name, size_t name_len,
                             const fps_tensor_push_t *tp);

/* ---- optimizer settings (optim.c) ---- */

/* Fills a wire AdafactorConfig (Factorps__V1__AdafactorConfig *) from the
 * public settings. Returns 0, or FPS_EHPARAM (a value that is not finite)
 * or FPS_EFLAVOR with a reason in `err`. */
int fps__optim_to_wire(const fps_optim_config_t *in, void *wire_cfg, char *err, size_t errlen);

#endif
