"""Exceptions of the factorps package.

Every failure of a libfactorps call raises a subclass of `Error` chosen by the
gRPC status code the library returned, so callers can catch what they can
handle (`except factorps.UnavailableError`) or everything (`except
factorps.Error`). Checks the binding does itself before calling into C (a
buffer of the wrong shape, an unknown tensor name) raise the same classes with
`shard == -1`, since the library would have answered with that code.
"""

# gRPC status codes, as in client.h (fps_code_t): the numbers are the wire's.
STATUS_NAMES = {
    0: "OK",
    1: "CANCELLED",
    2: "UNKNOWN",
    3: "INVALID_ARGUMENT",
    4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND",
    6: "ALREADY_EXISTS",
    7: "PERMISSION_DENIED",
    8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION",
    10: "ABORTED",
    11: "OUT_OF_RANGE",
    12: "UNIMPLEMENTED",
    13: "INTERNAL",
    14: "UNAVAILABLE",
    15: "DATA_LOSS",
    16: "UNAUTHENTICATED",
}


class Error(Exception):
    """A failed factorps call.

    Attributes: `code` (gRPC status number), `code_name` ("UNAVAILABLE"),
    `message` (the library's text, naming the tensor/shard), `shard` (the
    shard index the error came from, or -1).
    """

    code = 2

    def __init__(self, message, code=None, shard=-1):
        if code is not None:
            self.code = int(code)
        self.code_name = STATUS_NAMES.get(self.code, f"CODE_{self.code}")
        self.message = message
        self.shard = shard
        where = f" (shard {shard})" if shard is not None and shard >= 0 else ""
        super().__init__(f"{self.code_name}{where}: {message}")


class LibraryNotFoundError(ImportError):
    """libfactorps.so could not be found or loaded; the message lists where we looked."""


def _make(name, code, doc):
    return type(name, (Error,), {"code": code, "__doc__": doc, "__module__": __name__})


CancelledError = _make("CancelledError", 1, "The call was cancelled.")
UnknownError = _make("UnknownError", 2, "An error without a more specific code.")
InvalidArgumentError = _make("InvalidArgumentError", 3,
                             "Malformed request: bad shape, non-finite gradient, bad option.")
DeadlineExceededError = _make("DeadlineExceededError", 4,
                              "The call's deadline passed (e.g. a sync round never completed).")
NotFoundError = _make("NotFoundError", 5, "Unknown tensor (e.g. a shard restarted empty).")
AlreadyExistsError = _make("AlreadyExistsError", 6,
                           "Create mismatch (same name, other shape/settings) or duplicate push.")
PermissionDeniedError = _make("PermissionDeniedError", 7, "Not allowed.")
ResourceExhaustedError = _make("ResourceExhaustedError", 8, "A size or count limit was hit.")
FailedPreconditionError = _make("FailedPreconditionError", 9,
                                "Wrong step, wrong shard, or tensor not initialised yet.")
AbortedError = _make("AbortedError", 10, "The call was aborted.")
OutOfRangeError = _make("OutOfRangeError", 11, "A value is out of range.")
UnimplementedError = _make("UnimplementedError", 12, "The shard does not implement this call.")
InternalError = _make("InternalError", 13, "A bug in the library or the shard.")
UnavailableError = _make("UnavailableError", 14,
                         "A shard could not be reached (after the library's retries).")
DataLossError = _make("DataLossError", 15, "Unrecoverable data loss.")
UnauthenticatedError = _make("UnauthenticatedError", 16, "Missing or wrong credentials.")

_BY_CODE = {cls.code: cls for cls in (
    CancelledError, UnknownError, InvalidArgumentError, DeadlineExceededError, NotFoundError,
    AlreadyExistsError, PermissionDeniedError, ResourceExhaustedError, FailedPreconditionError,
    AbortedError, OutOfRangeError, UnimplementedError, InternalError, UnavailableError,
    DataLossError, UnauthenticatedError)}


def error_for(code, message, shard=-1):
    """The Error subclass instance for a gRPC status code."""
    cls = _BY_CODE.get(int(code))
    if cls is None:
        return Error(message, code=code, shard=shard)
    return cls(message, shard=shard)
