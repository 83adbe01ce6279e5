"""ctypes declarations of libfactorps (client/include/factorps/client.h).

This file mirrors the C header and nothing else: structs field by field in
the header's order (ctypes lays them out with the C ABI's alignment), and
each function's argument and result types. tests/python/test_layout.py
compiles the header and compares every struct's size and field offsets with
these, so a header change that this file missed fails a test instead of
corrupting memory.

The library is found, in this order (the first that loads wins):
1. $FACTORPS_LIB, a path to the .so (an error if it does not load);
2. a libfactorps.so* next to this package (what `pip install` copies in);
3. the build tree this package sits in (<repo>/build*/client/), newest first;
4. the system's library path (ctypes.util.find_library, then the soname).
"""

import ctypes
import ctypes.util
import glob
import os
import threading

from .errors import LibraryNotFoundError

MAX_DIMS = 8
STATUS_MESSAGE_MAX = 1024

FLAVOR_TORCH = 1
FLAVOR_HF = 2

c_float_p = ctypes.POINTER(ctypes.c_float)


class Status(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_int),
        ("shard", ctypes.c_int),
        ("message", ctypes.c_char * STATUS_MESSAGE_MAX),
    ]


class ClientOptions(ctypes.Structure):
    _fields_ = [
        ("deadline_seconds", ctypes.c_double),
        ("max_retries", ctypes.c_int),
        ("backoff_initial_seconds", ctypes.c_double),
        ("max_message_bytes", ctypes.c_uint64),
        ("tls_ca_file", ctypes.c_char_p),
        ("tls_cert_file", ctypes.c_char_p),
        ("tls_key_file", ctypes.c_char_p),
        ("auth_token", ctypes.c_char_p),
        ("tls_server_name", ctypes.c_char_p),
        ("wire_dtype", ctypes.c_int),  # 1 f32, 2 bf16 (FPS_WIRE_*)
        # Row splitting, 0 = never: connect(split_min_bytes=...).
        # Placement is computed by libfactorps, not here.
        ("split_min_bytes", ctypes.c_uint64),
        # Pushes as chunks of this many wire bytes per call, 0 =
        # one call per shard; fps_client_options_init() sets the default.
        ("push_chunk_bytes", ctypes.c_uint64),
        # The job's identity, sent with every Create: connect(job_id=...).
        ("job_id", ctypes.c_char_p),
    ]


class OptimConfig(ctypes.Structure):
    _fields_ = [
        ("flavor", ctypes.c_int),
        ("has_lr", ctypes.c_int), ("lr", ctypes.c_double),
        ("has_beta2_decay", ctypes.c_int), ("beta2_decay", ctypes.c_double),
        ("has_eps1", ctypes.c_int), ("eps1", ctypes.c_double),
        ("has_eps2", ctypes.c_int), ("eps2", ctypes.c_double),
        ("has_clip_threshold", ctypes.c_int), ("clip_threshold", ctypes.c_double),
        ("has_weight_decay", ctypes.c_int), ("weight_decay", ctypes.c_double),
        ("has_maximize", ctypes.c_int), ("maximize", ctypes.c_int),
        ("has_relative_step", ctypes.c_int), ("relative_step", ctypes.c_int),
        ("has_scale_parameter", ctypes.c_int), ("scale_parameter", ctypes.c_int),
        ("has_warmup_init", ctypes.c_int), ("warmup_init", ctypes.c_int),
        ("has_beta1", ctypes.c_int), ("beta1", ctypes.c_double),
    ]


class TensorDef(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("ndim", ctypes.c_uint32),
        ("shape", ctypes.c_uint64 * MAX_DIMS),
        ("optim", OptimConfig),
        ("init", c_float_p),
        ("step", ctypes.c_uint64),
        ("state_row", c_float_p),
        ("state_col", c_float_p),
        ("state_var", c_float_p),
        ("state_mom", c_float_p),
        ("rms", ctypes.c_double),
        ("replace", ctypes.c_int),
    ]


class ShardStats(ctypes.Structure):
    _fields_ = [
        ("shard_id", ctypes.c_uint32), ("shard_count", ctypes.c_uint32),
        ("mode", ctypes.c_char * 8),
        ("simd", ctypes.c_char * 16),
        ("tensors", ctypes.c_uint64), ("param_elements", ctypes.c_uint64),
        ("param_bytes", ctypes.c_uint64),
        ("state_row", ctypes.c_uint64), ("state_col", ctypes.c_uint64),
        ("state_var", ctypes.c_uint64), ("state_mom", ctypes.c_uint64),
        ("state_elements", ctypes.c_uint64), ("state_bytes", ctypes.c_uint64),
        ("adamw_elements", ctypes.c_uint64), ("adamw_bytes", ctypes.c_uint64),
        ("pushes", ctypes.c_uint64), ("push_errors", ctypes.c_uint64),
        ("updates", ctypes.c_uint64), ("bytes_received", ctypes.c_uint64),
        ("bytes_sent", ctypes.c_uint64),
        ("push_seconds_sum", ctypes.c_double), ("push_seconds_p50", ctypes.c_double),
        ("push_seconds_p99", ctypes.c_double),
        ("update_seconds_sum", ctypes.c_double),
        ("update_bytes", ctypes.c_uint64),
        ("uptime_seconds", ctypes.c_double),
        ("workers", ctypes.c_uint32), ("staleness", ctypes.c_uint32),
        ("version", ctypes.c_char * 32),
        ("split_blocks", ctypes.c_uint64), ("split_param_bytes", ctypes.c_uint64),
        ("exchange_sent_bytes", ctypes.c_uint64), ("exchange_received_bytes", ctypes.c_uint64),
        ("exchange_steps", ctypes.c_uint64), ("exchange_failures", ctypes.c_uint64),
        ("exchange_seconds_sum", ctypes.c_double),
        # Standby replicas: role "solo"/"primary"/"standby", lease term,
        # the other replica, whether a standby has joined, which of the
        # entry's replicas answered.
        ("replica_role", ctypes.c_char * 16),
        ("term", ctypes.c_uint64),
        ("replica_peer", ctypes.c_char * 256),
        ("standby_joined", ctypes.c_int),
        ("replica", ctypes.c_uint32),
        ("state_checksum", ctypes.c_uint64),  # hash over the tensors' checksums
    ]


NAME_MAX = 256


class ApplyRecord(ctypes.Structure):
    _fields_ = [
        ("worker_id", ctypes.c_uint32),
        ("step", ctypes.c_uint64),
        ("version", ctypes.c_uint64),
        ("lr", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
    ]


class TensorPush(ctypes.Structure):
    _fields_ = [
        ("has_lr", ctypes.c_int), ("lr", ctypes.c_double),
        ("has_weight_decay", ctypes.c_int), ("weight_decay", ctypes.c_double),
        ("no_grad", ctypes.c_int),
        ("has_step", ctypes.c_int), ("step", ctypes.c_uint64),
        ("skip_step", ctypes.c_int),
    ]


class TensorState(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint64),
        ("step", ctypes.c_uint64),
        ("rms", ctypes.c_double),
        ("lr", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("row_elements", ctypes.c_uint64),
        ("col_elements", ctypes.c_uint64),
        ("var_elements", ctypes.c_uint64),
        ("mom_elements", ctypes.c_uint64),
    ]


class PushArgs(ctypes.Structure):
    _fields_ = [
        ("worker_id", ctypes.c_uint32),
        ("num_workers", ctypes.c_uint32),
        ("step", ctypes.c_uint64),
        ("expect_mode", ctypes.c_int),
        ("push_id", ctypes.c_uint64),  # 0: libfactorps picks one
    ]


class TensorStats(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char * (NAME_MAX + 1)),
        ("shard", ctypes.c_int),
        ("ndim", ctypes.c_uint32),
        ("shape", ctypes.c_uint64 * MAX_DIMS),
        ("version", ctypes.c_uint64),
        ("ready", ctypes.c_int), ("factored", ctypes.c_int), ("flavor", ctypes.c_int),
        ("param_elements", ctypes.c_uint64), ("param_bytes", ctypes.c_uint64),
        ("state_row", ctypes.c_uint64), ("state_col", ctypes.c_uint64),
        ("state_var", ctypes.c_uint64), ("state_mom", ctypes.c_uint64),
        ("state_elements", ctypes.c_uint64), ("state_bytes", ctypes.c_uint64),
        ("adamw_elements", ctypes.c_uint64), ("adamw_bytes", ctypes.c_uint64),
        ("block_index", ctypes.c_uint32), ("n_blocks", ctypes.c_uint32),
        ("row_lo", ctypes.c_uint64), ("row_hi", ctypes.c_uint64),
        ("checksum", ctypes.c_uint64),  # params + optimizer state at `version`
    ]


CHECKPOINT_PATH_MAX = 4096


class CheckpointInfo(ctypes.Structure):
    _fields_ = [
        ("path", ctypes.c_char * CHECKPOINT_PATH_MAX),
        ("sequence", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("tensors", ctypes.c_uint64),
        ("seconds", ctypes.c_double),
    ]


# Every struct the binding shares with C, for the layout test.
class Block(ctypes.Structure):
    """fps_block_t: one row block of a placement plan."""
    _fields_ = [
        ("tensor", ctypes.c_size_t),
        ("shard", ctypes.c_int),
        ("row_lo", ctypes.c_uint64),
        ("row_hi", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
    ]


STRUCTS = {
    "fps_block_t": Block,
    "fps_status_t": Status,
    "fps_client_options_t": ClientOptions,
    "fps_optim_config_t": OptimConfig,
    "fps_tensor_def_t": TensorDef,
    "fps_shard_stats_t": ShardStats,
    "fps_apply_record_t": ApplyRecord,
    "fps_tensor_stats_t": TensorStats,
    "fps_checkpoint_info_t": CheckpointInfo,
    "fps_tensor_push_t": TensorPush,
    "fps_push_args_t": PushArgs,
    "fps_tensor_state_t": TensorState,
}

_P = ctypes.POINTER
_SIGNATURES = {
    "fps_client_options_init": (None, [_P(ClientOptions)]),
    "fps_client_create": (ctypes.c_void_p, [_P(ctypes.c_char_p), ctypes.c_size_t,
                                            _P(ClientOptions), _P(Status)]),
    "fps_client_destroy": (None, [ctypes.c_void_p]),
    "fps_client_create_tensors": (ctypes.c_int, [ctypes.c_void_p, _P(TensorDef), ctypes.c_size_t,
                                                 _P(Status)]),
    "fps_client_shard_of": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p]),
    "fps_client_push_pull": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64,
                                            _P(ctypes.c_char_p), _P(c_float_p), _P(c_float_p),
                                            _P(ctypes.c_uint64), ctypes.c_size_t, _P(Status)]),
    "fps_client_push_pull_ex": (ctypes.c_int, [ctypes.c_void_p, _P(PushArgs), _P(ctypes.c_char_p),
                                               _P(c_float_p), _P(TensorPush), _P(c_float_p),
                                               _P(ctypes.c_uint64), ctypes.c_size_t, _P(Status)]),
    "fps_client_get_state": (ctypes.c_int, [ctypes.c_void_p, _P(ctypes.c_char_p), ctypes.c_size_t,
                                            _P(TensorState), _P(c_float_p), _P(c_float_p),
                                            _P(c_float_p), _P(c_float_p), _P(Status)]),
    "fps_client_pull": (ctypes.c_int, [ctypes.c_void_p, _P(ctypes.c_char_p), _P(c_float_p),
                                       _P(ctypes.c_uint64), ctypes.c_size_t, _P(Status)]),
    "fps_client_stats": (ctypes.c_int, [ctypes.c_void_p, _P(ShardStats), ctypes.c_size_t,
                                        _P(Status)]),
    "fps_client_shard_count": (ctypes.c_size_t, [ctypes.c_void_p]),
    "fps_code_name": (ctypes.c_char_p, [ctypes.c_int]),
    "fps_client_tensor_shape": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p,
                                               _P(ctypes.c_uint32), _P(ctypes.c_uint64)]),
    "fps_client_tensor_stats": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p, _P(TensorStats),
                                               _P(ApplyRecord), ctypes.c_size_t,
                                               _P(ctypes.c_size_t), _P(Status)]),
    "fps_client_discover": (ctypes.c_int, [ctypes.c_void_p, _P(ctypes.c_size_t), _P(Status)]),
    "fps_client_tensor_blocks": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p, _P(Block),
                                                ctypes.c_size_t]),
    "fps_client_placement_plan": (ctypes.c_int, [_P(TensorDef), ctypes.c_size_t, ctypes.c_size_t,
                                                 ctypes.c_uint64, _P(Block), ctypes.c_size_t,
                                                 _P(ctypes.c_size_t), _P(ctypes.c_uint64),
                                                 _P(Status)]),
    "fps_client_checkpoint": (ctypes.c_int, [ctypes.c_void_p, _P(CheckpointInfo), ctypes.c_size_t,
                                             _P(Status)]),
}

_lock = threading.Lock()
_lib = None


def _package_dir():
    return os.path.dirname(os.path.abspath(__file__))


def candidates():
    """Library paths or names to try, in order (see the module docstring)."""
    out = []
    pkg = _package_dir()
    out += sorted(glob.glob(os.path.join(pkg, "libfactorps.so*")))
    # <repo>/client/python/factorps -> <repo>
    repo = os.path.dirname(os.path.dirname(os.path.dirname(pkg)))
    built = glob.glob(os.path.join(repo, "build*", "client", "libfactorps.so"))
    # The plain build/ first (a sanitizer build needs its runtime preloaded),
    # then the most recently built.
    built.sort(key=lambda p: (os.path.basename(os.path.dirname(os.path.dirname(p))) != "build",
                              -os.path.getmtime(p)))
    out += built
    found = ctypes.util.find_library("factorps")
    if found:
        out.append(found)
    out += ["libfactorps.so", "libfactorps.so.0"]
    return out


def _bind(lib):
    # Every function is required: the package and the library are built
    # from the same tree, so a library without one is an old or foreign
    # build (AttributeError, reported by load()).
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def load():
    """The loaded, declared libfactorps (loaded once per process)."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        env = os.environ.get("FACTORPS_LIB")
        if env:
            try:
                _lib = _bind(ctypes.CDLL(env))
            except (OSError, AttributeError) as e:
                raise LibraryNotFoundError(f"FACTORPS_LIB={env} does not load as libfactorps: {e}")
            return _lib
        tried = []
        for cand in candidates():
            try:
                lib = _bind(ctypes.CDLL(cand))
            except (OSError, AttributeError) as e:
                tried.append(f"{cand}: {e}")
                continue
            _lib = lib
            return _lib
        raise LibraryNotFoundError(
            "libfactorps.so not found; set FACTORPS_LIB to its path, install it, or build it "
            "(cmake -S . -B build && cmake --build build). Tried:\n  " + "\n  ".join(tried))


def path():
    """The file the loaded library came from (for diagnostics)."""
    lib = load()
    return lib._name
