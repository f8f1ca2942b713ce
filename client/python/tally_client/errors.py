"""Why a call failed: the ErrorInfo reason tally attaches to its errors.

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

import grpc

from tally.rpc import error_details_pb2, status_pb2

ERROR_DOMAIN = "tally.v1"

# Codes retried when the server sent no reason (the transport failed, the
# deadline passed before an answer).
TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE,
                             grpc.StatusCode.DEADLINE_EXCEEDED})

_DETAILS_KEY = "grpc-status-details-bin"


def error_details(error):
    """(reason, retry_delay_seconds) of a grpc.RpcError; None for either
    that the server did not send."""
    reason = delay = None
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


def is_retryable(code, reason, retry_delay):
    """Whether retrying the same request can succeed: for a tally reason, the
    server says so by sending a RetryInfo (its table in base/error_reason.cc
    is the only list); without one, for a transient code."""
    if reason is not None:
        return retry_delay is not None
    return code in TRANSIENT_CODES
