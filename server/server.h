/* factorps-server: the one map of the shard process (after redis server.h).
 *
 * A shard keeps named fp32 tensors with their Adafactor state and serves
 * factorps.v1.ParameterServer over gRPC (C core). Three layers, arrows
 * downward only (README "Layout"):
 *
 *   RPC handlers  one file per method: decode the request, call the core,
 *                 encode the reply, translate FPS_E* in status.c's table
 *     rpc_create.c rpc_pushpull.c rpc_pull.c rpc_stats.c rpc_checkpoint.c
 *     rpc_getstate.c rpc_exchange.c
 *     wire.c      protobuf-c <-> core types (hyperparameters, slices)
 *     reply.c     streams tensor snapshots back as size-bounded messages
 *     status.c    the one FPS_E* -> gRPC status table
 *   transport     gRPC only, in two halves around the handlers:
 *     grpc_server.c  (above them) completion queue, poller threads,
 *                 request slots, admission, the method table that starts
 *                 the handlers, start/stop
 *     auth.c      TLS credentials, bearer tokens (call limit: grpc_server.c)
 *     peer.c      the calling side of Exchange: channels to the other
 *                 shards (--peers), the core's sender (fps_xsend_fn)
 *     call.c      (below them) the call object every handler uses:
 *                 begin/recv/send/fail, unpack/pack, the live-call list
 *   shard core    shard/shard.h (its face; shard/internal.h its inside, with
 *                 a map of its files): tensors, store rules, the one
 *                 apply-and-snapshot path, sync rounds, ssp waits,
 *                 checkpoints; no gRPC, no protobuf-c (library fps_shard)
 *   below them    clock.c (fps_now_ns), timer.c (the deadline thread and its
 *                 hooks), common/ (kernels, Adafactor, dtype, checkpoint
 *                 format), metrics/ (the registry and /metrics)
 *
 *   main.c        start-up, signal wait, orderly shutdown
 *   config.c      fps_config_t and its table (flags, FACTORPS_* env, --help)
 *
 * Threads: T pollers run grpc_completion_queue_next() and every handler
 * step (handlers never sleep: a sync round or an ssp wait leaves its call
 * with no batch in flight, and whoever completes the round resumes it
 * through the push's done callback); one timer thread (timer.c) runs the
 * hooks that expire rounds, ssp waits and calls past their deadline; with
 * --peers, the peers' thread takes Exchange completions and retries; the
 * kernel pool updates large tensors; the checkpoint thread writes every
 * interval; libuv's thread serves /metrics; the main thread waits for
 * SIGTERM/SIGINT and shuts down.
 *
 * Locks, in acquisition order (never the reverse): the core's (shard.h:
 * store->mu -> tensor->mu -> ssp_mu -> push->mu -> rounds_mu) -> call->mu
 * -> srv->calls_mu. A push's done callback runs with no core lock held. */
#ifndef FPS_SERVER_H
#define FPS_SERVER_H

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <grpc/grpc.h>
#include <protobuf-c/protobuf-c.h>

#include "clock.h"
#include "log.h"
#include "methods.h"
#include "shard/shard.h"
#include "status.h"
#include "timer.h"

/* Payload budget of one reply message: a little under gRPC's default 4 MiB
 * receive limit, so a client that never raised its limit still works. */
#define FPS_REPLY_BUDGET ((size_t)FPS_MESSAGE_BYTES_DEFAULT - 4096)

/* ------------------------------------------------------------- config */

typedef struct fps_config_s {
  char *listen;               /* host:port, port 0 picks a free one */
  uint32_t shard_id;          /* this shard's index */
  uint32_t shard_count;       /* shards in the job */
  int mode;                   /* fps_mode_t */
  uint32_t staleness;         /* ssp: max steps ahead of the slowest worker */
  uint32_t workers;           /* sync/ssp: number of workers W */
  double deadline;            /* seconds: default call deadline and sync round deadline */
  uint64_t max_message_bytes; /* gRPC receive limit per message */
  uint32_t threads;           /* completion-queue poller threads */
  char *port_file;            /* written with the bound port, or NULL */
  uint64_t max_tensors;       /* Create beyond this: RESOURCE_EXHAUSTED */
  uint64_t max_bytes;         /* parameter bytes beyond this: RESOURCE_EXHAUSTED */
  uint64_t max_staging_bytes; /* gradient staging + reply snapshots, all calls */
  uint64_t max_decode_bytes;  /* requests being decoded and handled, all calls (wire.h) */
  uint32_t max_concurrent_calls; /* calls in progress; more: RESOURCE_EXHAUSTED */
  uint32_t max_streams_per_connection; /* HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS */
  char *tls_cert;             /* PEM chain, "" = plaintext (auth.c) */
  char *tls_key;              /* PEM key of tls_cert */
  char *tls_client_ca;        /* PEM CA: client certificates required, "" = none */
  int tls_client_roles;       /* 1: a client certificate's role URI limits its roles (auth.c) */
  char *auth_token_file;      /* workers' bearer tokens, one a line, "" = none */
  char *admin_token_file;     /* admins' tokens, "" = the workers' hold the role */
  char *exchange_token_file;  /* peers' "<shard-id>:<token>", "" = the workers' hold it */
  uint32_t apply_log;         /* per-tensor apply records kept for Stats */
  char *log_level;            /* error, warn, info, debug */
  char *simd;                 /* scalar|avx2|neon|auto */
  uint32_t kernel_threads;    /* pool size for large tensors' updates (0: CPUs) */
  int malloc_tune;            /* 1: one arena, no mmap threshold, no trim */
  int http2_bdp_probe;        /* 1: gRPC grows receive windows to its BDP estimate */
  uint64_t http2_max_frame;   /* largest HTTP/2 frame the shard accepts, bytes (0: gRPC's 16 KiB) */
  char *metrics_listen;       /* HTTP /metrics /healthz /readyz host:port, "" = off */
  char *metrics_port_file;    /* written with the bound metrics port, or "" */
  char *checkpoint_dir;       /* durable checkpoints, "" = off */
  double checkpoint_interval; /* seconds between periodic checkpoints, 0 = off */
  uint32_t checkpoint_keep;   /* newest checkpoints kept */
  int require_checkpoint;     /* refuse to start without a loaded checkpoint */
  char *job_id;               /* the job served, "" = learnt (shard.h, job.c) */
  /* Shard to shard (peer.c): every shard's address by index ("" = none),
   * and the calling side's TLS and token for Exchange calls. */
  char *peers;
  char *peer_tls_ca;          /* PEM CA of the peers' certificates, "" = plaintext */
  char *peer_tls_cert;        /* PEM client certificate shown to peers, "" = none */
  char *peer_tls_key;         /* its key */
  char *peer_tls_server_name; /* name the peers' certificates carry, "" = the host */
  char *peer_token_file;      /* bearer token sent to peers, "" = none */
  double exchange_deadline;   /* seconds a step's exchange may take */
  /* Standby replicas (replica.h): the other replica of this shard ("" =
   * solo), the lease that makes one of them primary, its TTL (etcd), the
   * address clients are told for this process ("" = --listen). */
  char *replica_peer;
  char *lease;
  double lease_ttl;
  char *replica_advertise;
  uint32_t split_anchor_steps; /* a split block's anchor every N versions, 0: none */
} fps_config_t;

/* Fills defaults, then FACTORPS_* environment variables, then argv.
 * Returns 0; 1 if --help/--version was printed (exit 0); FPS_EINVAL with
 * the problem printed to stderr. Strings in *cfg are owned by cfg. */
int fps_config_load(fps_config_t *cfg, int argc, char **argv);
void fps_config_free(fps_config_t *cfg);
void fps_config_dump(const fps_config_t *cfg, void (*line)(const char *));
/* The core's options from the configuration (the same names). */
void fps_config_shard_opts(const fps_config_t *cfg, fps_shard_opts_t *out);

typedef struct fps_server_s fps_server_t;

/* -------------------------------------------------- gRPC call plumbing */

/* Every completion-queue tag starts with this: the poller calls fn. */
typedef struct fps_tag_s {
  void (*fn)(struct fps_tag_s *tag, bool ok);
} fps_tag_t;

typedef struct fps_call_s fps_call_t;

/* The base of every call: one batch in flight at a time (plus the
 * close-on-server op), refcounted by "logic" (until the status is sent)
 * and "close" (until RECV_CLOSE_ON_SERVER completes). */
struct fps_call_s {
  fps_tag_t batch_tag;        /* completion of the current batch */
  fps_tag_t close_tag;        /* completion of RECV_CLOSE_ON_SERVER */
  fps_tag_t status_tag;       /* completion of the batch that sent the status */
  fps_server_t *srv;
  grpc_call *call;
  const char *method;         /* for logs */
  pthread_mutex_t mu;         /* serialises start_batch and call state */
  atomic_int refs;
  int cancelled;              /* written by gRPC on close */
  bool closed;                /* close op completed */
  bool initial_md_sent;
  bool status_sent;           /* final batch started */
  atomic_bool cancel_requested; /* the timer already cancelled it (atomic: set
                                 * under calls_mu, read under mu) */
  bool metered;               /* counted in the metrics registry (once) */
  int64_t start_ns;
  int64_t deadline_ns;        /* min(client deadline, start + --deadline) */
  grpc_metadata_array md;     /* request metadata (owned) */
  grpc_byte_buffer *recv_buf; /* RECV_MESSAGE target / initial payload */
  grpc_slice status_details;
  /* Method hooks: next step after a batch (ok == false: the call is dead),
   * cancel notice, destructor of the derived object. */
  void (*on_batch)(fps_call_t *c, bool ok);
  void (*on_cancel)(fps_call_t *c);
  void (*destroy)(fps_call_t *c);
  fps_call_t *prev, *next;    /* srv->calls list */
};

/* Initialises the base and posts RECV_CLOSE_ON_SERVER. Takes ownership of
 * call and md. Returns 0 or a negative FPS_E*; on failure the caller frees c's
 * derived parts and the base is already released. */
int fps_call_begin(fps_call_t *c, fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                   grpc_metadata_array *md, const char *method);
/* The start of every unary handler (Create, Pull, Stats, Checkpoint):
 * allocates the handler's call state (`size` bytes, fps_call_t first,
 * zeroed), begins the call and decodes the request with `desc`. Returns the
 * request (free it with fps_wire_request_free(&srv->decode, req, *held):
 * its decoded size stays reserved in the shard's --max-decode-bytes until
 * then) and sets *out to the call; on failure the call has
 * been answered or cancelled and NULL is returned. Takes ownership of
 * call, md and payload in every case. */
void *fps_call_start_unary(fps_server_t *srv, grpc_call *call, gpr_timespec deadline,
                           grpc_metadata_array *md, grpc_byte_buffer *payload, size_t size,
                           void (*destroy)(fps_call_t *), void (*on_batch)(fps_call_t *, bool),
                           const char *method, const ProtobufCMessageDescriptor *desc,
                           fps_call_t **out, uint64_t *held);
/* Starts RECV_MESSAGE into c->recv_buf; on_batch runs on completion. */
int fps_call_recv(fps_call_t *c);
/* After a RECV_MESSAGE completed with no message: in gRPC's C core that is
 * the client's half-close OR the end of a call that was cancelled (client
 * gone, deadline, reset stream), and nothing in the completion tells them
 * apart. A batch started now fails on a cancelled call, so this sends the
 * initial metadata (the one op every reply needs anyway); on_batch runs
 * with ok == false if the call is dead. Returns 0, or FPS_ESTATE if the
 * initial metadata went out already (nothing to probe with). */
int fps_call_probe(fps_call_t *c);
/* Sends one message (ownership of msg passes); with final, OK status too.
 * A final send that fails releases the call's logic reference itself: the
 * caller must not touch c afterwards (a non-final failure leaves c to the
 * caller, who ends it with fps_call_error). */
int fps_call_send(fps_call_t *c, grpc_byte_buffer *msg, bool final);
/* Ends the call with the status that server/status.c gives err (a
 * negative FPS_E* code: the one translation) and a message; safe once per
 * call (a later end is ignored). */
void fps_call_error(fps_call_t *c, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void fps_call_errorv(fps_call_t *c, int err, const char *fmt, va_list ap);
/* Packs a protobuf-c message into a byte buffer (no extra copy). */
grpc_byte_buffer *fps_pack_message(const void *protobuf_c_message);
/* fps_pack_message into buf (fps_malloc'd, cap bytes), reserved before a
 * call changed anything, so that its reply cannot fail for memory after
 * it did. Takes ownership of buf on success; NULL (buf still the
 * caller's) when the message needs more than cap. */
grpc_byte_buffer *fps_pack_message_into(const void *protobuf_c_message, uint8_t *buf, size_t cap);
/* Flattens a received byte buffer (one copy), inflating a gzip/deflate
 * message on the way, never past `limit` bytes. Returns 0 (caller frees
 * *out), FPS_ELIMIT (larger than limit), FPS_EFORMAT (corrupt compressed
 * data), FPS_EUNSUPPORTED (other compression), FPS_ENOMEM, FPS_EPROTO;
 * fps_bb_flatten_why() words the failure for a status message. */
int fps_bb_flatten(grpc_byte_buffer *bb, uint64_t limit, uint8_t **out, size_t *len);
const char *fps_bb_flatten_why(int rc);

/* ---------------------------------------------------------- the server */

/* Bytes held by requests being decoded and handled, shard-wide: each
 * request reserves its decoded size (fps_wire_cost()) and its received
 * bytes before protobuf-c decodes it, and gives them back when the decoded
 * message is freed (wire.h). Shared by every poller thread: atomic. */
typedef struct fps_decode_budget_s {
  _Atomic uint64_t held;
  uint64_t limit;
} fps_decode_budget_t;

struct fps_server_s {
  fps_config_t cfg;
  fps_shard_t *shard;               /* the core: every rule and all state */
  struct fps_replica_s *replica;    /* standby replicas (replica.h); solo too */
  struct fps_auth_s *auth;          /* TLS and tokens with their roles (auth.c) */
  fps_timer_t *timer;               /* deadline thread (timer.c) */
  grpc_server *server;
  grpc_completion_queue *cq;
  void *method[FPS_METHOD_COUNT];   /* registered method handles */
  int port;
  atomic_bool shutting_down;
  fps_decode_budget_t decode;       /* --max-decode-bytes (wire.h) */
  /* Every batch is started under the read side; fps_grpc_stop takes the
   * write side to close it before shutting the queue down, since gRPC
   * aborts on a batch started after grpc_completion_queue_shutdown (a
   * call gRPC has already let go of can still get a cancel event). */
  pthread_rwlock_t batch_gate;
  bool batches_closed;              /* batch_gate */
  /* Active calls, for deadline enforcement and shutdown. */
  pthread_mutex_t calls_mu;
  fps_call_t *calls;
  uint64_t ncalls;
  struct fps_ckpt_queue_s *ckpt_q;  /* Checkpoint calls and their writer (rpc_checkpoint.c) */
};

/* grpc_server.c (fps_calls_* are call.c's) */
int fps_grpc_start(fps_server_t *srv);
/* Stops accepting, gives in-flight calls up to grace_s, cancels the rest. */
void fps_grpc_stop(fps_server_t *srv, double grace_s);
void fps_calls_link(fps_server_t *srv, fps_call_t *c);
void fps_calls_unlink(fps_server_t *srv, fps_call_t *c);
/* Timer hook (arg: the server): cancels calls past their deadline. */
void fps_calls_expire(void *srv, int64_t now_ns);

/* rpc_checkpoint.c: the thread that writes the checkpoints Checkpoint
 * calls ask for, off the pollers, one write for the calls queued while the
 * previous one ran. _init before fps_grpc_start (0 or FPS_ENOMEM); _stop
 * after fps_grpc_stop: finishes the write in progress, fails what is still
 * queued, joins. */
typedef struct fps_ckpt_queue_s fps_ckpt_queue_t;
int fps_rpc_checkpoint_init(fps_server_t *srv);
void fps_rpc_checkpoint_stop(fps_server_t *srv);

/* Method entry points, one per method of common/methods.h and generated
 * from it: fps_rpc_<handler>_start(srv, call, deadline, md[, payload]),
 * each taking ownership of call, md and payload; a method that reads its
 * own request stream gets no initial payload. */
#define FPS__RPC_START_0(handler)                                                            \
  void fps_rpc_##handler##_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline, \
                                 grpc_metadata_array *md, grpc_byte_buffer *payload);
#define FPS__RPC_START_1(handler)                                                            \
  void fps_rpc_##handler##_start(fps_server_t *srv, grpc_call *call, gpr_timespec deadline, \
                                 grpc_metadata_array *md);
#define FPS__RPC_START(id, name, handler, role, streaming) FPS__RPC_START_##streaming(handler)
FPS_METHOD_MAP(FPS__RPC_START)
#undef FPS__RPC_START
#undef FPS__RPC_START_0
#undef FPS__RPC_START_1

/* ------------------------------------------------------------- replies */

/* One tensor of a streamed reply. */
typedef struct fps_reply_item_s {
  fps_tensor_t *t;
  fps_snap_t *snap;           /* NULL: versions only */
  fps_snap_bf16_t *bf16;      /* bf16: the reply's hold on snap's shared
                               * encoding, NULL: none (yet) */
  uint64_t version;
  int dtype;                  /* wire dtype of the data */
} fps_reply_item_t;

typedef struct fps_reply_s {
  fps_reply_item_t *items;
  size_t n;
  size_t cur;                 /* next item to send */
  uint64_t off;               /* next element of items[cur] */
  bool pull;                  /* PullResponse vs PushPullResponse */
  bool done;
} fps_reply_t;

/* Packs the next reply message; *last is set when it carries the versions.
 * Returns NULL on OOM. */
grpc_byte_buffer *fps_reply_next(fps_reply_t *r, fps_server_t *srv, bool *last);
/* Drops the snapshots and the item array. */
void fps_reply_free(fps_reply_t *r);

#endif
