"""factorps: Python workers for the factorps parameter server.

    import factorps
    with factorps.connect(["127.0.0.1:7000", "127.0.0.1:7001"], worker_id=0) as c:
        c.create([factorps.TensorSpec("w", (64, 10), init=w0)])
        params, versions = c.push_pull({"w": grad})
        print(c.stats()[0]["state_bytes"])

PyTorch: `factorps.torch.RemoteAdafactor` is a torch.optim.Optimizer that
keeps its state on the shards. `factorps.reference` is a plain numpy
Adafactor (the math the shards run), for tests and checks.

The C library libfactorps is loaded on first use (see factorps._lib for where
it is looked for; FACTORPS_LIB overrides).
"""

from .client import Client, TensorSpec, connect, optimizer_config, placement_plan
from .errors import (AbortedError, AlreadyExistsError, CancelledError, DataLossError,
                     DeadlineExceededError, Error, FailedPreconditionError, InternalError,
                     InvalidArgumentError, LibraryNotFoundError, NotFoundError, OutOfRangeError,
                     PermissionDeniedError, ResourceExhaustedError, STATUS_NAMES,
                     UnauthenticatedError, UnavailableError, UnimplementedError, UnknownError)

__version__ = "0.1.0"

# The split threshold libfactorps recommends (FPS_SPLIT_MIN_BYTES_DEFAULT,
# 32 MiB): pass it as connect(split_min_bytes=...) on shards started with
# --peers. Not the default: a split tensor needs every shard to have
# --peers and to run --mode sync, and a shard without them refuses the
# blocks (FAILED_PRECONDITION), so splitting stays something a job opts in to.
SPLIT_MIN_BYTES_DEFAULT = 32 << 20

__all__ = [
    "Client", "TensorSpec", "connect", "optimizer_config", "Error", "LibraryNotFoundError",
    "STATUS_NAMES", "AbortedError", "AlreadyExistsError", "CancelledError", "DataLossError",
    "DeadlineExceededError", "FailedPreconditionError", "InternalError", "InvalidArgumentError",
    "NotFoundError", "OutOfRangeError", "PermissionDeniedError", "ResourceExhaustedError",
    "UnauthenticatedError", "UnavailableError", "UnimplementedError", "UnknownError",
    "library_path", "placement_plan", "SPLIT_MIN_BYTES_DEFAULT",
]


def library_path():
    """Path of the libfactorps that is (or would be) loaded."""
    from . import _lib
    return _lib.path()
