"""Why a call failed: an exception class per gRPC status code, and the
ErrorInfo reason tally attaches to its errors.

Every failure the clients raise is a TallyError of the class of its status
code (InvalidArgumentError, NotFoundError, ResourceExhaustedError, ...;
error_class() maps a code to its class), carrying the code, the server's
details and its reason:

    try:
        info = client.get_model()
    except tally_client.NotFoundError:
        info = client.create_model(dtype="bf16")
    except tally_client.TallyError as error:
        print(error.code, error.reason)

Each class is also the exception class of Tinker's SDK for the HTTP status
its gRPC code maps to (Google's canonical mapping: INVALID_ARGUMENT is
BadRequestError, NOT_FOUND NotFoundError, RESOURCE_EXHAUSTED RateLimitError,
INTERNAL InternalServerError, ...), all of them TinkerError and APIError, so
that a Tinker program's `except tinker.BadRequestError` catches tally's
failures (tally_client.tinker re-exports these names).

The server sends, with a failed call's status code, a google.rpc.Status in
gRPC's `grpc-status-details-bin` trailer holding a google.rpc.ErrorInfo (a
stable `reason`, domain "tally.v1") and, when retrying the same request can
succeed, a google.rpc.RetryInfo. docs/reliability.md lists the reasons.

    try:
        stub.ForwardBackward(request)
    except grpc.RpcError as error:
        reason, delay = error_details(error)
        if is_retryable(error.code(), reason, delay): ...
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Type

import grpc

from tally_client._proto.tally.rpc import error_details_pb2, status_pb2

ERROR_DOMAIN = "tally.v1"

# Codes retried when the server sent no reason (the transport failed, the
# deadline passed before an answer).
TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE,
                             grpc.StatusCode.DEADLINE_EXCEEDED})

_DETAILS_KEY = "grpc-status-details-bin"


# ---- Tinker's exception classes (tinker._exceptions' names and hierarchy)


class TinkerError(Exception):
    """The base of Tinker's exceptions (and of every TallyError)."""


class APIError(TinkerError):
    """A failed API call (Tinker's); `message` is the error's text and
    `body` None (gRPC answers carry no body)."""

    message: str = ""
    body: object = None


class APIStatusError(APIError):
    """A call the server answered with an error status; `status_code` is
    the HTTP status Tinker would report for it."""

    status_code: int = 500


class APIConnectionError(APIError):
    """The server could not be reached (gRPC UNAVAILABLE)."""


class APITimeoutError(APIConnectionError):
    """No answer within the timeout (gRPC DEADLINE_EXCEEDED)."""


class APIResponseValidationError(APIError):
    """An answer that does not fit its type (Tinker's name; tally's
    clients raise ValueError for those instead)."""


class BadRequestError(APIStatusError):
    """HTTP 400: INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE."""

    status_code = 400


class AuthenticationError(APIStatusError):
    """HTTP 401: UNAUTHENTICATED."""

    status_code = 401


class _PermissionDenied(APIStatusError):
    """HTTP 403: PERMISSION_DENIED (PermissionDeniedError below)."""

    status_code = 403


class _NotFound(APIStatusError):
    """HTTP 404: NOT_FOUND (NotFoundError below)."""

    status_code = 404


class ConflictError(APIStatusError):
    """HTTP 409: ALREADY_EXISTS, ABORTED."""

    status_code = 409


class UnprocessableEntityError(APIStatusError):
    """HTTP 422 (Tinker's name; no gRPC code maps to it)."""

    status_code = 422


class RateLimitError(APIStatusError):
    """HTTP 429: RESOURCE_EXHAUSTED."""

    status_code = 429


class InternalServerError(APIStatusError):
    """HTTP 500 and up: INTERNAL, UNKNOWN, DATA_LOSS, UNIMPLEMENTED (501)."""


class RequestFailedError(TinkerError):
    """Tinker's failed asynchronous request (Tinker's name; tally's
    requests fail with the class of their status code instead)."""


class TallyError(APIError):
    """A call failed for good; `code` is its grpc.StatusCode, `reason` the
    server's ErrorInfo reason (None when it sent none). Raised as the
    subclass of its code (error_class)."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str,
                 reason: Optional[str] = None) -> None:
        suffix = f" [{reason}]" if reason else ""
        super().__init__(f"{method}: {code.name}: {details}{suffix}")
        self.method = method
        self.code = code
        self.details = details
        self.reason = reason
        self.message = str(self)


class CancelledError(TallyError):
    """CANCELLED: the call was cancelled, usually by the caller."""


class UnknownError(TallyError, InternalServerError):
    """UNKNOWN: an error without a better code."""


class InvalidArgumentError(TallyError, BadRequestError):
    """INVALID_ARGUMENT: a field of the request is bad; the details name
    it."""


class DeadlineExceededError(TallyError, APITimeoutError):
    """DEADLINE_EXCEEDED: no answer within the timeout (retried first)."""


class NotFoundError(TallyError, _NotFound):
    """NOT_FOUND: no such model, checkpoint or directory."""


class AlreadyExistsError(TallyError, ConflictError):
    """ALREADY_EXISTS: what the call would create exists."""


class PermissionDeniedError(TallyError, _PermissionDenied):
    """PERMISSION_DENIED: the token may not do this (e.g. a path outside
    the server's --checkpoint-root)."""


class ResourceExhaustedError(TallyError, RateLimitError):
    """RESOURCE_EXHAUSTED: a queue, memory or message limit; the reason
    says which, and whether a retry can succeed."""


class FailedPreconditionError(TallyError, BadRequestError):
    """FAILED_PRECONDITION: the model's state does not allow the call (a
    save with a pending window, a step with nothing accumulated)."""


class AbortedError(TallyError, ConflictError):
    """ABORTED: the call was abandoned (a poisoned window, a sequence
    gap)."""


class OutOfRangeError(TallyError, BadRequestError):
    """OUT_OF_RANGE: a value past its valid range."""


class UnimplementedError(TallyError, InternalServerError):
    """UNIMPLEMENTED: the server does not have this method or feature."""


class InternalError(TallyError, InternalServerError):
    """INTERNAL: the server failed; the window is poisoned."""


class UnavailableError(TallyError, APIConnectionError):
    """UNAVAILABLE: the server cannot be reached or is shutting down
    (retried first)."""


class DataLossError(TallyError, InternalServerError):
    """DATA_LOSS: stored data are damaged (a checkpoint's files)."""


class UnauthenticatedError(TallyError, AuthenticationError):
    """UNAUTHENTICATED: no token, or a wrong one."""


class WindowAbortedError(AbortedError):
    """The accumulation window cannot be stepped: call abort_window() and
    redo its forward_backward calls."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str,
                 reason: Optional[str] = None) -> None:
        super().__init__(
            method, code,
            f"{details} -- the accumulation window is poisoned or incomplete: "
            f"call abort_window() and redo the window's forward_backward calls",
            reason)


class PendingWindowError(FailedPreconditionError):
    """The model has a pending window this client did not send (another
    client's, or one restored from a checkpoint). Choose explicitly:
    TrainingClient(..., pending_window="abort") discards it, "continue" adds
    this client's calls to it; pending_window() shows it."""


_CLASS_OF_CODE: Dict[grpc.StatusCode, Type[TallyError]] = {
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNKNOWN: UnknownError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    # A call the server aborted leaves a window that must be redone.
    grpc.StatusCode.ABORTED: WindowAbortedError,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRangeError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DATA_LOSS: DataLossError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
}


def error_class(code: grpc.StatusCode) -> Type[TallyError]:
    """The exception class the clients raise for status `code`
    (WindowAbortedError for ABORTED; TallyError for OK, which no failure
    has)."""
    return _CLASS_OF_CODE.get(code, TallyError)


def error_details(
        error: grpc.RpcError) -> Tuple[Optional[str], Optional[float]]:
    """(reason, retry_delay_seconds) of a grpc.RpcError; None for either
    that the server did not send."""
    reason: Optional[str] = None
    delay: Optional[float] = None
    trailers = error.trailing_metadata() if hasattr(
        error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key != _DETAILS_KEY:
            continue
        status = status_pb2.Status()
        try:
            status.ParseFromString(value)
        except Exception:  # pylint: disable=broad-except
            return None, None  # not a google.rpc.Status: no details
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            retry = error_details_pb2.RetryInfo()
            if detail.Unpack(info) and info.domain == ERROR_DOMAIN:
                reason = info.reason
            elif detail.Unpack(retry):
                delay = (retry.retry_delay.seconds
                         + retry.retry_delay.nanos / 1e9)
    return reason, delay


def is_retryable(code: grpc.StatusCode, reason: Optional[str],
                 retry_delay: Optional[float]) -> bool:
    """Whether retrying the same request can succeed: for a tally reason, the
    server says so by sending a RetryInfo (its table in base/error_reason.cc
    is the only list); without one, for a transient code."""
    if reason is not None:
        return retry_delay is not None
    return code in TRANSIENT_CODES
